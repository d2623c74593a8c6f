"""Exact, order-independent summation of floating-point tensors.

Sums of float64 values depend on the order they are added in, so "accumulate per
batch, then merge ranks" would differ from "compute on everything" in the last bits.
ExactSum instead splits each value into integer mantissa parts and adds them in
int64 buckets, one per binary exponent: integer addition is exact and associative,
so any split of the data into batches and ranks gives bit-identical results, and
:meth:`value` rounds the exact total once to the nearest float64.

    x = m * 2**e  (frexp, m in [0.5, 1))  ->  m * 2**53 = hi * 2**26 + lo   (integers)
    bucket[e]: sum of hi (|hi| < 2**27) and of lo (|lo| < 2**26), int64

An int64 bucket holds at least 2**36 (68 billion) additions before it could overflow.
"""

from __future__ import annotations

import math

import torch

from ..errors import InputError

__all__ = ["ExactSum"]

_EMIN = -1073  # smallest frexp exponent of a float64 (subnormals included)
_EMAX = 1024
_NB = _EMAX - _EMIN + 1


class ExactSum:
    """Running exact sum of float values on any device.

    Example::

        >>> s = ExactSum()
        >>> s.add(torch.tensor([1e16, 1.0, -1e16]))   # plain float64 summation gives 0.0
        >>> s.value()
        1.0
    """

    __slots__ = ("_buckets", "count")

    #: exact_scaled() / SCALE is the exact sum
    SCALE = 1 << (53 - _EMIN)

    def __init__(self) -> None:
        self._buckets: torch.Tensor | None = None  # int64 [2, NB] (hi, lo), on the device of the data
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """Adds every element of `x` (any float dtype; must be finite)."""
        x = x.detach().reshape(-1).to(torch.float64)
        if x.numel() == 0:
            return
        if not bool(torch.isfinite(x).all()):
            raise InputError("ExactSum: values must be finite (got NaN or inf)")
        m, e = torch.frexp(x)
        m53 = m * 2.0**53  # an exact integer in float64
        hi = torch.trunc(m53 / 2.0**26)
        lo = m53 - hi * 2.0**26
        idx = (e.to(torch.int64) - _EMIN).clamp_(0, _NB - 1)  # zeros give e = 0, their parts are 0
        if self._buckets is None:
            self._buckets = torch.zeros(2, _NB, dtype=torch.int64, device=x.device)
        elif self._buckets.device != x.device:
            self._buckets = self._buckets.to(x.device)
        self._buckets[0].index_add_(0, idx, hi.to(torch.int64))
        self._buckets[1].index_add_(0, idx, lo.to(torch.int64))
        self.count += x.numel()

    def merge(self, other: "ExactSum") -> "ExactSum":
        """Adds `other`'s values to this sum (exactly); returns self."""
        if other._buckets is not None:
            if self._buckets is None:
                self._buckets = other._buckets.clone()
            else:
                self._buckets += other._buckets.to(self._buckets.device)
        self.count += other.count
        return self

    def reset(self) -> None:
        self._buckets = None
        self.count = 0

    def exact_scaled(self) -> int:
        """The exact sum times ``2 ** (53 - _EMIN)``, as a Python int."""
        if self._buckets is None:
            return 0
        b = self._buckets.cpu()
        nz = torch.nonzero((b[0] != 0) | (b[1] != 0)).reshape(-1).tolist()
        hi, lo = b[0].tolist(), b[1].tolist()
        return sum(((hi[k] << 26) + lo[k]) << k for k in nz)

    def value(self) -> float:
        """The exact sum rounded once to the nearest float64 (0.0 when empty, +-inf beyond float64)."""
        scaled = self.exact_scaled()
        try:
            return scaled / self.SCALE
        except OverflowError:
            return math.inf if scaled > 0 else -math.inf
