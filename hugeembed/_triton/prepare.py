"""Clean + dedup of a batch on the device (the triton twin of functional/_reference.prepare_torch): a
few launches, grids from the batch's shapes, and one read of the device by the caller (the report).

    _clean_bags    a program per BAG_BLOCK plan bags, a lane per bag: TF's cleaning (pruned ids,
                   out-of-range policy, weights <= 0 dropped) counts each bag's kept ids (+1 for an
                   empty pooled bag with a default_id); the programs past the bags check every input
                   bag's offsets
    torch.cumsum   the bags' lengths -> the cleaned offsets
    _scatter_bags  the same pass again, each kept id written at its place in bag order (with its
                   weight, table and sort key); the programs past the bags pad the tail
    torch.sort     by the key (table base + id: one sort), or by id then table (dynamic tables: two)
    _run_heads     which sorted positions start a run of one (table, id) (dynamic tables: it also writes
                   the order, the id sort's order gathered by the table sort's)
    torch.cumsum   -> each run's unique index
    _encode_runs   the unique keys, each entry's unique index, the counts per key and per table

The report (int64, zeroed) gathers what the host needs, read once: [bad offsets, first bad weight,
first id out of range (as ``BIG - code``, code = feature * (N + 1) + position: the atomic max keeps
the first), ids kept, unique keys per table (T), the cleaned offsets at each feature's start (F + 1)].
Every index stays in range however bad the batch is (a bad batch raises after the read).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["REPORT_HEAD", "BIG", "BAG_BLOCK", "COMPILE_CASES"]

REPORT_HEAD = 4
BAG_BLOCK = 128  # bags a clean / scatter program walks side by side (a lane each)
BIG = 2**62
_HEAD = tl.constexpr(REPORT_HEAD)
_BIG = tl.constexpr(BIG)
_NONE = tl.constexpr(3)  # combiner code of an unpooled feature (plan.arrays)


@triton.jit
def _bags_of(q, lane, B, N, offsets, src, feat_table):
    """Bags q (a lane each, feature-major over the plan's features; lanes off `lane` read an empty bag
    0): their feature, input span [lo, hi) clamped to the values (bad offsets are reported by the
    clean pass, never read past), and table."""
    q = tl.where(lane, q, 0)
    f = q // B
    ib = tl.load(src + f) * B + (q - f * B)
    lo = tl.minimum(tl.maximum(tl.load(offsets + ib), 0), N)
    hi = tl.minimum(tl.maximum(tl.load(offsets + ib + 1), lo), N)
    return f, lo, tl.where(lane, hi, lo), tl.load(feat_table + f)


@triton.jit
def _ids_at(at, m, prune, nr, pol, dflt, values, weights, HAS_W: tl.constexpr):
    """(the ids after the out-of-range policy, kept, not-finite weight, id out of range under "error",
    weights) of the positions `at` (mask `m`), each lane under its feature's rules (prune_negative,
    its table's rows, out_of_range policy, default_id)."""
    v = tl.load(values + at, mask=m, other=0)
    if HAS_W:
        w = tl.load(weights + at, mask=m, other=1.0)
        bad_w = m & ((w != w) | (tl.abs(w) == float("inf")))
        keep = m & (w > 0)
    else:
        w = tl.where(m, 1.0, 1.0)
        bad_w = m & (v != v)  # (all False)
        keep = m
    keep = keep & ~((v < 0) & prune)
    oob = keep & (nr >= 0) & ((v < 0) | (v >= nr))
    err = oob & (pol == 0)
    keep = keep & ~(oob & (pol == 1))
    v = tl.where(oob & (pol == 2), dflt, v)
    return v, keep, bad_w, err, w


