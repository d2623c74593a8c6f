"""Categorical values -> int64 ids: the one stable hash of a value's text, and hex values.

The hash (``ids = "hash"``, the schema's default) of a value is computed from its text::

    text  = the cell as written (CSV/TSV), or for a typed value (Parquet, JSON):
            an integer -> its decimal digits ("196" and 196 are one id), true/false -> "true"/"false",
            a float -> its integer digits when it is whole (196.0 -> "196"), else Python's repr
    h     = FNV-1a 64 over the UTF-8 bytes of text (offset 0xcbf29ce484222325, prime 0x100000001b3)
    id    = (mix64(h) & (2**62 - 1)) | 2**62       mix64: MurmurHash3's 64-bit finaliser

so every id is in ``[2**62, 2**63)``: non-negative (negative ids are dropped as invalid) and never
one of the missing ids (``2**32 + j``).  It depends on nothing but the text: the same in every
process, at training, export and serving time (``hash_text`` is the plain-Python definition, the
tests' oracle; ``hash_utf8`` the vectorised one that the readers use).
"""

from __future__ import annotations

import numpy as np

__all__ = ["hash_text", "value_text", "hash_utf8", "hex_utf8", "HASH_BIT", "MAX_HEX_DIGITS"]

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_M1, _M2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
_MASK64 = (1 << 64) - 1
HASH_BIT = 1 << 62
MAX_HEX_DIGITS = 15  # 15 hex digits fit in 60 bits: every hex id is a non-negative int64


def value_text(value: object) -> str:
    """The text a typed value hashes as (see the module docstring)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def hash_text(text: str | object) -> int:
    """The id of a categorical value (plain Python; any value goes through :func:`value_text`).

    Example::

        >>> hash_text("196") == hash_text(196) == hash_text(196.0)
        True
        >>> 2**62 <= hash_text("Action") < 2**63
        True
    """
    data = (text if isinstance(text, str) else value_text(text)).encode("utf-8")
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _MASK64
    h ^= h >> 33
    h = (h * _M1) & _MASK64
    h ^= h >> 33
    h = (h * _M2) & _MASK64
    h ^= h >> 33
    return (h & (HASH_BIT - 1)) | HASH_BIT


def _positions(offsets: np.ndarray):
    """(start, length) of each string."""
    offsets = offsets.astype(np.int64, copy=False)
    return offsets[:-1], np.diff(offsets)


def _longest_first(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, ends): the strings ordered longest first, and ``ends[p]`` = how many of them have a byte at
    position p -- so that each byte position's pass works on a prefix of the order, not a gathered subset."""
    key = lengths.astype(np.uint16) if lengths.size and lengths.max() < 1 << 16 else lengths
    order = np.argsort(key, kind="stable")[::-1]  # 16-bit keys: NumPy's radix sort, linear
    counts = np.bincount(lengths, minlength=1) if lengths.size else np.zeros(1, np.int64)
    ends = counts[::-1].cumsum()[::-1][1:]  # ends[p] = strings longer than p
    return order, ends


def hash_utf8(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:
    """int64 ids of the strings ``data[offsets[i]:offsets[i+1]]`` (UTF-8 bytes), as :func:`hash_text` gives.

    Vectorised over the strings one byte position at a time, longest strings first: each pass touches
    the strings that still have a byte there, so a column costs about its total bytes.
    """
    starts, lengths = _positions(offsets)
    order, ends = _longest_first(lengths)
    at = starts[order]
    h = np.full(lengths.size, _FNV_OFFSET, np.uint64)
    data = np.asarray(data, np.uint8)
    prime = np.uint64(_FNV_PRIME)
    with np.errstate(over="ignore"):
        for pos, k in enumerate(ends):
            part = h[:k]
            part ^= data[at[:k] + pos]
            part *= prime
        h ^= h >> np.uint64(33)
        h *= np.uint64(_M1)
        h ^= h >> np.uint64(33)
        h *= np.uint64(_M2)
        h ^= h >> np.uint64(33)
    h &= np.uint64(HASH_BIT - 1)
    h |= np.uint64(HASH_BIT)
    out = np.empty_like(h)
    out[order] = h
    return out.view(np.int64)


_HEX_VALUE = np.full(256, 255, np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_VALUE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_VALUE[_c] = 10 + _i


def hex_utf8(offsets: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, bad) of strings of 1-15 hex digits (either case): ``ids[i]`` is the value, ``bad[i]`` True for
    a string that is not such a number (its id is then undefined).  Empty strings are bad here: the
    readers turn them into missing ids before."""
    starts, lengths = _positions(offsets)
    out = np.zeros(lengths.size, np.int64)
    bad = (lengths < 1) | (lengths > MAX_HEX_DIGITS)
    data = np.asarray(data, np.uint8)
    active = np.flatnonzero(~bad)
    pos = 0
    while active.size:
        d = _HEX_VALUE[data[starts[active] + pos]]
        bad[active[d == 255]] = True
        out[active] = (out[active] << 4) | d.astype(np.int64)
        pos += 1
        active = active[lengths[active] > pos]
    return out, bad
