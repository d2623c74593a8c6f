"""Segment reduce + fused optimizer: each unique row's gradient summed from the pooled outputs'
gradients and the rule applied to the row and its state in place: four launches (the rows' chunk
counts, their prefix sum, the chunk sums, the update), no host read.

After :func:`hugeembed._triton.dedup.dedup`, unique row u's entries are ``order[seg_start[u] :
seg_start[u + 1]]`` (kept ids, batch order).  Entry j of bag ``f * B + b`` adds
``grad[b * Fg + slot[f]] * w_j / denom[f * B + b]`` (its pooled output's gradient, per-id weight and
combiner divisor), the sum backward_torch makes.  A row's entries are cut in chunks of `chunk`:

    _chunk_sums: one program per chunk after a row's first: its partial sum  -> partial[e]
    _update_rows: one program per unique row: its first chunk's sum, plus its partials in chunk
                  order (deterministic: no float atomics), then the rule

so a Zipf-hot row's thousands of entries are summed by many programs, and a row with at most
`chunk` entries (nearly all) never leaves registers.  Both grids are sized from shapes (N entries,
R rows: at most min(N, R) unique rows): programs past the device-side counts do nothing.  ``bag_terms`` (a program per BAG_BLOCK bags) makes
each bag's divisor and each entry's bag.

Rules (optim/_kernel_params.kernel_params gives their parameters): SGD, momentum / Nesterov,
Adagrad, row-wise Adagrad, Adam lazy / per-row / global (the skipped steps' catch-up in the kernel),
FTRL; float32 / float16 / bfloat16 weights, state in float32 (or the weights' dtype), weights
rounded to nearest or stochastically (optim/_rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import InputError
from ._grid import launch
from ._update_rows import _sum_entries, _update_rows
from .dedup import Dedup

__all__ = ["PooledGrads", "bag_terms", "segment_update", "segment_sum", "COMPILE_CASES"]

_SUM, _MEAN, _SQRTN = 0, 1, 2
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PooledGrads:
    """The gradient of one dim group's pooled outputs and how each kept entry reads it.

    grad: float32 [B * Fg, D] (the group's output [B, Fg, D] gradient, rows b * Fg + k).
    slot: int32 [F] each plan feature's k in the group (features of other groups: unused).
    bag_of: int32 [N] each kept entry's bag (f * B + b); denom: float32 [F * B] each bag's divisor.
    weights: float32 [N] the kept entries' weights, or None (all 1).
    """

    grad: torch.Tensor
    slot: torch.Tensor
    bag_of: torch.Tensor
    denom: torch.Tensor
    weights: torch.Tensor | None
    batch_size: int
    width: int


@triton.jit
def _bag_terms(pid0, offsets, weights, combiner, bag_of, denom, B, n_bags, inverse, slots, keys, feat_table,
               entry_table, entry_slot, entry_key, HAS_W: tl.constexpr, ENTRIES: tl.constexpr,
               BLOCK_B: tl.constexpr):
    """Bags [p * BLOCK_B, (p + 1) * BLOCK_B) (bag f*B+b: a lane each): their entries' bag, and their divisor
    (sum: 1, mean: sum w, sqrtn: sqrt(sum w^2); 1 when empty), summed in entry order as backward_torch's
    index_add.  ENTRIES: also each entry's table, slot and key (``feat_table[f]``, ``slots[inverse[i]]``,
    ``keys[inverse[i]]``)."""
    bag = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    lane = bag < n_bags
    lo = tl.load(offsets + bag, mask=lane, other=0)
    hi = tl.load(offsets + bag + 1, mask=lane, other=0)
    ws = tl.zeros((BLOCK_B,), tl.float32)
    w2 = tl.zeros((BLOCK_B,), tl.float32)
    f = tl.where(lane, bag // B, 0)
    if ENTRIES:
        t = tl.load(feat_table + f)
    longest = tl.max(hi - lo, axis=0)
    j = 0
    while j < longest:  # (a while: the interpreter's range() cannot take a loaded bound under numpy 2)
        i = lo + j
        m = i < hi
        tl.store(bag_of + i, bag.to(tl.int32), mask=m)
        if ENTRIES:
            u = tl.load(inverse + i, mask=m, other=0)
            tl.store(entry_table + i, t, mask=m)
            tl.store(entry_slot + i, tl.load(slots + u, mask=m, other=0), mask=m)
            tl.store(entry_key + i, tl.load(keys + u, mask=m, other=0), mask=m)
        if HAS_W:
            w = tl.load(weights + i, mask=m, other=0.0)
        else:
            w = tl.where(m, 1.0, 0.0)
        ws += w
        w2 += w * w
        j += 1
    comb = tl.load(combiner + f)
    d = tl.where(comb == 1, ws, tl.where(comb == 2, tl.sqrt_rn(w2), 1.0))
    tl.store(denom + bag, tl.where(ws > 0, d, 1.0), mask=lane)


BAG_BLOCK = 128  # bags a _bag_terms program walks side by side (a lane each)
ROW_PROGRAMS = 8192  # the update's programs at most (a GPU runs about this many at once)


def _row_warps(block_d: int) -> int:
    """Warps of a program that works on one row of block_d values: one warp up to 256 of them (4 warps left
    three idle on a d16 row)."""
    return max(1, min(4, block_d // 256))


def bag_terms(offsets: torch.Tensor, weights: torch.Tensor | None, combiner: torch.Tensor, batch_size: int,
              n_entries: int, entries: tuple | None = None):
    """(bag_of int32 [N], denom float32 [F * B]) of a prepared batch: `offsets` int64 [F*B + 1] (its
    cleaned bags), `weights` its kept weights or None, `combiner` int8 [F] (plan.arrays' codes).

    `entries`: (inverse [N], slots [U], keys [U], feat_table int64 [F]): the same launch also gives
    each entry's (table, slot, key), int64 [N] each, appended to the result."""
    dev = offsets.device
    n_bags = offsets.numel() - 1
    bag_of = torch.empty(n_entries, dtype=torch.int32, device=dev)
    denom = torch.empty(n_bags, dtype=torch.float32, device=dev)
    if entries is not None:
        inverse, slots, keys, feat_table = entries
        outs = [torch.empty(n_entries, dtype=torch.int64, device=dev) for _ in range(3)]
    else:
        inverse = slots = keys = feat_table = bag_of
        outs = [bag_of] * 3
    launch(_bag_terms, triton.cdiv(n_bags, BAG_BLOCK), offsets, weights if weights is not None else denom, combiner,
           bag_of, denom, max(batch_size, 1), n_bags, inverse, slots, keys, feat_table, *outs,
           HAS_W=weights is not None, ENTRIES=entries is not None, BLOCK_B=BAG_BLOCK)
    return (bag_of, denom) if entries is None else (bag_of, denom, *outs)


@triton.jit
def _chunk_sums(pid0, order, seg_start, counts, cum_extra, partial, chunk, bag_of, slot, weights, denom,
                grad, grad_stride, B, Fg, D, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """Partial e (chunk c >= 1 of unique row s, e counted over the rows in order): its sum."""
    e = pid0 + tl.program_id(0)
    n_unique = tl.load(counts + 1)
    total = tl.load(cum_extra + tl.maximum(n_unique - 1, 0), mask=n_unique > 0, other=0)
    # s: the first row whose cumulative extra chunks pass e (a bisection over the rows)
    lo = tl.zeros((), tl.int32)
    hi = tl.where(e < total, n_unique, 0)
    while lo < hi:
        mid = (lo + hi) // 2
        past = tl.load(cum_extra + mid) > e
        hi = tl.where(past, mid, hi)
        lo = tl.where(past, lo, mid + 1)
    live = e < total
    s = tl.minimum(lo, tl.maximum(n_unique - 1, 0))
    before = tl.load(cum_extra + s - 1, mask=s > 0, other=0)
    start = tl.load(seg_start + s) + (e - before + 1) * chunk
    end = tl.minimum(tl.load(seg_start + s + 1), start + chunk)
    end = tl.where(live, end, start)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    acc = _sum_entries(tl.zeros((BLOCK_D,), tl.float32), start, end, order, bag_of, slot, weights, denom, grad,
                       grad_stride, B, Fg, d, dmask, HAS_W)
    tl.store(partial + e.to(tl.int64) * D + d, acc, mask=dmask & live)


@triton.jit
def _extra_chunks(pid0, seg_start, extra, chunk, n, BLOCK: tl.constexpr):
    """extra[s]: the chunks of unique row s after its first (0 past n_unique: seg_start's tail is flat)."""
    at = (pid0 + tl.program_id(0)) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    lens = tl.load(seg_start + at + 1, mask=inside, other=0) - tl.load(seg_start + at, mask=inside, other=0)
    tl.store(extra + at, tl.maximum((lens + chunk - 1) // chunk - 1, 0), mask=inside)


def segment_update(dd: Dedup, src: PooledGrads, weights: torch.Tensor, state: torch.Tensor, rule_params, *,
                   step: int, chunk: int = 64, keys: torch.Tensor | None = None,
                   table_seed: torch.Tensor | None = None, rounding_mix: int = 0,
                   unit_tables: torch.Tensor | None = None) -> None:
    """Sums each unique row's gradient and applies one rule step to the row and its state, in place.

    Args:
        dd: the group's entries deduplicated (rows: the rows of `weights` / `state`).
        src: the pooled outputs' gradient and how the entries read it.
        weights: [R, D] typed view of the rows' weights (float32/16/bf16; any row stride).
        state: [R, S] typed view of their state (float32, or the weights' dtype; S = 0: any tensor).
        rule_params: (p, q, flags) of optim._kernel_params.kernel_params for this step.
        step: the table's 1-based step (global Adam's catch-up; per-row and global counters).
        chunk: entries a program sums (hot rows are split across programs in chunks of it).
        keys, table_seed: stochastic rounding: int64 [N] each entry's key (a row draws by its key) and
            int64 [T] each table's seed (dd.tables index it); None: rounded to nearest.
        rounding_mix: ``mix64_int(step ^ salt)`` of hugeembed._hashing (stochastic rounding).
        unit_tables: int64, each table of `dd.tables` -> the unit's index of it, or -1: its rows are
            another unit's, left alone (runs of a whole batch, from the triton prepare); None: every
            row is the unit's, `dd.tables` its index.
    """
    p, q, flags = rule_params
    D = weights.shape[1]
    if weights.dtype not in _WEIGHT_DTYPES or src.grad.dtype != torch.float32:
        raise InputError(f"segment_update: weights must be float32/float16/bfloat16 and the gradient float32, "
                         f"got {weights.dtype} and {src.grad.dtype}")
    if weights.stride(1) != 1 or (state.numel() and state.stride(1) != 1) or src.grad.stride(1) != 1:
        raise InputError("segment_update: weights, state and gradient rows must be contiguous along D")
    if chunk < 1 or src.grad.shape[1] != D:
        raise InputError(f"segment_update: chunk must be >= 1 and the gradient [*, {D}], got {chunk} and "
                         f"{tuple(src.grad.shape)}")
    if not 1 <= step < 2**31:
        raise InputError(f"segment_update: step must be in [1, 2^31), got {step}")
    stochastic = table_seed is not None
    if stochastic and (weights.dtype == torch.float32 or keys is None):
        raise InputError("segment_update: stochastic rounding needs 16-bit weights and the entries' keys")
    n = dd.capacity
    if n == 0:
        return
    cum_extra, partial, (w_arg, B, Fg, has_w, block_d) = _partial_sums(dd, src, chunk)
    st = state if state.numel() else weights
    keys = keys if stochastic else dd.counts  # (unread without stochastic rounding)
    seeds = table_seed if stochastic else dd.counts
    # at most one unique row per row of `weights` when the runs are the unit's own (a batch's: any number);
    # past ROW_PROGRAMS, a program walks rows n_programs apart
    programs = min(n if unit_tables is not None else min(n, weights.shape[0]), ROW_PROGRAMS)
    launch(_update_rows, programs, programs, dd.order, dd.seg_start, dd.counts, dd.rows, dd.tables,
           unit_tables if unit_tables is not None else dd.tables, cum_extra, partial, chunk,
           src.bag_of, src.slot, w_arg, src.denom, src.grad, src.grad.stride(0), B, Fg,
           weights, weights.stride(0), st, st.stride(0), D, keys, seeds, rounding_mix, step, *p, *q,
           STOCHASTIC=stochastic, HAS_W=has_w, UNIT_MAP=unit_tables is not None, BLOCK_D=block_d,
           num_warps=_row_warps(block_d), **flags)


def _partial_sums(dd: Dedup, src: PooledGrads, chunk: int):
    """(cum_extra, partial, the source's kernel arguments): the chunks after each unique row's first, summed
    (hot rows split across programs); the row kernels add them to their first chunk, in order."""
    n, D, dev = dd.capacity, src.grad.shape[1], src.grad.device
    extra = torch.empty(n, dtype=torch.int32, device=dev)
    launch(_extra_chunks, triton.cdiv(n, 256), dd.seg_start, extra, chunk, n, BLOCK=256)
    cum_extra = torch.cumsum(extra, 0, dtype=torch.int32)
    n_partial = triton.cdiv(n, chunk)  # at most this many extra chunks in all
    partial = torch.empty(n_partial, D, dtype=torch.float32, device=dev)
    block_d = triton.next_power_of_2(D)
    has_w = src.weights is not None
    w_arg = src.weights if has_w else src.denom
    B, Fg = max(src.batch_size, 1), max(src.width, 1)
    launch(_chunk_sums, n_partial, dd.order, dd.seg_start, dd.counts, cum_extra, partial, chunk, src.bag_of,
           src.slot, w_arg, src.denom, src.grad, src.grad.stride(0), B, Fg, D, HAS_W=has_w, BLOCK_D=block_d,
           num_warps=_row_warps(block_d))
    return cum_extra, partial, (w_arg, B, Fg, has_w, block_d)


@triton.jit
def _sum_rows(pid0, n_programs, order, seg_start, counts, tables, table_in, cum_extra, partial, chunk, bag_of, slot,
              weights, denom, grad, grad_stride, B, Fg, out, out_stride, D, HAS_W: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """Unique rows s = p, p + n_programs, ... below the device's count whose table is in (``table_in[t] != 0``):
    the row's gradient (its first chunk, then its partials in order) into ``out[s]``; other rows untouched."""
    s = pid0 + tl.program_id(0)
    n_unique = tl.load(counts + 1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    while s < n_unique:
        if tl.load(table_in + tl.load(tables + s)) != 0:
            start = tl.load(seg_start + s)
            end = tl.load(seg_start + s + 1)
            g = _sum_entries(tl.zeros((BLOCK_D,), tl.float32), start, tl.minimum(end, start + chunk), order, bag_of,
                             slot, weights, denom, grad, grad_stride, B, Fg, d, dmask, HAS_W)
            e = tl.load(cum_extra + s - 1, mask=s > 0, other=0)
            e_hi = tl.load(cum_extra + s)
            while e < e_hi:
                g += tl.load(partial + e.to(tl.int64) * D + d, mask=dmask, other=0.0)
                e += 1
            tl.store(out + s.to(tl.int64) * out_stride + d, g, mask=dmask)
        s += n_programs


def segment_sum(dd: Dedup, src: PooledGrads, out: torch.Tensor, table_in: torch.Tensor, chunk: int = 64) -> None:
    """Each unique row's summed gradient (the sum backward_torch's index_add makes: its entries in batch order,
    each ``grad[bag's output] * w / denom``) into ``out[u]`` (float32 [>= n_unique, D], contiguous along D),
    for the rows whose table t has ``table_in[t] != 0`` (int64: the tables of this gradient's dim); no [N, D]
    product made, no float atomics, no host read."""
    D = out.shape[1]
    if out.dtype != torch.float32 or src.grad.dtype != torch.float32 or src.grad.shape[1] != D or out.stride(1) != 1:
        raise InputError(f"segment_sum: float32 rows [*, {src.grad.shape[1]}] contiguous along D, got "
                         f"{out.dtype} {tuple(out.shape)}")
    n = dd.capacity
    if n == 0:
        return
    cum_extra, partial, (w_arg, B, Fg, has_w, block_d) = _partial_sums(dd, src, chunk)
    programs = min(n, ROW_PROGRAMS)
    launch(_sum_rows, programs, programs, dd.order, dd.seg_start, dd.counts, dd.tables, table_in, cum_extra, partial,
           chunk, src.bag_of, src.slot, w_arg, src.denom, src.grad, src.grad.stride(0), B, Fg, out, out.stride(0), D,
           HAS_W=has_w, BLOCK_D=block_d, num_warps=_row_warps(block_d))


def _cases():
    bag = {"pid0": "i32", "offsets": "*i64", "weights": "*fp32", "combiner": "*i8", "bag_of": "*i32",
           "denom": "*fp32", "B": "i32", "n_bags": "i32", "inverse": "*i64", "slots": "*i64", "keys": "*i64", "feat_table": "*i64",
           "entry_table": "*i64", "entry_slot": "*i64", "entry_key": "*i64", "HAS_W": "constexpr",
           "ENTRIES": "constexpr", "BLOCK_B": "constexpr"}
    src = {"bag_of": "*i32", "slot": "*i32", "weights": "*fp32", "denom": "*fp32", "grad": "*fp32",
           "grad_stride": "i32", "B": "i32", "Fg": "i32"}
    chunks = {"pid0": "i32", "order": "*i64", "seg_start": "*i32", "counts": "*i32", "cum_extra": "*i32",
              "partial": "*fp32", "chunk": "i32", **src, "D": "i32", "HAS_W": "constexpr", "BLOCK_D": "constexpr"}
    out = [(f"segment_optim.bag_terms[w={int(w)},entries={int(e)}]", _bag_terms, bag,
            {"HAS_W": w, "ENTRIES": e, "BLOCK_B": BAG_BLOCK}) for w in (False, True) for e in (False, True)]
    out.append(("segment_optim.extra_chunks", _extra_chunks, {"pid0": "i32", "seg_start": "*i32", "extra": "*i32",
                "chunk": "i32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256}))
    out.append(("segment_optim.chunk_sums[d64]", _chunk_sums, chunks, {"HAS_W": True, "BLOCK_D": 64},
                {"num_warps": _row_warps(64)}))
    sums = {"pid0": "i32", "n_programs": "i32", "order": "*i64", "seg_start": "*i32", "counts": "*i32",
            "tables": "*i32", "table_in": "*i64", "cum_extra": "*i32", "partial": "*fp32", "chunk": "i32", **src,
            "out": "*fp32", "out_stride": "i32", "D": "i32", "HAS_W": "constexpr", "BLOCK_D": "constexpr"}
    out += [(f"segment_optim.sum_rows[w={int(w)}]", _sum_rows, sums, {"HAS_W": w, "BLOCK_D": 64},
             {"num_warps": _row_warps(64)}) for w in (False, True)]
    flags = ("RULE", "WD", "NESTEROV", "ADAM_MODE", "DECOUPLED", "EPS_TF", "FTRL_SQRT", "STOCHASTIC", "HAS_W",
             "UNIT_MAP", "BLOCK_D")

    def rows_sig(wdt):
        return {"pid0": "i32", "n_programs": "i32", "order": "*i64", "seg_start": "*i32", "counts": "*i32", "rows": "*i32",
                "tables": "*i32", "unit_tables": "*i64", "cum_extra": "*i32", "partial": "*fp32", "chunk": "i32", **src,
                "wts": f"*{wdt}", "w_stride": "i32", "st": "*fp32", "s_stride": "i32", "D": "i32",
                "entry_keys": "*i64", "table_seed": "*i64", "mixed": "i64", "step": "i32",
                **{f"p{i}": "fp32" for i in range(13)}, **{f"q{i}": "i64" for i in range(4)},
                **{f: "constexpr" for f in flags}}

    # (name, weight dtype, flags): every rule and mode, 16-bit weights rounded both ways
    variants = [
        ("sgd", "fp32", dict(RULE=0, WD=True)), ("sgd_bf16_sr", "bf16", dict(RULE=0, STOCHASTIC=True)),
        ("momentum", "fp32", dict(RULE=1)), ("nesterov_wd", "fp32", dict(RULE=1, NESTEROV=True, WD=True)),
        ("adagrad", "fp32", dict(RULE=2, WD=True)), ("rowwise_adagrad", "fp32", dict(RULE=3, WD=True)),
        ("adam_lazy", "fp32", dict(RULE=4)), ("adam_lazy_tf_l2", "fp32", dict(RULE=4, EPS_TF=True, WD=True)),
        ("adam_per_row", "fp32", dict(RULE=4, ADAM_MODE=1)),
        ("adam_per_row_tf", "fp32", dict(RULE=4, ADAM_MODE=1, EPS_TF=True)),
        ("adam_global", "fp32", dict(RULE=4, ADAM_MODE=2)), ("adagrad_unit_map", "fp32", dict(RULE=2, UNIT_MAP=True)),
        ("adam_global_adamw_tf", "fp32", dict(RULE=4, ADAM_MODE=2, WD=True, DECOUPLED=True, EPS_TF=True)),
        ("adam_global_fp16_sr", "fp16", dict(RULE=4, ADAM_MODE=2, STOCHASTIC=True)),
        ("adam_lazy_bf16", "bf16", dict(RULE=4)),
        ("ftrl", "fp32", dict(RULE=5)), ("ftrl_power_shrink", "fp32", dict(RULE=5, FTRL_SQRT=False, WD=True)),
    ]
    for name, wdt, f in variants:
        consts = {"RULE": 0, "WD": False, "NESTEROV": False, "ADAM_MODE": 0, "DECOUPLED": False, "EPS_TF": False,
                  "FTRL_SQRT": True, "STOCHASTIC": False, "HAS_W": True, "UNIT_MAP": False, "BLOCK_D": 64, **f}
        out.append((f"segment_optim.update_rows[{name}]", _update_rows, rows_sig(wdt), consts,
                    {"num_warps": _row_warps(64)}))
    return out


COMPILE_CASES = _cases()
