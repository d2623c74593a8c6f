"""Initial values of embedding rows: deterministic per (seed, key, column).

A dynamic table creates a row the first time it sees a key, in whatever batch,
shard or device that happens.  To make training reproducible the initial row must
not depend on any of that, so every value is a pure function of (seed, key,
column) computed by a counter-based generator built on ``mix64``::

    base(key)      = mix64(key ^ mix64(seed + GOLDEN))
    u(key, stream) = (mix64(base + stream * STREAM) >>> 11) * 2**-53      in [0, 1)

    uniform col j  : low + (high - low) * u(key, j)
    normal  col j  : Box-Muller on the pair q = j // 2, attempt a, stream s = a * 2**40 + 2q
                     r = sqrt(-2 log(1 - u(s))), t = 2 pi u(s + 1)
                     z = r cos t (j even) or r sin t (j odd)
    truncated      : z outside [a, b] (in std units) redrawn with the next attempt

csrc/store_init.cpp evaluates the same double expressions, so the native and the
torch paths give rows equal within one float32 ulp (their log/cos differ in the
last bit of a double at most).

Example::

    >>> init = TruncatedNormal(0.0, 0.05)
    >>> rows = init.generate(torch.tensor([7, 42]), dim=4, seed=0)   # [2, 4] float32
    >>> torch.equal(rows[1], init.generate(torch.tensor([42]), 4, 0)[0])
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .. import _native
from .._hashing import logical_shift_right, mix64, mix64_int
from ..errors import ConfigError, InputError

__all__ = ["Initializer", "Uniform", "Normal", "TruncatedNormal", "Constant", "Zeros", "FromCallable"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STREAM = 0xD1B54A32D192ED03
_TWO_PI = 6.283185307179586
_MAX_ATTEMPTS = 64


def _signed(u: int) -> int:
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def _base(keys: torch.Tensor, seed: int) -> torch.Tensor:
    return mix64(keys ^ mix64_int((seed + _GOLDEN) & _MASK64))


def _unit(base: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """u(key, stream) as float64: base [n, 1], stream int64 [c] -> [n, c]."""
    x = mix64(base + stream * _signed(_STREAM))
    return logical_shift_right(x, 11).to(torch.float64) * 2.0**-53


def _normal(base: torch.Tensor, cols: torch.Tensor, attempt: int) -> torch.Tensor:
    """Standard normal z for columns `cols` (int64 [c]) at one attempt -> float64 [n, c]."""
    s = (attempt << 40) + 2 * (cols >> 1)
    r = torch.sqrt(-2.0 * torch.log(1.0 - _unit(base, s)))
    t = _TWO_PI * _unit(base, s + 1)
    odd = (cols & 1).bool()
    return torch.where(odd, r * torch.sin(t), r * torch.cos(t))


class Initializer:
    """Base class: ``generate(keys, dim, seed)`` returns the initial rows of `keys`.

    Subclasses are frozen dataclasses.  ``_native_spec`` gives the kernel's
    (kind, params) for csrc/store_init.cpp, or None when only the torch path exists.
    """

    def generate(self, keys: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
        """Rows for `keys` (int64 [n]) -> float32 [n, dim] on keys.device."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate()")

    def _native_spec(self) -> tuple[int, tuple[float, float, float, float]] | None:
        return None


