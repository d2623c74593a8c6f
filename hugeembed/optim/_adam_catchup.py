"""Global Adam's catch-up: replaying a row's skipped zero-gradient steps in O(1) amortised.

In dense Adam an untouched row still moves: at every step s its moments decay
(m *= b1, v *= b2) and its weight takes the step ``dw_s = step_size_s * m / denom_s``
(plus AdamW's decay ``w *= c``, c = 1 - lr * wd).  When a row last brought up to
date at step L is touched at step t, the steps L+1 .. t-1 are replayed here, one by
one and exactly as the dense update would run them, until what is left is provably
negligible.

The bound.  After the replayed step s, with the row's current m, v, every later
step s + j (j >= 1) moves the weight by at most::

    |dw_{s+j}| <= S * b1^j |m| / max(eps, b2^(j/2) sqrt(v))      S = lr / (1 - b1^s)

because the step size lr / (1 - b1^{s+j}) (torch) or lr sqrt(1 - b2^{s+j}) / (1 - b1^{s+j})
(tf) is at most S, and the denominator sqrt(v_{s+j}) / sqrt(bc2) + eps (or sqrt(v) + eps)
is at least both eps and sqrt(v_{s+j}) = b2^(j/2) sqrt(v).  Summing the geometric series
with r = b1 / sqrt(b2)::

    tail <= S |m| * min( 1 / (eps (1 - b1)),  1 / (sqrt(v) (1 - r)) )   (second term only if r < 1)

The replay stops once ``tail <= tol * |w| * c^gap`` for every element of the row, with
tol = (machine epsilon of the storage dtype) / 16 (2^-27 for float32): the rest of the
replay could not move the weight by more than a small fraction of one unit in its last
place, so stopping changes nothing the storage can represent (c^gap <= c^rem keeps the
bound relative to the decayed final weight).  The remaining steps' moment decay (and
AdamW decay) is then applied in closed form: m *= b1^rem, v *= b2^rem, w *= c^rem.
A row with m == 0 (e.g. never touched) stops at once.  With b1 = 0.9, b2 = 0.999 the
replay typically stops after ~100-200 steps, however long the gap.

The native kernel (csrc/optim_adam.cpp, adam_catch_up) runs the identical loop.
"""

from __future__ import annotations

import math

import torch

from ._kernel_floats import rdiv, sqrt_rn

__all__ = ["catch_up_rows", "negligible_fraction", "bound_factors"]


def negligible_fraction(dtype: torch.dtype) -> float:
    """tol: a replay tail below ``tol * |w|`` cannot change `w` stored in `dtype`."""
    return torch.finfo(dtype).eps / 16


def bound_factors(beta1: float, beta2: float, eps: float) -> tuple[float, float]:
    """(1 / (eps (1 - b1)), 1 / (1 - b1 / sqrt(b2)) or inf): the two tail-sum factors."""
    a = 1.0 / (eps * (1.0 - beta1))
    r = beta1 / math.sqrt(beta2) if beta2 > 0.0 else math.inf
    b = 1.0 / (1.0 - r) if r < 1.0 else math.inf
    return a, b


def catch_up_rows(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, last: torch.Tensor, gap: torch.Tensor, *,
                  lr: float, betas: tuple[float, float], eps: float, weight_decay: float, epsilon: str,
                  tol: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replays `gap` zero-gradient steps after step `last` for each row; returns new (w, m, v).

    Args:
        w, m, v: ``[n, D]`` rows in the compute dtype.
        last: int64 ``[n]`` step each row was last brought up to date.
        gap: int64 ``[n]`` (> 0) number of skipped steps to replay.
        weight_decay: the decoupled (AdamW) decay, or 0.
        epsilon: "torch" or "tf" placement.
        tol: the negligible fraction of |w| (:func:`negligible_fraction`).
    """
    cd = w.dtype
    b1, b2 = betas
    decay = weight_decay != 0.0
    c = 1.0 - lr * weight_decay
    fa, fb = bound_factors(b1, b2, eps)
    # Float32 copies of the tail factors, rounded once as the kernel does.
    fa, fb = torch.tensor(fa, dtype=cd).item(), torch.tensor(fb, dtype=cd).item()
    out_w, out_m, out_v = w.clone(), m.clone(), v.clone()
    idx = torch.arange(w.shape[0], device=w.device)
    gap_d = gap.double()
    cg = torch.pow(c, gap_d).to(cd)[:, None] if decay else None
    p1 = torch.pow(b1, (last + 1).double())
    p2 = torch.pow(b2, (last + 1).double())
    k = 0
    while idx.numel():
        bc1, bc2 = 1.0 - p1, 1.0 - p2
        if epsilon == "tf":
            step_scale, dscale = (lr * bc2.sqrt() / bc1).to(cd)[:, None], 1.0
        else:
            step_scale, dscale = rdiv(lr, bc1).to(cd)[:, None], bc2.sqrt().to(cd)[:, None]
        big_s = rdiv(lr, bc1).to(cd)[:, None]
        if decay:
            w = w * c
        m = m * b1
        v = v * b2
        sq = sqrt_rn(v)
        w = w - (m / (sq / dscale + eps)) * step_scale
        k += 1
        am = m.abs() * big_s
        bound = torch.minimum(am * fa, (am * fb) / sq)
        limit = w.abs() * tol
        if decay:
            limit = limit * cg
        done = ((m == 0) | (bound <= limit)).all(dim=1) | (gap[idx] <= k)
        if bool(done.any()):
            fin = done.nonzero().squeeze(1)
            rem = (gap_d[idx[fin]] - k)[:, None]
            where = idx[fin]
            out_m[where] = m[fin] * torch.pow(b1, rem).to(cd)
            out_v[where] = v[fin] * torch.pow(b2, rem).to(cd)
            out_w[where] = w[fin] * torch.pow(c, rem).to(cd) if decay else w[fin]
            keep = (~done).nonzero().squeeze(1)
            idx, w, m, v, p1, p2 = idx[keep], w[keep], m[keep], v[keep], p1[keep], p2[keep]
            if decay:
                cg = cg[keep]
        p1 = p1 * b1
        p2 = p2 * b2
    return out_w, out_m, out_v
