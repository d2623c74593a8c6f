"""Initial values of embedding rows: deterministic per (seed, key, column).

A dynamic table creates a row the first time it sees a key, in whatever batch,
shard or device that happens.  To make training reproducible the initial row must
not depend on any of that, so every value is a pure function of (seed, key,
column) computed by a counter-based generator built on ``mix64``::

    base(key)      = mix64(key ^ mix64(seed + GOLDEN))
    u(key, col)    = ((mix64(base + col * STREAM) >>> 11) + 0.5) * 2**-53     in (0, 1)

    uniform col j  : low + (high - low) * u'(key, j)    (u' the same without the + 0.5)
    normal  col j  : z = Phi^-1(u(key, j))               (Wichura's AS 241, |rel. error| < 1e-15)
    truncated      : z = Phi^-1(Phi(a) + u(key, j) (Phi(b) - Phi(a))): exact, no redraws

csrc/store_init.cpp evaluates the same double expressions in the same order, so the
native and the torch paths give rows equal within one float32 ulp (their log may
differ in the last bit of a double).  One value costs one hash and, for 85% of
normal draws, one rational function (no log): several times faster than Box-Muller
with redraws.

Example::

    >>> init = TruncatedNormal(0.0, 0.05)
    >>> rows = init.generate(torch.tensor([7, 42]), dim=4, seed=0)   # [2, 4] float32
    >>> torch.equal(rows[1], init.generate(torch.tensor([42]), 4, 0)[0])
    True
"""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .. import _native
from .._hashing import _base, _unit, logical_shift_right, mix64
from ..errors import ConfigError, InputError

