"""Dedup and transpose of a group's ids on the device, with no read of the device by the host.

The ids of a batch's kept entries (``Prepared``'s order: bag by bag) of the tables of one row group
become one linear key each, ``table_base[t] + id`` (the id's row in the group's rows array, so a
sort by key is a sort by (table, id) as prepare_torch orders the unique keys); the keys are sorted
(stable: an id's entries keep their batch order) and run-length encoded::

    entries  j:   0  1  2  3  4  5            (kept ids, bag order; 5 is not valid)
    key:          7  2  7  9  2  -
    order:        1  4  0  2  3  5            (sorted positions; invalid entries last)
    rows:         2  7  9  .  .  .            (unique group rows, n_unique = 3 of N)
    seg_start:    0  2  4  5  5  5  5         (segment u is order[seg_start[u] : seg_start[u + 1]])
    inverse:      1  0  1  2  0  -1

Every array is sized from the batch's shapes (N entries, over-allocated) and the real counts
(n_valid, n_unique) stay on the device as int32 scalars: the kernels that follow mask with them,
so nothing here waits for the device.  Keys are int32 when the group's rows fit (half the sort
traffic of int64); torch.sort sorts them (a radix sort on CUDA over all 32 bits: a bit-limited
triton radix pass is not built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import InputError
from ._grid import launch

__all__ = ["Dedup", "dedup", "COMPILE_CASES"]

_BLOCK = 256


@dataclass(frozen=True)
class Dedup:
    """A group's entries deduplicated (all device tensors; see the module docstring's picture).

    order: int64 [N] entry positions sorted by key (stable); the valid ones first.
    rows: int32/int64 [N] each unique key (the group row) at its unique index; past n_unique: unset.
    tables: int32 [N] each unique key's table (its first entry's); past n_unique: unset.
    seg_start: int32 [N + 1] first sorted position of each unique key; n_valid from n_unique on.
    inverse: int32 [N] each entry's unique index (-1 for invalid entries).
    counts: int32 [2] (n_valid, n_unique) on the device.
    """

    order: torch.Tensor
    rows: torch.Tensor
    tables: torch.Tensor
    seg_start: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor

    @property
    def capacity(self) -> int:
        """N: what every array is sized for (an upper bound on the unique keys)."""
        return self.order.numel()


@triton.jit
def _linear_keys(pid0, ids, tables, valid, table_base, table_rows, keys, counts, n, sentinel,
                 HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
    """key = table_base[t] + id for valid entries with the id in its table's range, else the
    sentinel (sorts last); counts[0] += the valid entries (an integer atomic: exact in any order)."""
    pid = pid0 + tl.program_id(0)
    at = pid * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    t = tl.load(tables + at, mask=inside, other=0)
    i = tl.load(ids + at, mask=inside, other=0).to(tl.int64)
    ok = inside & (t >= 0)  # table -1: an entry that does not count
    if HAS_VALID:
        ok = ok & (tl.load(valid + at, mask=inside, other=0) != 0)
    t = tl.maximum(t, 0)
    nr = tl.load(table_rows + t, mask=inside, other=0)
    ok = ok & (i >= 0) & (i < nr)
    base = tl.load(table_base + t, mask=inside, other=0)
    key = tl.where(ok, base + i, sentinel)
    tl.store(keys + at, key.to(keys.dtype.element_ty), mask=inside)
    tl.atomic_add(counts, tl.sum(ok.to(tl.int32), axis=0))


@triton.jit
def _segment_heads(pid0, sorted_keys, heads, n, sentinel, BLOCK: tl.constexpr):
    """heads[i] = 1 where sorted position i starts a run of a valid key."""
    pid = pid0 + tl.program_id(0)
    at = pid * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    k = tl.load(sorted_keys + at, mask=inside, other=0)
    prev = tl.load(sorted_keys + at - 1, mask=inside & (at > 0), other=0)
    head = inside & (k != sentinel) & ((at == 0) | (k != prev))
    tl.store(heads + at, head.to(tl.int32), mask=inside)


@triton.jit
def _encode_runs(pid0, sorted_keys, order, uid, heads, entry_tables, rows, tables, seg_start, inverse, counts, n,
                 BLOCK: tl.constexpr):
    """From the heads' inclusive prefix sum `uid`: each run's row, table and start, each entry's
    unique index; seg_start past n_unique holds n_valid; counts[1] = n_unique."""
    pid = pid0 + tl.program_id(0)
    at = pid * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    n_valid = tl.load(counts)
    n_unique = tl.load(uid + n - 1)
    u = tl.load(uid + at, mask=inside, other=0) - 1
    head = tl.load(heads + at, mask=inside, other=0) != 0
    key = tl.load(sorted_keys + at, mask=inside, other=0)
    j = tl.load(order + at, mask=inside, other=0)
    tl.store(rows + u, key, mask=head)
    tl.store(tables + u, tl.load(entry_tables + j, mask=head, other=0).to(tl.int32), mask=head)
    tl.store(seg_start + u, at.to(tl.int32), mask=head)
    tl.store(inverse + j, tl.where(at < n_valid, u, -1), mask=inside)
    # the tail of seg_start (N + 1 entries: this grid covers it with one more program's worth)
    tail = (at >= n_unique) & (at <= n)
    tl.store(seg_start + at, n_valid, mask=tail)
    tl.store(counts + 1, n_unique, mask=pid == 0)


def dedup(ids: torch.Tensor, tables: torch.Tensor, table_base: torch.Tensor, table_rows: torch.Tensor,
          group_rows: int, valid: torch.Tensor | None = None) -> Dedup:
    """Dedup of entries (id, table) of one row group; no host read.

    Args:
        ids: int64 [N] ids (rows of their table).
        tables: int32/int64 [N] each entry's table, in [0, T), or -1 for an entry that does not count.
        table_base: int64 [T]: the group row of each table's row 0 (tables of a group: ascending; 0 for
            every table when `ids` are the group's rows already, e.g. a training step's slots).
        table_rows: int64 [T] rows of each table (an id outside [0, rows) is dropped, as invalid).
        group_rows: R, the group's rows (keys are int32 when R < 2^31).
        valid: bool/int [N] or None: which entries count (padding from an over-allocated batch).
    """
    n = ids.numel()
    dev = ids.device
    if tables.numel() != n or (valid is not None and valid.numel() != n):
        raise InputError(f"dedup: ids ({n}), tables ({tables.numel()}) and valid "
                         f"({'-' if valid is None else valid.numel()}) must have one entry each")
    T = table_base.numel()
    if T == 0 or table_rows.numel() != T:
        raise InputError(f"dedup: table_base ({T}) and table_rows ({table_rows.numel()}) need one entry per table")
    key_dtype = torch.int32 if group_rows < 2**31 - 1 else torch.int64
    sentinel = group_rows  # past every real key: invalid entries sort last
    counts = torch.zeros(2, dtype=torch.int32, device=dev)
    order = torch.empty(n, dtype=torch.int64, device=dev)
    rows = torch.empty(n, dtype=key_dtype, device=dev)
    utables = torch.empty(n, dtype=torch.int32, device=dev)
    seg_start = torch.empty(n + 1, dtype=torch.int32, device=dev)
    inverse = torch.empty(n, dtype=torch.int32, device=dev)
    if n == 0:
        seg_start.zero_()
        return Dedup(order, rows, utables, seg_start, inverse, counts)
    keys = torch.empty(n, dtype=key_dtype, device=dev)
    programs = triton.cdiv(n, _BLOCK)
    launch(_linear_keys, programs, ids, tables, valid if valid is not None else ids, table_base, table_rows, keys, counts,
                       n, sentinel, HAS_VALID=valid is not None, BLOCK=_BLOCK)
    sorted_keys, order = torch.sort(keys, stable=True)
    heads = torch.empty(n, dtype=torch.int32, device=dev)
    launch(_segment_heads, programs, sorted_keys, heads, n, sentinel, BLOCK=_BLOCK)
    uid = torch.cumsum(heads, 0, dtype=torch.int32)
    launch(_encode_runs, triton.cdiv(n + 1, _BLOCK), sorted_keys, order, uid, heads, tables, rows, utables,
           seg_start, inverse, counts, n, BLOCK=_BLOCK)
    return Dedup(order, rows, utables, seg_start, inverse, counts)


def _cases():
    sig = {"pid0": "i32", "ids": "*i64", "tables": "*i32", "valid": "*i8", "table_base": "*i64",
           "table_rows": "*i64", "keys": "*i32", "counts": "*i32", "n": "i32", "sentinel": "i32"}
    heads = {"pid0": "i32", "sorted_keys": "*i32", "heads": "*i32", "n": "i32", "sentinel": "i32"}
    enc = {"pid0": "i32", "sorted_keys": "*i32", "order": "*i64", "uid": "*i32", "heads": "*i32",
           "entry_tables": "*i32", "rows": "*i32", "tables": "*i32", "seg_start": "*i32", "inverse": "*i32",
           "counts": "*i32", "n": "i32"}
    out = []
    for has_valid in (False, True):
        out.append((f"dedup.linear_keys[valid={int(has_valid)}]", _linear_keys, {**sig, "HAS_VALID": "constexpr",
                    "BLOCK": "constexpr"}, {"HAS_VALID": has_valid, "BLOCK": _BLOCK}))
    out.append(("dedup.segment_heads", _segment_heads, {**heads, "BLOCK": "constexpr"}, {"BLOCK": _BLOCK}))
    out.append(("dedup.encode_runs", _encode_runs, {**enc, "BLOCK": "constexpr"}, {"BLOCK": _BLOCK}))
    return out


COMPILE_CASES = _cases()