@triton.jit
def _clean_bags(pid0, offsets, values, weights, src, feat_table, num_rows, prune_neg, oor, has_default,
                default_id, combiner, lengths, out_offsets, report, B, FB, n_in, N, NBB,
                HAS_W: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    """Program p < NBB: the cleaned lengths of bags [p * BLOCK_B, (p + 1) * BLOCK_B), a lane per bag
    walking its ids; p >= NBB: the input bags [k * BLOCK, (k + 1) * BLOCK)'s offsets (k = p - NBB) in
    [0, N], never decreasing, from 0 to N.  One atomic per program, only when it has a finding."""
    p = pid0 + tl.program_id(0)
    if p < NBB:
        q = p.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        lane = q < FB
        f, lo, hi, t = _bags_of(q, lane, B, N, offsets, src, feat_table)
        prune, nr = tl.load(prune_neg + f) != 0, tl.load(num_rows + t)
        pol, dflt = tl.load(oor + f), tl.load(default_id + f)
        kept = tl.zeros((BLOCK_B,), tl.int64)
        first_bad = tl.zeros((BLOCK_B,), tl.int64)
        first_err = tl.zeros((BLOCK_B,), tl.int64)
        longest = tl.max(hi - lo, axis=0)
        j = 0
        while j < longest:  # (a while: the interpreter's range() cannot take a reduced bound under numpy 2)
            at = lo + j
            m = at < hi
            v, keep, bad_w, err, w = _ids_at(at, m, prune, nr, pol, dflt, values, weights, HAS_W)
            kept += keep.to(tl.int64)
            code = _BIG - (f.to(tl.int64) * (N + 1) + at)
            first_bad = tl.maximum(first_bad, tl.where(bad_w, code, 0))
            first_err = tl.maximum(first_err, tl.where(err, code, 0))
            j += 1
        fill = lane & (kept == 0) & (tl.load(has_default + f) != 0) & (tl.load(combiner + f) != _NONE)
        tl.store(lengths + q, kept + fill.to(tl.int64), mask=lane)
        fb = tl.max(first_bad, axis=0)
        fe = tl.max(first_err, axis=0)
        tl.atomic_max(report + 1, fb, mask=fb > 0)
        tl.atomic_max(report + 2, fe, mask=fe > 0)
        if p == 0:
            tl.store(out_offsets, tl.zeros((), tl.int64))
    else:
        # (names of their own: a name's type must agree across the branches)
        in_bag = (p - NBB) * BLOCK + tl.arange(0, BLOCK)
        m_in = in_bag < tl.maximum(n_in, 1)
        first = tl.load(offsets + in_bag, mask=m_in, other=0)
        last = tl.load(offsets + tl.minimum(in_bag + 1, n_in), mask=m_in, other=0)
        bad = (last < first) | (last > N) | (first < 0) | ((in_bag == 0) & (first != 0)) | (
            (in_bag == tl.maximum(n_in, 1) - 1) & (last != N))
        any_bad = tl.max((m_in & bad).to(tl.int64), axis=0)
        tl.atomic_max(report, any_bad, mask=any_bad > 0)


@triton.jit
def _scatter_bags(pid0, offsets, values, weights, src, feat_table, num_rows, prune_neg, oor, has_default,
                  default_id, combiner, table_base, out_offsets, ids_out, w_out, tab_out, key_out, report,
                  B, F, FB, N, M, T, sentinel, NBB, HAS_W: tl.constexpr, LINEAR: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    """Program p < NBB: bags [p * BLOCK_B, (p + 1) * BLOCK_B)'s kept ids (and default ids) at their places
    from out_offsets, a lane per bag; p >= NBB: the positions [n_keep, M) of block p - NBB get table T (not
    counted) and the sentinel key."""
    p = pid0 + tl.program_id(0)
    if p < NBB:
        q = p.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        lane = q < FB
        f, lo, hi, t = _bags_of(q, lane, B, N, offsets, src, feat_table)
        prune, nr = tl.load(prune_neg + f) != 0, tl.load(num_rows + t)
        pol, dflt = tl.load(oor + f), tl.load(default_id + f)
        base = tl.load(table_base + t)
        start = tl.load(out_offsets + q, mask=lane, other=0)
        t32 = t.to(tl.int32)
        placed = tl.zeros((BLOCK_B,), tl.int64)
        longest = tl.max(hi - lo, axis=0)
        j = 0
        while j < longest:
            at = lo + j
            m = at < hi
            v, keep, bad_w, err, w = _ids_at(at, m, prune, nr, pol, dflt, values, weights, HAS_W)
            dest = start + placed
            ok = keep & (dest < M)  # (past M only for offsets that raise)
            tl.store(ids_out + dest, v, mask=ok)
            tl.store(tab_out + dest, t32, mask=ok)
            if HAS_W:
                tl.store(w_out + dest, w, mask=ok)
            if LINEAR:
                tl.store(key_out + dest, (base + v).to(key_out.dtype.element_ty), mask=ok)
            placed += keep.to(tl.int64)
            j += 1
        fill = lane & (placed == 0) & (tl.load(has_default + f) != 0) & (tl.load(combiner + f) != _NONE) & (
            start < M)
        tl.store(ids_out + start, dflt, mask=fill)
        tl.store(tab_out + start, t32, mask=fill)
        if HAS_W:
            tl.store(w_out + start, tl.where(fill, 1.0, 1.0), mask=fill)
        if LINEAR:
            tl.store(key_out + start, (base + dflt).to(key_out.dtype.element_ty), mask=fill)
        tl.store(report + _HEAD + T + f, start, mask=lane & (q - f * B == 0))
        end = tl.load(out_offsets + FB)
        last = lane & (q == FB - 1)
        tl.store(report + _HEAD + T + F + f * 0, end + start * 0, mask=last)
        tl.store(report + 3 + f * 0, end + start * 0, mask=last)
    else:
        at = (p - NBB) * BLOCK + tl.arange(0, BLOCK)
        tail = (at >= tl.load(out_offsets + FB)) & (at < M)
        tl.store(tab_out + at, tl.zeros((BLOCK,), tl.int32) + T, mask=tail)
        tl.store(ids_out + at, tl.zeros((BLOCK,), tl.int64), mask=tail)
        if LINEAR:
            tl.store(key_out + at, (tl.zeros((BLOCK,), tl.int64) + sentinel).to(key_out.dtype.element_ty), mask=tail)


@triton.jit
def _run_heads(pid0, perm, by_id, by_table, ids, tabs, heads, M, T, DEDUP: tl.constexpr, TWO_SORTS: tl.constexpr,
               BLOCK: tl.constexpr):
    """heads[i] = 1 where sorted position i starts a run of one (table, id) (DEDUP), or holds a counted
    entry (every entry its own key).  TWO_SORTS (dynamic tables): the order is by_id[by_table[i]] (a stable
    sort by id, then of its tables), written into perm here (the gather of the second sort's order)."""
    at = (pid0 + tl.program_id(0)) * BLOCK + tl.arange(0, BLOCK)
    m = at < M
    if TWO_SORTS:
        j = tl.load(by_id + tl.load(by_table + at, mask=m, other=0), mask=m, other=0)
        tl.store(perm + at, j, mask=m)
    else:
        j = tl.load(perm + at, mask=m, other=0)
    t = tl.load(tabs + j, mask=m, other=T)
    head = m & (t < T)
    if DEDUP:
        if TWO_SORTS:
            jp = tl.load(by_id + tl.load(by_table + at - 1, mask=m & (at > 0), other=0), mask=m & (at > 0), other=0)
        else:
            jp = tl.load(perm + at - 1, mask=m & (at > 0), other=0)
        tp = tl.load(tabs + jp, mask=m & (at > 0), other=T)
        v = tl.load(ids + j, mask=m, other=0)
        vp = tl.load(ids + jp, mask=m & (at > 0), other=0)
        head = head & ((at == 0) | (v != vp) | (t != tp))
    tl.store(heads + at, head.to(tl.int32), mask=m)


@triton.jit
def _encode_runs(pid0, perm, ids, tabs, heads, uid, out_offsets, unique_keys, unique_tables, inverse, unique_counts,
                 seg_start, counts, report, M, FB, T, BLOCK: tl.constexpr):
    """Each run's key, table and first sorted position at its unique index, each counted entry's unique
    index, the entries per key and the keys per table (integer atomics: exact in any order); seg_start
    past the unique keys holds the entries kept, and counts = (entries kept, unique keys): the update
    kernels' view of the runs (segment_optim's Dedup)."""
    p = pid0 + tl.program_id(0)
    at = p * BLOCK + tl.arange(0, BLOCK)
    m = at < M
    j = tl.load(perm + at, mask=m, other=0)
    t = tl.load(tabs + j, mask=m, other=T)
    counted = m & (t < T)
    head = tl.load(heads + at, mask=m, other=0) != 0
    u = tl.load(uid + at, mask=m, other=1).to(tl.int64) - 1
    tl.store(unique_keys + u, tl.load(ids + j, mask=head, other=0), mask=head)
    tl.store(unique_tables + u, t, mask=head)
    tl.store(seg_start + u, at.to(tl.int32), mask=head)
    tl.store(inverse + j, u, mask=counted)
    tl.atomic_add(unique_counts + u, tl.full((BLOCK,), 1, tl.int64), mask=counted)
    tl.atomic_add(report + _HEAD + t, tl.full((BLOCK,), 1, tl.int64), mask=head)
    n_keep = tl.load(out_offsets + FB)
    n_unique = tl.load(uid + M - 1, mask=M > 0, other=0)
    tl.store(seg_start + at, n_keep.to(tl.int32), mask=(at >= n_unique) & (at <= M))  # (grid: M + 1 positions)
    tl.store(counts, n_keep.to(tl.int32), mask=p == 0)
    tl.store(counts + 1, n_unique, mask=p == 0)


def _cases():
    common = {"pid0": "i32", "offsets": "*i64", "values": "*i64", "weights": "*fp32", "src": "*i64",
              "feat_table": "*i64", "num_rows": "*i64", "prune_neg": "*i8", "oor": "*i8", "has_default": "*i8",
              "default_id": "*i64", "combiner": "*i8"}
    clean = {**common, "lengths": "*i64", "out_offsets": "*i64", "report": "*i64", "B": "i32", "FB": "i32",
             "n_in": "i32", "N": "i64", "NBB": "i32", "HAS_W": "constexpr", "BLOCK_B": "constexpr", "BLOCK": "constexpr"}
    out = [(f"prepare.clean_bags[w={int(w)}]", _clean_bags, clean, {"HAS_W": w, "BLOCK_B": BAG_BLOCK, "BLOCK": 256})
           for w in (False, True)]
    for w, linear, key in ((False, True, "i32"), (True, True, "i64"), (True, False, "i64")):
        sig = {**common, "table_base": "*i64", "out_offsets": "*i64", "ids_out": "*i64", "w_out": "*fp32",
               "tab_out": "*i32", "key_out": f"*{key}", "report": "*i64", "B": "i32", "F": "i32", "FB": "i32",
               "N": "i64", "M": "i32", "T": "i32", "sentinel": "i64", "NBB": "i32", "HAS_W": "constexpr",
               "LINEAR": "constexpr", "BLOCK_B": "constexpr", "BLOCK": "constexpr"}
        out.append((f"prepare.scatter_bags[w={int(w)},linear={int(linear)},{key}]", _scatter_bags, sig,
                    {"HAS_W": w, "LINEAR": linear, "BLOCK_B": BAG_BLOCK, "BLOCK": 256}))
    for dedup, two in ((False, False), (True, False), (True, True)):
        out.append((f"prepare.run_heads[dedup={int(dedup)},two_sorts={int(two)}]", _run_heads,
                    {"pid0": "i32", "perm": "*i64", "by_id": "*i64", "by_table": "*i64", "ids": "*i64",
                     "tabs": "*i32", "heads": "*i32", "M": "i32", "T": "i32", "DEDUP": "constexpr",
                     "TWO_SORTS": "constexpr", "BLOCK": "constexpr"}, {"DEDUP": dedup, "TWO_SORTS": two, "BLOCK": 256}))
    out.append(("prepare.encode_runs", _encode_runs,
                {"pid0": "i32", "perm": "*i64", "ids": "*i64", "tabs": "*i32", "heads": "*i32", "uid": "*i32",
                 "out_offsets": "*i64", "unique_keys": "*i64", "unique_tables": "*i32", "inverse": "*i64",
                 "unique_counts": "*i64", "seg_start": "*i32", "counts": "*i32", "report": "*i64", "M": "i32",
                 "FB": "i32", "T": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256}))
    return out


COMPILE_CASES = _cases()
