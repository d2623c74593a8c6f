"""A find-or-insert's checks and need[] in one kernel (store/_index_triton.py): after the probe, one
program walks the keys' flags (each new or promoted key's rank among those that get a row, the new
keys, a table column entry naming no table, the first count below 1) and the tables' counts (rows
wanted past a table's limit), decides the outcome as the reference does (store/_index_torch.py: a
later check overrides an earlier one), marks the new keys to place when the outcome is DONE, and
writes the call's need[] for the one read (store/_index.py's layout, then the extras of
_index_triton.py).  One program: a sequential scan over the keys, in blocks, so it needs no
second launch for the prefix sum; the keys of a find-or-insert are a batch's unique keys.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hash_index import MADE, NEW, PROMOTE

__all__ = ["need_kernel", "COMPILE_CASES"]

_K_NEW, _K_GETS = tl.constexpr(NEW), tl.constexpr(MADE | PROMOTE)
_K_PROMOTE = tl.constexpr(PROMOTE)
# store/_index.py's Outcome codes and PROBE_LIMIT, NEED_HEAD (tests/unit/triton checks they agree)
_GROW, _OVER, _DUP, _LONG = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3), tl.constexpr(4)
PROBE_LIMIT = 1024
NEED_HEAD = 8
_K_PROBE_LIMIT, _K_HEAD = tl.constexpr(PROBE_LIMIT), tl.constexpr(NEED_HEAD)


@triton.jit
def need_kernel(flags, tids, counts, per_table, tab_rows, tab_limit, n, T, entries, hwm, nfree, max_entries,
                rows_capacity, longest, long_table, dup, dup_key, dup_table, rank, active, ok_flag, values, pid0,
                HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    """values = need head (8), per table (new rows, new pending) (2T), extras (outcome, bad table entry,
    first bad count's position, value, table; claims left: the caller's) (6), promoted per table (T);
    rank[i]: the keys before i that get a row; active[i]: key i is new and the outcome DONE."""
    if pid0 + tl.program_id(0) == 0:  # (a grid of one program)
        carry = tl.zeros((), tl.int64)
        n_new = tl.zeros((), tl.int64)
        bad_tid = tl.zeros((), tl.int64)
        bad_at = tl.zeros((), tl.int64) + n
        i = tl.zeros((), tl.int64)
        while i < n:
            at = i + tl.arange(0, BLOCK)
            m = at < n
            f = tl.load(flags + at, mask=m, other=0)
            gets = ((f & _K_GETS) != 0).to(tl.int64)
            tl.store(rank + at, carry + tl.cumsum(gets, axis=0) - gets, mask=m)
            carry += tl.sum(gets, axis=0)
            n_new += tl.sum(((f & _K_NEW) != 0).to(tl.int64), axis=0)
            t = tl.load(tids + at, mask=m, other=0)
            bad_tid = tl.maximum(bad_tid, tl.max((m & ((t < -1) | (t >= T))).to(tl.int64), axis=0))
            if HAS_COUNTS:
                c = tl.load(counts + at, mask=m, other=1)
                bad_at = tl.minimum(bad_at, tl.min(tl.where(m & (c < 1) & (t >= 0), at, n), axis=0))
            i += BLOCK
        n_rows = tl.zeros((), tl.int64)
        pending = tl.zeros((), tl.int64)
        over = tl.zeros((), tl.int64)
        j = tl.zeros((), tl.int64)
        while j < T:
            tt = j + tl.arange(0, BLOCK)
            mt = tt < T
            rows_t = tl.load(per_table + tt * 3, mask=mt, other=0)
            pend_t = tl.load(per_table + tt * 3 + 1, mask=mt, other=0)
            n_rows += tl.sum(rows_t, axis=0)
            pending += tl.sum(pend_t, axis=0)
            limit = tl.load(tab_limit + tt, mask=mt, other=0)
            over = tl.maximum(over, tl.max((mt & (tl.load(tab_rows + tt, mask=mt, other=0) + rows_t > limit)).to(
                tl.int64), axis=0))
            tl.store(values + _K_HEAD + 2 * tt, rows_t, mask=mt)
            tl.store(values + _K_HEAD + 2 * tt + 1, pend_t, mask=mt)
            tl.store(values + _K_HEAD + 2 * T + 6 + tt, tl.load(per_table + tt * 3 + 2, mask=mt, other=0), mask=mt)
            j += BLOCK
        grow = (entries + n_new > max_entries) | (hwm + tl.maximum(n_rows - nfree, 0) > rows_capacity)
        big = tl.load(longest)
        outcome = tl.where(grow, _GROW, 0)
        outcome = tl.where(big > _K_PROBE_LIMIT, _LONG, outcome)
        outcome = tl.where(over != 0, _OVER, outcome)
        outcome = tl.where(tl.load(dup) != 0, _DUP, outcome)
        ok = (outcome == 0) & (bad_tid == 0) & (bad_at == n)
        i = tl.zeros((), tl.int64)
        while i < n:
            at = i + tl.arange(0, BLOCK)
            m = at < n
            f = tl.load(flags + at, mask=m, other=0)
            tl.store(active + at, (((f & _K_NEW) != 0) & ok).to(tl.int32), mask=m)
            i += BLOCK
        tl.store(ok_flag, ok.to(tl.int32))
        bad = tl.minimum(bad_at, n - 1)
        x = _K_HEAD + 2 * T
        tl.store(values + 0, n_new)
        tl.store(values + 1, n_rows)
        tl.store(values + 2, pending)
        tl.store(values + 3, tl.where(ok, carry, 0))
        tl.store(values + 4, tl.load(dup_key))
        tl.store(values + 5, tl.load(dup_table))
        tl.store(values + 6, tl.load(long_table))
        tl.store(values + 7, big)
        tl.store(values + x, outcome.to(tl.int64))
        tl.store(values + x + 1, bad_tid)
        tl.store(values + x + 2, bad_at)
        if HAS_COUNTS:
            tl.store(values + x + 3, tl.load(counts + bad).to(tl.int64))
        else:
            tl.store(values + x + 3, bad_at)
        tl.store(values + x + 4, tl.load(tids + bad).to(tl.int64))


_SIG = {name: "*i64" for name in ("tids", "counts", "per_table", "tab_rows", "tab_limit", "longest", "long_table",
                                  "dup_key", "dup_table", "rank", "values")}
_SIG = {"flags": "*i32", **_SIG, "n": "i64", "T": "i64", "entries": "i64", "hwm": "i64", "nfree": "i64",
        "max_entries": "i64", "rows_capacity": "i64", "dup": "*i1", "active": "*i32", "ok_flag": "*i32",
        "pid0": "i32", "HAS_COUNTS": "constexpr", "BLOCK": "constexpr"}
# (the kernel's parameters in order: a signature lists them so)
_ORDER = ("flags tids counts per_table tab_rows tab_limit n T entries hwm nfree max_entries rows_capacity longest "
          "long_table dup dup_key dup_table rank active ok_flag values pid0 HAS_COUNTS BLOCK").split()
COMPILE_CASES = [(f"hash_need.need[counts={int(c)}]", need_kernel, {k: _SIG[k] for k in _ORDER},
                  {"HAS_COUNTS": c, "BLOCK": 1024}) for c in (False, True)]
