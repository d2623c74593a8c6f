"""64-bit hashing shared by the native kernels and their torch twins.

``mix64`` is the finaliser of MurmurHash3 (a bijection on 64-bit integers with
full avalanche).  csrc/common.h computes the same function in C++; tensors here
hold the unsigned 64-bit value in int64 two's complement, and torch's int64
multiply wraps modulo 2**64 exactly as the unsigned C++ multiply does.
"""

from __future__ import annotations

import torch

__all__ = ["mix64", "mix64_int", "logical_shift_right"]

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