__all__ = ["Initializer", "Uniform", "Normal", "TruncatedNormal", "Constant", "Zeros", "FromCallable", "INIT_KINDS",
           "check_initializer_spec", "initializer_from_spec"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STREAM = 0xD1B54A32D192ED03


def _signed(u: int) -> int:
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


# Wichura (1988), Algorithm AS 241 (PPND16): the inverse of the standard normal CDF,
# relative error below 1e-16, as rational functions in three regions.  The C++ kernel
# (csrc/store_init.cpp) evaluates the same Horner schemes in the same order.
_A = (3.3871328727963666080e0, 1.3314166789178437745e2, 1.9715909503065514427e3, 1.3731693765509461125e4,
      4.5921953931549871457e4, 6.7265770927008700853e4, 3.3430575583588128105e4, 2.5090809287301226727e3)
_B = (1.0, 4.2313330701600911252e1, 6.8718700749205790830e2, 5.3941960214247511077e3, 2.1213794301586595867e4,
      3.9307895800092710610e4, 2.8729085735721942674e4, 5.2264952788528545610e3)
_C = (1.42343711074968357734e0, 4.63033784615654529590e0, 5.76949722146069140550e0, 3.64784832476320460504e0,
      1.27045825245236838258e0, 2.41780725177450611770e-1, 2.27238449892691845833e-2, 7.74545014278341407640e-4)
_D = (1.0, 2.05319162663775882187e0, 1.67638483018380384940e0, 6.89767334985100004550e-1,
      1.48103976427480074590e-1, 1.51986665636164571966e-2, 5.47593808499534494600e-4, 1.05075007164441684324e-9)
_E = (6.65790464350110377720e0, 5.46378491116411436990e0, 1.78482653991729133580e0, 2.96560571828504891230e-1,
      2.65321895265761230930e-2, 1.24266094738807843860e-3, 2.71155556874348757815e-5, 2.01033439929228813265e-7)
_F = (1.0, 5.99832206555887937690e-1, 1.36929880922735805310e-1, 1.48753612908506148525e-2,
      7.86869131145613259100e-4, 1.84631831751005468180e-5, 1.42151175831644588870e-7, 2.04426310338993978564e-15)


def _horner(coefs: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    acc = torch.full_like(x, coefs[-1])
    for c in coefs[-2::-1]:
        acc = acc * x + c
    return acc


def inverse_normal_cdf(p: torch.Tensor) -> torch.Tensor:
    """z with Phi(z) = p for float64 p in (0, 1) (AS 241; the native kernel computes the same)."""
    q = p - 0.5
    r = 0.180625 - q * q
    central = q * _horner(_A, r) / _horner(_B, r)
    t = torch.sqrt(-torch.log(torch.where(q < 0, p, 1.0 - p).clamp_min(1e-300)))
    near = _horner(_C, t - 1.6) / _horner(_D, t - 1.6)
    far = _horner(_E, t - 5.0) / _horner(_F, t - 5.0)
    tail = torch.where(t <= 5.0, near, far)
    tail = torch.where(q < 0, -tail, tail)
    return torch.where(q.abs() <= 0.425, central, tail)


def _open_unit(base: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """u(key, stream) in (0, 1), never 0 or 1 (the inverse CDF is infinite there)."""
    x = mix64(base + stream * _signed(_STREAM))
    return (logical_shift_right(x, 11).to(torch.float64) + 0.5) * 2.0**-53


def _std_normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


class Initializer(abc.ABC):
    """Base class: ``generate(keys, dim, seed)`` returns the initial rows of `keys`.

    Subclasses are frozen dataclasses.  ``_native_spec`` gives the kernel's
    (kind, params) for csrc/store_init.cpp, or None when only the torch path exists.
    """

    @abc.abstractmethod
    def generate(self, keys: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
        """Rows for `keys` (int64 [n]) -> float32 [n, dim] on keys.device."""

    def rows_from_bases(self, bases: torch.Tensor, dim: int) -> torch.Tensor | None:
        """The rows whose keys' streams start at `bases` (``_base(keys, seed)``, int64 [n]), or None
        for an initializer that is not a function of the stream alone: with a base per key, the
        new rows of many tables (each its own seed) come from one call (:func:`generate_many`)."""
        return None

    def _native_spec(self) -> tuple[int, tuple[float, ...]] | None:
        return None


@dataclass(frozen=True)
class Constant(Initializer):
    """Every value equals `value`."""

    value: float = 0.0

    def __post_init__(self):
        if not math.isfinite(self.value):
            raise ConfigError(f"Constant initializer: value must be finite, got {self.value}")

    def generate(self, keys, dim, seed):
        return self.rows_from_bases(keys, dim)

    def rows_from_bases(self, bases, dim):
        return torch.full((bases.numel(), dim), float(self.value), dtype=torch.float32, device=bases.device)

    def _native_spec(self):
        return 0, (float(self.value), 0.0, 0.0, 0.0, 0.0, 0.0)


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
        return self.rows_from_bases(_base(keys, seed), dim)

    def rows_from_bases(self, bases, dim):
        u = _unit(bases[:, None], torch.arange(dim, device=bases.device))
        return (self.low + (self.high - self.low) * u).to(torch.float32)

    def _native_spec(self):
        return 1, (float(self.low), float(self.high), 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Normal(Initializer):
    """Gaussian N(mean, std**2): z = Phi^-1(u) of the column's counter-based uniform u."""

    mean: float = 0.0
    std: float = 0.05

    def __post_init__(self):
        if not (math.isfinite(self.mean) and math.isfinite(self.std) and self.std > 0):
            raise ConfigError(f"Normal initializer: need finite mean and std > 0, got mean={self.mean}, std={self.std}")

    def generate(self, keys, dim, seed):
        return self.rows_from_bases(_base(keys, seed), dim)

    def rows_from_bases(self, bases, dim):
        z = inverse_normal_cdf(_open_unit(bases[:, None], torch.arange(dim, device=bases.device)))
        return (self.mean + self.std * z).to(torch.float32)

    def _native_spec(self):
        return 2, (float(self.mean), float(self.std), 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """N(mean, std**2) restricted to [a, b] standard deviations (TF's truncated_normal).

    Sampled exactly, with no redraws: z = Phi^-1(Phi(a) + u (Phi(b) - Phi(a))) for the
    column's counter-based uniform u, so every value costs one evaluation.
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
        pa, pb = _std_normal_cdf(self.a), _std_normal_cdf(self.b)
        if not pb > pa:
            raise ConfigError(f"TruncatedNormal initializer: [a, b] = [{self.a}, {self.b}] holds no probability mass "
                              "in float64; choose bounds within about 37 standard deviations of the mean")

    def generate(self, keys, dim, seed):
        return self.rows_from_bases(_base(keys, seed), dim)

    def rows_from_bases(self, bases, dim):
        pa, pb = _std_normal_cdf(self.a), _std_normal_cdf(self.b)
        u = _open_unit(bases[:, None], torch.arange(dim, device=bases.device))
        z = inverse_normal_cdf(pa + u * (pb - pa)).clamp(self.a, self.b)
        return (self.mean + self.std * z).to(torch.float32)

    def _native_spec(self):
        pa, pb = _std_normal_cdf(self.a), _std_normal_cdf(self.b)
        return 3, (float(self.mean), float(self.std), float(self.a), float(self.b), pa, pb)


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
    stride = out.stride(0) if out.dim() == 2 else dim  # a column view's rows lie stride(0) apart
    _native.call("he_init_rows", [keys, _native.rows(out) if out.dim() == 2 else out, rows, _params(params)],
                 [kind, _signed(seed), dim, stride])
    return True


@functools.lru_cache(maxsize=256)
def _params(params: tuple[float, ...]) -> torch.Tensor:
    """An initializer's parameters as the kernel reads them (made once per distinct set)."""
    return torch.tensor(list(params) + [0.0] * (6 - len(params)), dtype=torch.float64)


# `--init` / TableConfig specs: the distributions a user picks by name, with their one scale.
INIT_KINDS = ("uniform", "normal", "truncnormal")
INIT_SPEC_HELP = ("uniform:SCALE (U(-SCALE, SCALE)), normal:STD, truncnormal:STD (cut at 2 std, TF's), "
                  "or uniform (U(+-sqrt(1/n)) for a table of n rows)")


def check_initializer_spec(spec: object, who: str = "init") -> str:
    """`spec` if it names an initializer (:func:`initializer_from_spec`), else ConfigError naming `who`
    and the value; checked without a table, so a config fails before anything is built."""
    if not isinstance(spec, str):
        raise ConfigError(f"{who} must be a string like uniform:0.01, got {spec!r}")
    kind, colon, scale = spec.partition(":")
    if kind not in INIT_KINDS or (colon and not scale) or (not colon and kind != "uniform"):
        raise ConfigError(f"{who} must be {INIT_SPEC_HELP}; got {spec!r}")
    if colon:
        try:
            value = float(scale)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{who}: the scale of {spec!r} must be a positive number, got {scale!r}")
    return spec


def initializer_from_spec(spec: str, rows: int | None, *, table: str = "?", who: str = "init") -> Initializer:
    """The initializer a spec names, for a table of `rows` rows (None: unbounded).

    ``uniform:S`` is U(-S, S), ``normal:S`` N(0, S^2), ``truncnormal:S`` N(0, S^2) cut at
    +-2 S (TF's truncated_normal); ``uniform`` alone is U(-sqrt(1/n), sqrt(1/n)) for a table
    of n rows (torch.nn.Embedding-style reference DLRMs), which needs n: a static table's
    rows or a dynamic table's capacity.

    Example::

        >>> initializer_from_spec("normal:0.01", None)
        Normal(mean=0.0, std=0.01)
        >>> initializer_from_spec("uniform", 100)
        Uniform(low=-0.1, high=0.1)
    """
    kind, _, scale = check_initializer_spec(spec, who).partition(":")
    if not scale:
        if rows is None:
            raise ConfigError(f"table {table!r}: {who} {spec!r} scales by the table's rows (U(+-sqrt(1/n))), but the "
                              f"table is dynamic and unbounded: give it a capacity, or a scale (uniform:0.01)")
        bound = math.sqrt(1.0 / rows)
        return Uniform(-bound, bound)
    s = float(scale)
    if kind == "uniform":
        return Uniform(-s, s)
    if kind == "normal":
        return Normal(0.0, s)
    return TruncatedNormal(0.0, s)
