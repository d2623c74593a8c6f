"""Find and find-or-insert of a dynamic group's key index as triton kernels (issue 32, item 4).

The layout is store/_index.py's (buckets int64 [B, 4]: key, table (-1 empty), code + count << 32,
last step); the specification is store/_index_torch.py, which store/_index_triton.py drives these
kernels to equal bucket for bucket:

* ``probe_kernel``   every (table, key) walks from its home to its record or the first empty bucket;
                     with INSERT it also classifies the key (found / new / promoted / given a row)
                     by its table's admission count, adds the table's counts and the checks
                     (longest probe, bad entries) with integer atomics, and writes a sort key by home;
* ``commit_kernel``  gated by a device flag (the call's outcome, hash_need.py's): row slots in batch
                     order (smallest free slot first), the found keys' counts and last steps, the
                     records of the new keys, the slots returned;
* the claims of the new records' buckets: hash_claim.py.

Every kernel takes its first program id (``pid0``) so a test can launch grids of one program in a
shuffled order.  Scalars arrive as i32 or i64 (triton specializes by value): each is widened to
int64 before it meets 64-bit words.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["probe_kernel", "commit_kernel", "FOUND", "NEW", "PROMOTE", "MADE", "EMPTY_TABLE", "PENDING",
           "COMPILE_CASES"]

# store/_index.py's constants (this package sits below store; tests/unit/triton checks they agree)
EMPTY_TABLE = -1
PENDING = -2
# flags per key of a find-or-insert
FOUND, NEW, PROMOTE, MADE = 1, 2, 4, 8
_INT32_MAX = 2**31 - 1
# the same values as the kernels see them (a kernel reads only constexpr globals)
_K_EMPTY, _K_PENDING, _K_INT32_MAX = tl.constexpr(EMPTY_TABLE), tl.constexpr(PENDING), tl.constexpr(_INT32_MAX)
_K_FOUND, _K_NEW = tl.constexpr(FOUND), tl.constexpr(NEW)
_K_PROMOTE, _K_MADE = tl.constexpr(PROMOTE), tl.constexpr(MADE)


@triton.jit
def _home(key, hash_key, nbuckets):
    """((mix64(key ^ hash_key) >> 32) * B) >> 32 in unsigned 64-bit arithmetic (store/_index.py::home)."""
    x = (key ^ hash_key).to(tl.uint64, bitcast=True)
    x = x ^ (x >> 33)
    x = x * 0xFF51AFD7ED558CCD
    x = x ^ (x >> 33)
    x = x * 0xC4CEB9FE1A85EC53
    x = x ^ (x >> 33)
    return (((x >> 32) * nbuckets.to(tl.uint64)) >> 32).to(tl.int64)


# Scalars are never specialized: triton turns an int argument equal to 1 into a constexpr on the GPU
# (not in the interpreter), where `.to(tl.int64)` would fail to compile (a step, epoch or count of 1).
@triton.jit(do_not_specialize=["nbuckets", "n", "ntables", "tstride", "pid0"])
def probe_kernel(buckets, nbuckets, keys, tids, n, ntables, hash_keys, admit_ks, tstride, counts, admit,
                 codes, pos, n_after, flags, hits, per_table, sortkey, pid0,
                 INSERT: tl.constexpr, ROWS_ONLY: tl.constexpr, HAS_COUNTS: tl.constexpr,
                 HAS_ADMIT: tl.constexpr, HAS_HITS: tl.constexpr, BLOCK: tl.constexpr):
    """codes[i]: slot, PENDING or -1 (absent, skipped); hits[i]: count (find) or count after the
    call (INSERT).  hash_keys / admit_ks: a table field each, table t's at t * tstride.  INSERT also
    writes pos (the key's bucket or the first empty one on its path, -1 skipped), n_after, flags,
    sortkey (new: home, promoted: B + home, else 2B; int32 when 2B fits: one sort orders them for the crowd and
    duplicate checks), adds per table [T, 3] (new rows, new pending keys, promoted keys) and keeps
    in per_table[3T:3T + 3] (zeros before the call; integer atomics: exact in any order) the longest
    probe as (probes << 31) | (2^31 - 1 - position) (its max: the longest, first in batch order),
    whether a table column entry names no table, and n - the first position whose count is below 1."""
    i = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    t = tl.load(tids + i, mask=live, other=-1)
    on = live & (t >= 0) & (t < ntables)
    key = tl.load(keys + i, mask=live, other=0)
    nb = nbuckets.to(tl.int64)
    ts = tstride.to(tl.int64)
    start = _home(key, tl.load(hash_keys + t * ts, mask=on, other=0), nb)
    p = start
    active = on
    hit = on & (t < 0)  # all false
    looked = tl.zeros([BLOCK], tl.int64)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        table = tl.load(buckets + p * 4 + 1, mask=active, other=_K_EMPTY)
        here = active & (table == t) & (tl.load(buckets + p * 4, mask=active, other=0) == key)
        hit = hit | here
        looked += active.to(tl.int64)
        # a table never fuller than MAX_LOAD has an empty bucket: `looked < nb` only bounds the loop
        active = active & ~here & (table != _K_EMPTY) & (looked < nb)
        p = tl.where(active, p + 1, p)
        p = tl.where(p == nb, 0, p)
    word = tl.load(buckets + p * 4 + 2, mask=hit, other=0)
    code = tl.where(hit, (word << 32) >> 32, -1)
    count = tl.where(hit, word >> 32, 0)
    if not INSERT:
        if ROWS_ONLY:
            code = tl.maximum(code, -1)
        tl.store(codes + i, code, mask=live)
        if HAS_HITS:
            tl.store(hits + i, count, mask=live)
    else:
        if HAS_COUNTS:
            c = tl.load(counts + i, mask=on, other=1).to(tl.int64)
            bad = live & (t >= 0) & (tl.load(counts + i, mask=live, other=1) < 1)
            tl.atomic_max(per_table + ntables.to(tl.int64) * 3 + 2 + tl.zeros([BLOCK], tl.int64), n - i, mask=bad)
        else:
            c = tl.full([BLOCK], 1, tl.int64)
        if HAS_ADMIT:
            drawn = tl.load(admit + i, mask=on, other=1) != 0
        else:
            drawn = on | ~on
        admit_k = tl.load(admit_ks + t * ts, mask=on, other=1)
        after = count + c
        new = on & ~hit & drawn
        promote = hit & (code == _K_PENDING) & (after >= admit_k)
        made = new & (c >= admit_k)
        f = hit.to(tl.int32) * _K_FOUND + new.to(tl.int32) * _K_NEW + promote.to(tl.int32) * _K_PROMOTE + \
            made.to(tl.int32) * _K_MADE
        tl.store(codes + i, code, mask=live)
        tl.store(pos + i, tl.where(on, p, -1), mask=live)
        tl.store(n_after + i, after, mask=live)
        tl.store(flags + i, f, mask=live)
        tl.store(sortkey + i, tl.where(new, start, tl.where(promote, nb + start, 2 * nb)), mask=live)
        if HAS_HITS:
            tl.store(hits + i, tl.where(hit | new, tl.minimum(after, _K_INT32_MAX), 0), mask=live)
        one = tl.full([BLOCK], 1, tl.int64)
        tl.atomic_add(per_table + t * 3, one, mask=made | promote)
        tl.atomic_add(per_table + t * 3 + 1, one, mask=new & ~made)
        tl.atomic_add(per_table + t * 3 + 2, one, mask=promote)
        probes = (p - start + nb) % nb + 1
        tl.atomic_max(per_table + ntables.to(tl.int64) * 3 + tl.zeros([BLOCK], tl.int64),
                      (probes << 31) | (_K_INT32_MAX - i), mask=on)
        tl.atomic_max(per_table + ntables.to(tl.int64) * 3 + 1 + tl.zeros([BLOCK], tl.int64),
                      tl.full([BLOCK], 1, tl.int64), mask=live & ((t < -1) | (t >= ntables)))


@triton.jit(do_not_specialize=["n", "step", "pid0"])
def commit_kernel(buckets, tids, n, codes, pos, n_after, flags, rank, free_rows, scal, step, ok_flag,
                  out, word2, last, made_slots, made_keys, keys, made_tids, pid0, BLOCK: tl.constexpr):
    """When ok_flag[0] (the call's outcome is DONE): the found keys' words 2 and 3, each new
    record's words 2 (code + count) and 3 (`step`) into word2 and last (the claims' records), new rows'
    (slot, key, table) at their rank; out[i] the row slot or -1.  Otherwise out[i] is what the probe
    found (as the reference leaves it).
    scal: the group's (entries, row_hwm, free rows listed) before the call."""
    ok = tl.load(ok_flag) != 0
    i = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    t = tl.load(tids + i, mask=live, other=-1)
    on = live & (t >= 0)
    f = tl.load(flags + i, mask=live, other=0)
    code = tl.load(codes + i, mask=live, other=-1)
    gets_row = (f & (_K_MADE | _K_PROMOTE)) != 0
    r = tl.load(rank + i, mask=live, other=0)
    nfree = tl.load(scal + 2)
    from_free = r < nfree
    freed = tl.load(free_rows + (nfree - 1 - r), mask=live & gets_row & from_free, other=0).to(tl.int64)
    slot = tl.where(from_free, freed, tl.load(scal + 1) + r - nfree)
    now = tl.where(gets_row, slot, tl.where((f & _K_NEW) != 0, _K_PENDING, code))
    done = tl.where(now >= 0, now, -1)
    tl.store(out + i, tl.where(on, tl.where(ok, done, tl.maximum(code, -1)), -1), mask=live)
    count = tl.minimum(tl.maximum(tl.load(n_after + i, mask=live, other=0), 0), _K_INT32_MAX)
    low = now - ((now >> 32) << 32)  # the code's low 32 bits, as unsigned
    w = (count << 32) | low
    tl.store(word2 + i, w, mask=live)
    tl.store(last + i, tl.zeros([BLOCK], tl.int64) + step.to(tl.int64), mask=live)
    write = live & ok & ((f & _K_FOUND) != 0)
    p = tl.load(pos + i, mask=write, other=0)
    tl.store(buckets + p * 4 + 2, w, mask=write)
    tl.store(buckets + p * 4 + 3, tl.zeros([BLOCK], tl.int64) + step.to(tl.int64), mask=write)
    give = live & ok & gets_row
    tl.store(made_slots + r, slot, mask=give)
    tl.store(made_keys + r, tl.load(keys + i, mask=give, other=0), mask=give)
    tl.store(made_tids + r, t.to(tl.int64), mask=give)


def _sig(names: str, types: dict[str, str]) -> dict[str, str]:
    """A compile signature: every name an int64 pointer unless `types` says otherwise."""
    return {name: types.get(name, "*i64") for name in names.split()}


_I64 = "i64"
_CONST = "constexpr"
_PROBE = _sig("buckets nbuckets keys tids n ntables hash_keys admit_ks tstride counts admit codes pos n_after "
              "flags hits per_table sortkey pid0 INSERT ROWS_ONLY HAS_COUNTS HAS_ADMIT HAS_HITS BLOCK",
              {"nbuckets": _I64, "n": _I64, "ntables": _I64, "tstride": _I64, "pid0": _I64, "admit": "*u8",
               "flags": "*i32",
               **{k: _CONST for k in ("INSERT", "ROWS_ONLY", "HAS_COUNTS", "HAS_ADMIT", "HAS_HITS", "BLOCK")}})
_COMMIT = _sig("buckets tids n codes pos n_after flags rank free_rows scal step ok_flag out word2 last "
               "made_slots made_keys keys made_tids pid0 BLOCK",
               {"n": _I64, "step": _I64, "pid0": _I64, "flags": "*i32",
                "free_rows": "*i32", "ok_flag": "*i32", "BLOCK": _CONST})
# (name, kernel, signature, constexprs): what `python -m hugeembed._triton.compile_check` builds for sm_90
_FLAGS = ("ROWS_ONLY", "HAS_COUNTS", "HAS_ADMIT", "HAS_HITS")
# every variant store/_index_triton.py launches: find (rows only or codes, with or without hits), find-or-insert
# (with or without counts, the admission draw, hits)
COMPILE_CASES = [(f"hash_index.probe (find{', rows' if rows else ''}{', hits' if hits else ''})", probe_kernel, _PROBE,
                  dict(zip(_FLAGS, (rows, False, False, hits)), INSERT=False, BLOCK=128))
                 for rows in (False, True) for hits in (False, True)]
COMPILE_CASES += [(f"hash_index.probe (find_or_insert{', counts' if c else ''}{', admit' if a else ''}"
                   f"{', hits' if h else ''}, sort key {key})", probe_kernel, {**_PROBE, "sortkey": f"*{key}"},
                   dict(zip(_FLAGS, (False, c, a, h)), INSERT=True, BLOCK=128))
                  for c in (False, True) for a in (False, True) for h in (False, True) for key in ("i32", "i64")]
COMPILE_CASES += [("hash_index.commit", commit_kernel, _COMMIT, {"BLOCK": 128})]
# the same with every scalar an i32 (values below 2**31 arrive so)
COMPILE_CASES += [(f"{name} (i32 scalars)", fn, {k: "i32" if v == _I64 else v for k, v in sig.items()}, cx)
                  for name, fn, sig, cx in COMPILE_CASES]
