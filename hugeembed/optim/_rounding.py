"""Rounding the twins' float32 results back to 16-bit weights: nearest, or stochastic.

Round-to-nearest loses every update smaller than half an ulp of the weight (a bf16
weight of 1.0 ignores any step below 2^-8): over many small steps the weight stalls.
Stochastic rounding (FBGEMM's for fp16/bf16 weights) rounds x, lying between the two
representable neighbours lo < x < hi, up to hi with probability (x - lo) / (hi - lo)
and down otherwise, so E[round(x)] = x exactly and small updates survive on average.

The uniform draw is a pure function of (table seed, step, key, column)
(:func:`hugeembed._hashing.counter_uniform`): a run is reproducible, and the same row updated
at the same step rounds the same way on any device, shard or slot.
"""

from __future__ import annotations

import torch

from .._hashing import counter_uniform

__all__ = ["round_stochastic"]


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, *, seeds: int | torch.Tensor, step: int,
                     keys: torch.Tensor) -> torch.Tensor:
    """`x` ``[U, D]`` (float32) rounded to `dtype`, up with probability equal to the fraction
    of the gap it covers; row i draws from (seeds (one int, or seeds[i]), step, keys[i], column).

    Exact values, infinities, NaN, and values whose nearest neighbour overflows keep their
    round-to-nearest result (the other neighbour of a finite value past the largest
    finite one is inf, taken with probability 0)."""
    near = x.to(dtype)
    nf = near.to(x.dtype)
    inf = torch.full_like(near, float("inf"))
    other = torch.nextafter(near, torch.where(nf < x, inf, -inf))  # the neighbour on x's other side
    lo = torch.where(nf < x, near, other).double()
    hi = torch.where(nf < x, other, near).double()
    p_up = (x.double() - lo) / (hi - lo)  # in (0, 1) where inexact; exact: both operands are floats
    u = counter_uniform(seeds, step, keys, x.shape[1])
    up = u < p_up  # P(u < p) = p up to the 2^-53 grid of u
    out = torch.where(up, hi, lo).to(dtype)
    keep = (nf == x) | ~torch.isfinite(nf) | ~torch.isfinite(other.to(x.dtype))
    return torch.where(keep, near, out)
