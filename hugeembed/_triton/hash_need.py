"""A find-or-insert's checks, outcome and report in one kernel (store/_index_triton.py): after the
probe, one program walks the keys' flags (each new or promoted key's rank among those that get a
row, the new keys, a table column entry naming no table, the first count below 1) and the tables'
counts (rows wanted past a table's limit), decides the outcome as the reference does
(store/_index_torch.py: a later check overrides an earlier one), marks the new keys to place when
the outcome is DONE (and their first claim round's bucket: the empty one their probe ended on),
and writes the call's report for the one read: store/_index.py's need[] with the group's state
after the call, then the extras of _index_triton.py.

The duplicate and crowd checks need the keys to insert or promote sorted by home (SORTED: the
caller sorts the probe's sort keys before this kernel, in every call of two keys or more, so that
the call's one read already holds its final outcome and nothing after it must be read).  Without
SORTED neither check can fire (fewer than two keys).  One program: a sequential scan over the keys, in blocks, so it
needs no second launch for the prefix sum; the keys of a find-or-insert are a batch's unique keys.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hash_index import MADE, NEW, PROMOTE

__all__ = ["need_kernel", "COMPILE_CASES", "NEED_HEAD", "PROBE_LIMIT", "EXTRAS"]

_K_NEW, _K_GETS = tl.constexpr(NEW), tl.constexpr(MADE | PROMOTE)
# store/_index.py's Outcome codes and PROBE_LIMIT, NEED_HEAD (tests/unit/triton checks they agree)
_GROW, _OVER, _DUP, _LONG = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3), tl.constexpr(4)
PROBE_LIMIT = 1024
NEED_HEAD = 8
# the report's extras after need[] (store/_index_triton.py names them): outcome, a bad table entry, the first bad
# count's position, value and table, the keys to insert or promote, the records a claim round has yet to place,
# the records the call before left unplaced (its claim_finish_kernel's count: 0 unless the index had no empty bucket)
EXTRAS = 8
_K_PROBE_LIMIT, _K_HEAD = tl.constexpr(PROBE_LIMIT), tl.constexpr(NEED_HEAD)
_K_I64_MAX, _K_LOW31 = tl.constexpr(2**63 - 1), tl.constexpr(2**31 - 1)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _crowd(sorted_keys, order, tids, m, longest, long_table, BLOCK: tl.constexpr):
    """store/_index_torch.py::_crowding over the m new keys (sorted by home, batch order within:
    the sort's first m): the longest probe they would have placed alone into an empty index, if
    longer than `longest`, with its table (the first in the sort)."""
    best = tl.zeros((), tl.int64)
    best_at = tl.zeros((), tl.int64)
    carry = tl.zeros((), tl.int64) - _K_I64_MAX  # max over earlier blocks of (home - sorted position)
    s0 = tl.zeros((), tl.int64)
    while s0 < m:
        s = s0 + tl.arange(0, BLOCK)
        ms = s < m
        h = tl.load(sorted_keys + s, mask=ms, other=0)
        v = tl.where(ms, h - s, -_K_I64_MAX)
        run = tl.maximum(tl.associative_scan(v, 0, _max2), carry)
        c = tl.where(ms, run + s - h + 1, 0)
        top = tl.max(c, axis=0)
        at = tl.min(tl.where(c == top, s, _K_I64_MAX), axis=0)
        best_at = tl.where(top > best, at, best_at)
        best = tl.maximum(best, top)
        carry = tl.maximum(carry, tl.max(v, axis=0))
        s0 += BLOCK
    longer = (m >= 2) & (best > longest)
    table = tl.load(tids + tl.load(order + best_at))
    return tl.where(longer, best, longest), tl.where(longer, table.to(tl.int64), long_table)


@triton.jit
def _duplicates(sorted_keys, order, keys, tids, todo, BLOCK: tl.constexpr):
    """(any, key, table): the smallest (table, key) given twice among the `todo` keys to insert or
    promote (the sort's first `todo`).  Twins share a sort key (home, and new or promoted), so
    each key is compared with the keys before it in its run of equal sort keys."""
    found = tl.zeros((), tl.int64)
    best_t = tl.zeros((), tl.int64) + _K_I64_MAX
    best_k = tl.zeros((), tl.int64) + _K_I64_MAX
    s0 = tl.zeros((), tl.int64)
    while s0 < todo:
        s = s0 + tl.arange(0, BLOCK)
        ms = s < todo
        h = tl.load(sorted_keys + s, mask=ms, other=0)
        j = tl.load(order + s, mask=ms, other=0)
        k = tl.load(keys + j, mask=ms, other=0)
        t = tl.load(tids + j, mask=ms, other=0).to(tl.int64)
        twin = ms & (s < 0)  # all false
        back = ms
        d = 1
        while tl.max(back.to(tl.int32), axis=0) > 0:
            q = s - d
            back = back & (q >= 0)
            back = back & (tl.load(sorted_keys + q, mask=back, other=-1) == h)
            jq = tl.load(order + q, mask=back, other=0)
            same = back & (tl.load(keys + jq, mask=back, other=0) == k) & \
                (tl.load(tids + jq, mask=back, other=0).to(tl.int64) == t)
            twin = twin | same
            d += 1
        tb = tl.min(tl.where(twin, t, _K_I64_MAX), axis=0)
        kb = tl.min(tl.where(twin & (t == tb), k, _K_I64_MAX), axis=0)
        better = (tb < best_t) | ((tb == best_t) & (kb < best_k))
        best_t = tl.where(better, tb, best_t)
        best_k = tl.where(better, kb, best_k)
        found = tl.maximum(found, tl.max(twin.to(tl.int64), axis=0))
        s0 += BLOCK
    return found, tl.where(found != 0, best_k, 0), tl.where(found != 0, best_t, 0)


@triton.jit(do_not_specialize=["n", "T", "tstride", "max_entries", "rows_capacity", "pid0"])
def need_kernel(flags, tids, keys, counts, pos, per_table, tab_rows, tab_pending, tab_limit, tstride, scal, n, T,
                max_entries, rows_capacity, sorted_keys, order, rank, active, first, new_list, ok_flag, values, stuck,
                pid0,
                HAS_COUNTS: tl.constexpr, SORTED: tl.constexpr, BLOCK: tl.constexpr):
    """values = need[] (store/_index.py: head (8), per table (new rows, new pending) (2T), the group
    after the call (3), per table after it (rows, pending) (2T)), then EXTRAS (outcome, bad table
    entry, first bad count's position, value, table, keys to insert or promote, records left to
    place, stuck[0]: the call before's records left unplaced); tab_* a table field each (table t's at
    t * tstride), scal the group's (entries, row_hwm, free rows listed); per_table [3T + 3] the probe's counts and
    checks (zeroed when read: the next call's probe adds into it).
    rank[i]: the keys before i that get a row (written when some do); active[i]: key i is new and the
    outcome DONE, first[i]: its bucket in the first claim round (pos), -1 when not active (both
    written when some key is new); new_list[:values[0]]: the active keys' positions, in batch order (written
    when the outcome is DONE and some key is new: claim_finish_kernel's list)."""
    if pid0 + tl.program_id(0) == 0:  # (a grid of one program)
        # the probe's counts per table; the keys are walked only where some get a row (their ranks) or
        # are new (to place): a step whose keys are all known costs O(tables) here
        carry = tl.zeros((), tl.int64)
        n_new = tl.zeros((), tl.int64)
        n_promote = tl.zeros((), tl.int64)
        j = tl.zeros((), tl.int64)
        while j < T:
            tt = j + tl.arange(0, BLOCK)
            mt = tt < T
            rows_t = tl.load(per_table + tt * 3, mask=mt, other=0)
            promoted_t = tl.load(per_table + tt * 3 + 2, mask=mt, other=0)
            carry += tl.sum(rows_t, axis=0)
            n_promote += tl.sum(promoted_t, axis=0)
            n_new += tl.sum(rows_t - promoted_t + tl.load(per_table + tt * 3 + 1, mask=mt, other=0), axis=0)
            j += BLOCK
        bad_tid = tl.load(per_table + 3 * T + 1)
        bad_at = n - tl.load(per_table + 3 * T + 2)
        if carry > 0:
            done = tl.zeros((), tl.int64)
            i = tl.zeros((), tl.int64)
            while i < n:
                at = i + tl.arange(0, BLOCK)
                m = at < n
                gets = ((tl.load(flags + at, mask=m, other=0) & _K_GETS) != 0).to(tl.int64)
                tl.store(rank + at, done + tl.cumsum(gets, axis=0) - gets, mask=m)
                done += tl.sum(gets, axis=0)
                i += BLOCK
        ts = tstride.to(tl.int64)
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
            limit = tl.load(tab_limit + tt * ts, mask=mt, other=0)
            over = tl.maximum(over, tl.max((mt & (tl.load(tab_rows + tt * ts, mask=mt, other=0) + rows_t > limit)).to(
                tl.int64), axis=0))
            tl.store(values + _K_HEAD + 2 * tt, rows_t, mask=mt)
            tl.store(values + _K_HEAD + 2 * tt + 1, pend_t, mask=mt)
            j += BLOCK
        stamp = tl.load(per_table + 3 * T)
        big = stamp >> 31
        long_table = tl.load(tids + (_K_LOW31 - (stamp & _K_LOW31)), mask=big > 0, other=-1).to(tl.int64)
        todo = n_new + n_promote
        dup = tl.zeros((), tl.int64)
        dup_key = tl.zeros((), tl.int64)
        dup_table = tl.zeros((), tl.int64)
        if SORTED:
            big, long_table = _crowd(sorted_keys, order, tids, n_new, big, long_table, BLOCK)
            dup, dup_key, dup_table = _duplicates(sorted_keys, order, keys, tids, todo, BLOCK)
        entries, hwm, nfree = tl.load(scal), tl.load(scal + 1), tl.load(scal + 2)
        grow = (entries + n_new > max_entries) | (hwm + tl.maximum(n_rows - nfree, 0) > rows_capacity)
        outcome = tl.where(grow, _GROW, 0)
        outcome = tl.where(big > _K_PROBE_LIMIT, _LONG, outcome)
        outcome = tl.where(over != 0, _OVER, outcome)
        outcome = tl.where(dup != 0, _DUP, outcome)
        ok = (outcome == 0) & (bad_tid == 0) & (bad_at == n) & (tl.load(stuck) == 0)
        if n_new > 0:
            listed = tl.zeros((), tl.int64)
            i = tl.zeros((), tl.int64)
            while i < n:
                at = i + tl.arange(0, BLOCK)
                m = at < n
                go = ((tl.load(flags + at, mask=m, other=0) & _K_NEW) != 0) & ok
                tl.store(active + at, go.to(tl.int32), mask=m)
                tl.store(first + at, tl.where(go, tl.load(pos + at, mask=m & go, other=-1), -1), mask=m)
                g = go.to(tl.int64)
                tl.store(new_list + listed + tl.cumsum(g, axis=0) - g, at, mask=go)
                listed += tl.sum(g, axis=0)
                i += BLOCK
        tl.store(ok_flag, ok.to(tl.int32))
        made = tl.where(ok, carry, 0)
        take = tl.minimum(made, nfree)
        x = _K_HEAD + 2 * T
        tl.store(values + 0, n_new)
        tl.store(values + 1, n_rows)
        tl.store(values + 2, pending)
        tl.store(values + 3, made)
        tl.store(values + 4, dup_key)
        tl.store(values + 5, dup_table)
        tl.store(values + 6, long_table)
        tl.store(values + 7, big)
        # the group after the call (unchanged unless DONE)
        tl.store(values + x, entries + tl.where(ok, n_new, 0))
        tl.store(values + x + 1, hwm + made - take)
        tl.store(values + x + 2, nfree - take)
        j = tl.zeros((), tl.int64)
        while j < T:
            tt = j + tl.arange(0, BLOCK)
            mt = tt < T
            rows_t = tl.load(per_table + tt * 3, mask=mt, other=0)
            pend_t = tl.load(per_table + tt * 3 + 1, mask=mt, other=0) - tl.load(per_table + tt * 3 + 2, mask=mt,
                                                                                    other=0)
            tl.store(values + x + 3 + 2 * tt, tl.load(tab_rows + tt * ts, mask=mt, other=0) + tl.where(ok, rows_t, 0),
                     mask=mt)
            tl.store(values + x + 4 + 2 * tt, tl.load(tab_pending + tt * ts, mask=mt, other=0) +
                     tl.where(ok, pend_t, 0), mask=mt)
            j += BLOCK
        e = x + 3 + 2 * T
        bad = tl.minimum(bad_at, n - 1)
        tl.store(values + e, outcome.to(tl.int64))
        tl.store(values + e + 1, bad_tid)
        tl.store(values + e + 2, bad_at)
        if HAS_COUNTS:
            tl.store(values + e + 3, tl.load(counts + bad).to(tl.int64))
        else:
            tl.store(values + e + 3, bad_at)
        tl.store(values + e + 4, tl.load(tids + bad).to(tl.int64))
        tl.store(values + e + 5, todo)
        tl.store(values + e + 6, tl.where(ok, n_new, 0))
        tl.store(values + e + 7, tl.load(stuck))  # (the call then changes nothing: not ok)
        # per_table zeroed for the next call's probe, once every read of it above is done
        tl.debug_barrier()
        j = tl.zeros((), tl.int64)
        while j < 3 * T + 3:
            tt = j + tl.arange(0, BLOCK)
            tl.store(per_table + tt, tl.zeros([BLOCK], tl.int64), mask=tt < 3 * T + 3)
            j += BLOCK


_SIG = {name: "*i64" for name in ("tids", "keys", "counts", "pos", "per_table", "tab_rows", "tab_pending", "tab_limit",
                                  "scal", "sorted_keys", "order", "rank", "first", "new_list", "values", "stuck")}
_SIG = {"flags": "*i32", **_SIG, "tstride": "i64", "n": "i64", "T": "i64", "max_entries": "i64",
        "rows_capacity": "i64", "active": "*i32", "ok_flag": "*i32", "pid0": "i32", "HAS_COUNTS": "constexpr",
        "SORTED": "constexpr", "BLOCK": "constexpr"}
# (the kernel's parameters in order: a signature lists them so)
_ORDER = ("flags tids keys counts pos per_table tab_rows tab_pending tab_limit tstride scal n T max_entries "
          "rows_capacity sorted_keys order rank active first new_list ok_flag values stuck pid0 HAS_COUNTS SORTED "
          "BLOCK").split()
# (the sort key: int32 below 2^30 buckets, store/_index_triton.py)
COMPILE_CASES = [(f"hash_need.need[counts={int(c)}, sorted={int(s)}, sort key {key}]", need_kernel,
                  {k: _SIG[k] for k in _ORDER} | {"sorted_keys": f"*{key}"},
                  {"HAS_COUNTS": c, "SORTED": s, "BLOCK": 1024})
                 for c in (False, True) for s in (False, True) for key in ("i32", "i64")]
# the same with every scalar an i32 (values below 2**31 arrive so)
COMPILE_CASES += [(f"{name} (i32 scalars)", fn, {k: "i32" if v == "i64" else v for k, v in sig.items()}, cx)
                  for name, fn, sig, cx in COMPILE_CASES]
