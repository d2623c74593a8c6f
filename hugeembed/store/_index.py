"""The key index of a dynamic table group: its layout, shared by the native kernels and the torch
reference (csrc/group_index.h says the same in C++).

One open-addressing hash table with linear probing, keyed by (table, key)::

    buckets int64 [B, 4]    key | table (-1: empty) | code (int32) + hit count << 32 | last step
    free rows int32 [F]     free row slots of the group's rows, descending (pop = smallest)
    scalars int64 [3]       entries, rows handed out so far (row_hwm), free rows listed
    tables int64 [T, 5]     per table: live rows, pending keys, row limit, admit_min_count, hash key

A code is a row slot (>= 0) or PENDING (-2: seen, not admitted yet).  The home bucket of
(table t, key k) is ``((mix64(k ^ hash_key[t]) >> 32) * B) >> 32``: each table's hash key mixes
a random salt with its index, so equal ids of two tables live apart and ids chosen to collide
under one salt do not collide under another.
"""

from __future__ import annotations

import enum

import torch

from .._hashing import logical_shift_right, mix64, mix64_int

__all__ = ["Outcome", "EMPTY_TABLE", "PENDING", "WORDS", "G_ENTRIES", "G_ROW_HWM", "G_NUM_FREE", "G_LEN", "T_ROWS",
           "T_PENDING", "T_ROW_LIMIT", "T_ADMIT_K", "T_HASH_KEY", "T_LEN", "NEED_HEAD", "Need", "need_length", "pack",
           "code_of", "count_of",
           "new_buckets", "home", "hash_key", "MAX_SLOTS", "PROBE_LIMIT"]

WORDS = 4
EMPTY_TABLE = -1
PENDING = -2
MAX_SLOTS = 2**31 - 2  # codes are int32
_COUNT_MAX = 2**31 - 1
# A probe longer than this fails a find-or-insert (Outcome.LONG_PROBE): the group draws a new salt
# for that table and rehashes.  Random keys at the 0.6 load factor probe ~1.75 buckets on average,
# and the longest probe among millions of keys stays in the low hundreds.
PROBE_LIMIT = 1024

G_ENTRIES, G_ROW_HWM, G_NUM_FREE, G_LEN = 0, 1, 2, 3
T_ROWS, T_PENDING, T_ROW_LIMIT, T_ADMIT_K, T_HASH_KEY, T_LEN = 0, 1, 2, 3, 4, 5
# need[] of a find-or-insert: entries, rows, pending, made, dup key, dup table, long table, longest
# probe; per table (new rows, new pending keys); the group after the call (entries, row_hwm, free
# rows listed); per table after it (rows, pending keys).  Read once: Need.
NEED_HEAD = 8
_GOLDEN = 0x9E3779B97F4A7C15


def need_length(tables: int) -> int:
    return NEED_HEAD + 4 * tables + 3


class Need:
    """A find-or-insert's need[] read once (the layout above)."""

    def __init__(self, values: list[int], tables: int) -> None:
        T, h = tables, NEED_HEAD
        self.entries, self.rows, self.pending, self.made = values[:4]
        self.dup_key, self.dup_table, self.long_table, self.longest = values[4:8]
        self.new_rows = values[h : h + 2 * T : 2]
        self.new_pending = values[h + 1 : h + 2 * T : 2]
        after = values[h + 2 * T :]
        self.state = tuple(after[:3])  # the group's entries, row_hwm, free rows listed after the call
        self.table_rows = after[3::2]
        self.table_pending = after[4::2]


class Outcome(enum.IntEnum):
    """What a find-or-insert did (csrc/group_find_or_insert.cpp::Outcome): all but DONE leave the group
    exactly as before, for the caller to grow it, make room, rekey or raise."""

    DONE = 0
    MUST_GROW = 1  # need: entries and rows wanted
    OVER_LIMIT = 2  # some table's rows would exceed its row limit (need: per table)
    DUPLICATE_KEY = 3  # need[4], need[5]: a (key, table) given twice
    LONG_PROBE = 4  # need[6]: the table whose probe ran past PROBE_LIMIT


def pack(code: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Word 2 of a record: int32 code in the low half, saturating int32 count in the high half."""
    return (count.clamp(0, _COUNT_MAX) << 32) | (code & 0xFFFFFFFF)


def code_of(w: torch.Tensor) -> torch.Tensor:
    return (w << 32) >> 32  # arithmetic shift: sign-extends the low half


def count_of(w: torch.Tensor) -> torch.Tensor:
    return w >> 32


def new_buckets(nbuckets: int, device: torch.device | str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Empty bucket records (table -1, code -1, count 0); fills `out` when given."""
    b = torch.empty(nbuckets, WORDS, dtype=torch.int64, device=device) if out is None else out
    b[:, 0] = 0
    b[:, 1] = EMPTY_TABLE
    b[:, 2] = 0xFFFFFFFF  # pack(-1, 0)
    b[:, 3] = 0
    return b


def home(keys: torch.Tensor, hash_keys: torch.Tensor, nbuckets: int) -> torch.Tensor:
    """Home buckets of `keys` whose tables have `hash_keys` (int64 [n] each), in [0, B)."""
    return logical_shift_right(logical_shift_right(mix64(keys ^ hash_keys), 32) * nbuckets, 32)


def hash_key(salt: int, table: int) -> int:
    """The hash key of the group's table `table` whose salt is `salt` (int64)."""
    return mix64_int((salt ^ ((table + 1) * _GOLDEN)) & ((1 << 64) - 1))