@dataclass(frozen=True)
class Constant(Initializer):
    """Every value equals `value`."""

    value: float = 0.0

    def __post_init__(self):
        if not math.isfinite(self.value):
            raise ConfigError(f"Constant initializer: value must be finite, got {self.value}")

    def generate(self, keys, dim, seed):
        return torch.full((keys.numel(), dim), float(self.value), dtype=torch.float32, device=keys.device)

    def _native_spec(self):
        return 0, (float(self.value), 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Zeros(Constant):
    """Every value is 0 (HugeCTR/SOK default for wide tables)."""

    value: float = 0.0

    def __post_init__(self):
        if self.value != 0.0:
            raise ConfigError(f"Zeros initializer takes no value, got {self.value}")


@dataclass(frozen=True)
class Uniform(Initializer):
    """Uniform on [low, high) (OneEmbedding's make_uniform_initializer)."""

    low: float = -0.05
    high: float = 0.05

    def __post_init__(self):
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ConfigError(f"Uniform initializer: need finite low < high, got low={self.low}, high={self.high}")

    def generate(self, keys, dim, seed):
        u = _unit(_base(keys, seed)[:, None], torch.arange(dim, device=keys.device))
        return (self.low + (self.high - self.low) * u).to(torch.float32)

    def _native_spec(self):
        return 1, (float(self.low), float(self.high), 0.0, 0.0)


@dataclass(frozen=True)
class Normal(Initializer):
    """Gaussian N(mean, std**2) by Box-Muller."""

    mean: float = 0.0
    std: float = 0.05

    def __post_init__(self):
        if not (math.isfinite(self.mean) and math.isfinite(self.std) and self.std > 0):
            raise ConfigError(f"Normal initializer: need finite mean and std > 0, got mean={self.mean}, std={self.std}")

    def generate(self, keys, dim, seed):
        z = _normal(_base(keys, seed)[:, None], torch.arange(dim, device=keys.device), 0)
        return (self.mean + self.std * z).to(torch.float32)

    def _native_spec(self):
        return 2, (float(self.mean), float(self.std), 0.0, 0.0)


@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """N(mean, std**2) with draws outside [a, b] standard deviations redrawn (TF's truncated_normal).

    Redraws are deterministic (attempt 1, 2, ... of the same counter stream).
    """

    mean: float = 0.0
    std: float = 0.05
    a: float = -2.0
    b: float = 2.0

    def __post_init__(self):
        if not (math.isfinite(self.mean) and math.isfinite(self.std) and self.std > 0):
            raise ConfigError(
                f"TruncatedNormal initializer: need finite mean and std > 0, got mean={self.mean}, std={self.std}"
            )
        if not (math.isfinite(self.a) and math.isfinite(self.b) and self.a < self.b):
            raise ConfigError(f"TruncatedNormal initializer: need finite a < b, got a={self.a}, b={self.b}")

    def generate(self, keys, dim, seed):
        base = _base(keys, seed)[:, None]
        cols = torch.arange(dim, device=keys.device)
        z = _normal(base, cols, 0)
        for attempt in range(1, _MAX_ATTEMPTS):
            bad = (z < self.a) | (z > self.b)
            rows, cs = bad.nonzero(as_tuple=True)
            if rows.numel() == 0:
                break
            # Redraw only the offending values: attempt `attempt` of their own column.
            z[rows, cs] = _normal(base[rows], cs[:, None], attempt).reshape(-1)
        z = z.clamp(self.a, self.b)
        return (self.mean + self.std * z).to(torch.float32)

    def _native_spec(self):
        return 3, (float(self.mean), float(self.std), float(self.a), float(self.b))


@dataclass(frozen=True)
class FromCallable(Initializer):
    """Rows from a user function ``fn(keys LongTensor[n], dim) -> Tensor[n, dim]``.

    The function should itself be deterministic per key for reproducible tables.
    """

    fn: Callable[[torch.Tensor, int], torch.Tensor]

    def __post_init__(self):
        if not callable(self.fn):
            raise ConfigError(f"FromCallable initializer: fn must be callable, got {type(self.fn).__name__}")

    def generate(self, keys, dim, seed):
        rows = self.fn(keys, dim)
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (keys.numel(), dim):
            got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise InputError(f"FromCallable initializer: fn returned {got}, expected a tensor of shape {(keys.numel(), dim)}")
        return rows.to(device=keys.device)


def default_initializer(dim: int) -> Initializer:
    """TF's embedding_column default: truncated normal, std 1/sqrt(dim)."""
    return TruncatedNormal(0.0, 1.0 / math.sqrt(dim))


def init_rows_native(init: Initializer, keys: torch.Tensor, dim: int, seed: int, out: torch.Tensor,
                     rows: torch.Tensor | None) -> bool:
    """Writes init rows of `keys` into ``out[rows[i], :dim]`` with the C++ kernel.

    `out` is a contiguous float32 CPU [R, W] tensor.  Returns False (nothing
    written) when the kernel cannot serve this initializer or buffer.
    """
    spec = init._native_spec()
    if spec is None or out.dtype != torch.float32 or out.device.type != "cpu" or not _native.available():
        return False
    kind, params = spec
    n = keys.numel()
    if n == 0:
        return True
    _native.check(keys, torch.int64, "init keys")
    _native.check(out, torch.float32, "init out")
    if rows is not None:
        _native.check(rows, torch.int64, "init rows", n)
    p = (_native.F64 * 4)(*params)
    f = _native.fn("he_init_rows", _native.I64, _native.PTR, _native.I64, _native.PTR, _native.I64, _native.I64,
                   _native.PTR, _native.I64, _native.PTR, _native.I64)
    rc = f(kind, p, _signed(seed), _native.ptr(keys), n, dim, _native.ptr(out), out.shape[1] if out.dim() == 2 else dim,
           _native.ptr(rows), _native.nthreads())
    if rc != 0:
        raise RuntimeError(f"he_init_rows failed with code {rc}")
    return True
