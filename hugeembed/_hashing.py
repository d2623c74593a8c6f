"""64-bit hashing shared by the native kernels and their torch twins.

``mix64`` is the finaliser of MurmurHash3 (a bijection on 64-bit integers with
full avalanche).  csrc/common.h computes the same function in C++; tensors here
hold the unsigned 64-bit value in int64 two's complement, and torch's int64
multiply wraps modulo 2**64 exactly as the unsigned C++ multiply does.
"""

from __future__ import annotations

import torch

__all__ = ["mix64", "mix64_int", "logical_shift_right", "seed_mix", "counter_uniform"]

_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53
_MASK64 = (1 << 64) - 1


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def logical_shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """Unsigned (logical) right shift of int64 bits; torch's >> is arithmetic."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix64 of each int64 element (bits reinterpreted as unsigned)."""
    if x.dtype != torch.int64:
        raise TypeError(f"mix64 needs int64, got {x.dtype}")
    x = x ^ logical_shift_right(x, 33)
    x = x * _signed(_M1)
    x = x ^ logical_shift_right(x, 33)
    x = x * _signed(_M2)
    x = x ^ logical_shift_right(x, 33)
    return x


def mix64_int(x: int) -> int:
    """Pure-Python mix64 on an int (the oracle for both implementations); returns the signed value."""
    x &= _MASK64
    x ^= x >> 33
    x = (x * _M1) & _MASK64
    x ^= x >> 33
    x = (x * _M2) & _MASK64
    x ^= x >> 33
    return _signed(x)


# The counter-based generator of the initializers (store/_init.py) and of stochastic rounding:
# a uniform draw is a pure function of (seed, key, stream), so any device, shard or order of
# calls draws the same numbers.
_GOLDEN = 0x9E3779B97F4A7C15
_STREAM = 0xD1B54A32D192ED03
# Salt of the stochastic-rounding streams: (seed, step) never meets an initializer's seed.
_ROUNDING_SALT = 0x5EED_0F_2B17_5A17


def seed_mix(seed: int) -> int:
    """What a table's seed contributes to every key's stream (xor-ed into the key before mixing)."""
    return mix64_int((seed + _GOLDEN) & _MASK64)


def _base(keys: torch.Tensor, seed: int) -> torch.Tensor:
    return mix64(keys ^ seed_mix(seed))


def _unit(base: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """u(key, stream) as float64: base [n, 1], stream int64 [c] -> [n, c]."""
    x = mix64(base + stream * _signed(_STREAM))
    return logical_shift_right(x, 11).to(torch.float64) * 2.0**-53


def counter_uniform(seeds: int | torch.Tensor, counter: int, keys: torch.Tensor, columns: int) -> torch.Tensor:
    """float64 ``[n, columns]`` uniform in [0, 1) on a 2^-53 grid: a pure function of (seed,
    counter, key, column), `seeds` one int or int64 ``[n]`` (a seed per key: keys of several
    tables).  Stochastic rounding draws with counter = the optimizer step, key = the row's key
    and seed = its table's: where the row lives never matters."""
    mixed = mix64_int((int(counter) ^ _ROUNDING_SALT) & _MASK64)
    keys = keys.to(torch.int64)
    if isinstance(seeds, torch.Tensor):
        s = seeds.to(torch.int64) ^ mixed
        base = mix64(keys ^ mix64(s + _signed(_GOLDEN)))[:, None]
    else:
        base = _base(keys, (int(seeds) ^ mixed) & _MASK64)[:, None]
    return _unit(base, torch.arange(columns, dtype=torch.int64, device=keys.device))
