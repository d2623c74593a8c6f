"""Distinct ids per sparse feature, estimated in one pass: a HyperLogLog sketch per feature.

``convert`` feeds every block's ids to a :class:`DistinctSketch` and writes its estimates into the
manifest (``distinct_ids``); the distributed planner reads them as the rows a dynamic table will hold
(small tables are replicated).  2**12 registers of one byte per feature (4 KiB), merged by max over
blocks; the estimate is Ertl's improved HyperLogLog estimator ("New cardinality estimation algorithms
for HyperLogLog sketches", 2017: the raw estimate with its small- and large-range corrections built in,
without the bias of the classic estimator's switch to linear counting near 2.5 x 2**12 ids): relative
standard error 1.04 / sqrt(2**12) = 1.6%.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .. import _native
from ._synthetic import _mix64

__all__ = ["DistinctSketch", "hll_registers", "hll_estimate", "HLL_BITS"]

HLL_BITS = 12  # registers per feature: 2**12
_M = 1 << HLL_BITS
_Q = 32  # the rank counts the leading zeros of the hash's low 32 bits: registers hold 0..Q + 1
_SALT = np.int64(0x3C6EF372FE94F82B)  # ids are hashed xor this: id 0 would be a fixed point of mix64


def _hashes(ids: np.ndarray) -> np.ndarray:
    """mix64(id ^ salt) of every id (int64, any shape), as uint64 of the same shape."""
    keys = np.bitwise_xor(ids, _SALT, dtype=np.int64)  # a contiguous copy, hashed in place
    if _native.available():
        _native.call("he_mix64", [keys.reshape(-1), keys.reshape(-1)])
        return keys.view(np.uint64)
    return _mix64(keys.view(np.uint64))


def hll_registers(ids: np.ndarray, columns: int = 1, *, native: bool | None = None) -> np.ndarray:
    """Registers uint8 [columns, 2**12] of int64 ids ``[n, columns]`` (or ``[n]`` for one column): per
    column, register i holds the most leading zeros + 1 of the low 32 bits of a hash among the ids whose
    hash has i in its top 12 bits (independent bits of a 64-bit mix).  ``native``: the kernel's one pass
    (csrc/hll.cpp; None: when built), else the NumPy path (the fallback, and the tests' oracle)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1, columns)
    if native is None:
        native = _native.available()
    if native:
        out = np.zeros(columns * _M, np.uint8)
        _native.call("he_hll_update", [ids.reshape(-1), out], [columns, HLL_BITS, int(_SALT)])
        return out.reshape(columns, _M)
    return _numpy_registers(ids, columns)


def _numpy_registers(ids: np.ndarray, columns: int) -> np.ndarray:
    h = _hashes(ids)
    # narrow views instead of 64-bit shifts and masks (little-endian words): a third less time
    idx = (h.view(np.uint16).reshape(*h.shape, 4)[..., 3] >> np.uint16(16 - HLL_BITS)).astype(np.intp)
    idx += np.arange(columns, dtype=np.intp) * _M
    # frexp's exponent of a uint32 (exact in a float64) is its bit length (0 for 0)
    rank = (_Q + 1 - np.frexp(h.view(np.uint32).reshape(*h.shape, 2)[..., 0].astype(np.float64))[1])
    out = np.zeros(columns * _M, np.uint8)
    np.maximum.at(out, idx.reshape(-1), rank.astype(np.uint8).reshape(-1))
    return out.reshape(columns, _M)


def _sigma(x: float) -> float:
    if x == 1.0:
        return math.inf
    y, z = 1.0, x
    while True:
        x *= x
        z_old, z = z, z + x * y
        y += y
        if z == z_old:
            return z


def _tau(x: float) -> float:
    if x in (0.0, 1.0):
        return 0.0
    y, z = 1.0, 1.0 - x
    while True:
        x = math.sqrt(x)
        z_old, y = z, y * 0.5
        z -= (1.0 - x) ** 2 * y
        if z == z_old:
            return z / 3.0


def hll_estimate(registers: np.ndarray) -> float:
    """The distinct ids of one feature's registers (uint8 [2**12]): Ertl's improved estimator."""
    counts = np.bincount(registers, minlength=_Q + 2).astype(np.float64)
    z = _M * _tau(1.0 - counts[_Q + 1] / _M)
    for k in range(_Q, 0, -1):
        z = 0.5 * (z + counts[k])
    z += _M * _sigma(counts[0] / _M)
    return _M * _M / (2.0 * math.log(2.0) * z)


class DistinctSketch:
    """One HyperLogLog sketch per sparse feature of a schema, filled block by block.

    Args:
        names: the sparse features in the schema's order.
        bags: which of them are bag columns (their ids are a block's ``bags``, the others its ``cats``
            columns, in order).
    """

    def __init__(self, names: Sequence[str], bags: Sequence[bool]) -> None:
        self.names, self.bags = tuple(names), tuple(bags)
        self.registers = np.zeros((len(self.names), _M), np.uint8)
        self._single = [k for k, b in enumerate(self.bags) if not b]
        self._bag = [k for k, b in enumerate(self.bags) if b]

    def add(self, block) -> None:
        """Counts the ids of a data Block (its cats columns and bags)."""
        if len(block) and self._single:
            rows = self._single  # a fancy index reads a copy: the maximum is stored back
            self.registers[rows] = np.maximum(self.registers[rows], hll_registers(block.cats, len(rows)))
        for k, bag in zip(self._bag, block.bags):
            if bag.values.size:
                np.maximum(self.registers[k], hll_registers(bag.values)[0], out=self.registers[k])

    def estimates(self) -> dict[str, int]:
        """Feature name -> estimated distinct ids (rounded)."""
        return {name: int(round(hll_estimate(r))) for name, r in zip(self.names, self.registers)}
