"""The fused pooled forward: every pooled feature of a dim group over one rows tensor, in one launch.

A program pools ``BLOCK_B`` bags (bag ``q = k * B + b``: the launch's feature k, sample b): it walks
the bags' ids side by side, loads each id's row as a vector of D (fp32, fp16 or bf16 rows), clips it
to its table's max_norm, scales it by the id's weight and sums it in fp32 registers, then divides
by the combiner's denominator (sum: 1, mean: sum of weights, sqrtn: sqrt of the sum of squared
weights; an empty bag gives zeros).  Each bag's row and output are its own: no atomics, and the
sums run in bag order, so the result does not depend on how programs are scheduled.

Two ways to find an id's row (``DIRECT``):

* prepared (``DIRECT=0``): a batch after clean + dedup (functional/_reference.py::prepare_torch):
  cleaned bags ``offsets [F*B+1]``, each kept id's unique index ``inverse`` and weight, and
  ``slots`` per unique index (-1: the row reads zeros, its weight still counts);
* direct (``DIRECT=1``, static tables, forward only: each row read once, nothing else materialized):
  the raw batch, with TF's cleaning inline: ids < 0 dropped (``prune_negative``), weights <= 0
  dropped, an id outside its table pruned, mapped to ``default_id`` or flagged (``out_of_range``),
  an empty bag given its feature's ``default_id`` row (weight 1) or zeros.  The row of id k is
  row k of its table.  Bad input (offsets, a weight not finite, an id out of range under "error")
  sets the call's one ``status`` flag (as do offsets that do not run from 0 to the ids' count); the
  caller then takes the path that raises the error with its details.

Rows are addressed as ``rows + base[k] + slot * stride[k]`` (in elements): a group's rows tensor holds
its tables one after another (``base`` = a table's first row times the row stride), and a row may be
wider than D (optimizer state beside it): only its first D columns are read.
"""

from __future__ import annotations

import random

import triton
import triton.language as tl

__all__ = ["pooled_kernel", "COMPILE_CASES", "block_bags", "launch"]


@triton.jit
def _clipped(row, max_norm, CLIP: tl.constexpr):
    """TF's clip_by_norm per row of a [BLOCK_B, BLOCK_D] tile: ``row * c / max(||row||, c)`` where c > 0."""
    if CLIP:
        norm = tl.sqrt(tl.sum(row * row, axis=1))
        c = max_norm
        clip = c > 0
        denom = tl.where(clip, tl.maximum(norm, c), 1.0)
        row = tl.where(clip[:, None], (row * tl.where(clip, c, 1.0)[:, None]) / denom[:, None], row)
    return row


@triton.jit
def pooled_kernel(rows_ptr, out_ptr, launch_ptr, feat_table_ptr, combiner_ptr, max_norm_ptr,
                  offsets_ptr, ids_ptr, weights_ptr, slots_ptr,
                  source_ptr, prune_neg_ptr, oor_ptr, has_default_ptr, default_id_ptr, num_rows_ptr, status_ptr,
                  B, D, out_stride, n_ids, n_offsets, n_bags, pid0,
                  DIRECT: tl.constexpr, HAS_WEIGHTS: tl.constexpr, CLIP: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = pid0 + tl.program_id(0)
    q = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    lane = q < n_bags
    k = tl.where(lane, q // B, 0)
    b = q - k * B
    # the launch's features, 4 int64 each: plan feature, output column, element base of its rows, row stride
    f = tl.load(launch_ptr + k * 4, mask=lane, other=0)
    col = tl.load(launch_ptr + k * 4 + 1, mask=lane, other=0)
    base = tl.load(launch_ptr + k * 4 + 2, mask=lane, other=0)
    stride = tl.load(launch_ptr + k * 4 + 3, mask=lane, other=0)
    t = tl.load(feat_table_ptr + f, mask=lane, other=0)
    combiner = tl.load(combiner_ptr + f, mask=lane, other=0).to(tl.int32)
    max_norm = tl.load(max_norm_ptr + t, mask=lane, other=0.0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D

    if DIRECT:
        bag = tl.load(source_ptr + f, mask=lane, other=0) * B + b
        start = tl.load(offsets_ptr + bag, mask=lane, other=0)
        end = tl.load(offsets_ptr + bag + 1, mask=lane, other=0)
        bad = lane & ((start < 0) | (end < start) | (end > n_ids))
        prune_neg = tl.load(prune_neg_ptr + f, mask=lane, other=0) != 0
        policy = tl.load(oor_ptr + f, mask=lane, other=0).to(tl.int32)
        default_id = tl.load(default_id_ptr + f, mask=lane, other=0)
        num_rows = tl.load(num_rows_ptr + t, mask=lane, other=0)
    else:
        bag = f * B + b
        start = tl.load(offsets_ptr + bag, mask=lane, other=0)
        end = tl.load(offsets_ptr + bag + 1, mask=lane, other=0)
        bad = lane & (end < start)  # (never made by prepare: read as an empty bag)
    length = tl.where(lane & ~bad, end - start, 0)

    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    wsum = tl.zeros([BLOCK_B], dtype=tl.float32)
    w2sum = tl.zeros([BLOCK_B], dtype=tl.float32)
    kept = tl.zeros([BLOCK_B], dtype=tl.int32)
    # a while loop: the interpreter's range() cannot take a bound reduced from a tensor under numpy 2
    longest = tl.max(length, axis=0)
    j = 0
    while j < longest:
        m = j < length
        pos = start + j
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + pos, mask=m, other=0.0).to(tl.float32)
        else:
            w = tl.where(m, 1.0, 0.0)
        if DIRECT:
            v = tl.load(ids_ptr + pos, mask=m, other=0)
            finite = tl.abs(w) <= 3.4028234663852886e38  # (not NaN, not inf)
            bad = bad | (m & ~finite)
            keep = m & finite & (w > 0) & ~((v < 0) & prune_neg)
            oob = keep & (num_rows >= 0) & ((v < 0) | (v >= num_rows))
            bad = bad | (oob & (policy == 0))
            keep = keep & ~(oob & (policy != 2))
            slot = tl.where(oob & (policy == 2), default_id, v)
            has_row = keep
        else:
            u = tl.load(ids_ptr + pos, mask=m, other=0).to(tl.int64)
            slot = tl.load(slots_ptr + u, mask=m, other=-1)
            keep = m
            has_row = m & (slot >= 0)
        w = tl.where(keep, w, 0.0)
        at = base[:, None] + tl.where(has_row, slot, 0)[:, None] * stride[:, None] + d[None, :]
        row = tl.load(rows_ptr + at, mask=has_row[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        row = _clipped(row, max_norm, CLIP)
        acc += row * w[:, None]
        wsum += w
        w2sum += w * w
        kept += keep.to(tl.int32)
        j += 1

    if DIRECT:
        # an empty bag reads its feature's default_id row, weight 1 (TF's "fill empty rows")
        fill = lane & ~bad & (kept == 0) & (tl.load(has_default_ptr + f, mask=lane, other=0) != 0)
        at = base[:, None] + tl.where(fill, default_id, 0)[:, None] * stride[:, None] + d[None, :]
        row = tl.load(rows_ptr + at, mask=fill[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        row = _clipped(row, max_norm, CLIP)
        acc = tl.where(fill[:, None], row, acc)
        wsum = tl.where(fill, 1.0, wsum)
        w2sum = tl.where(fill, 1.0, w2sum)
        # the call's one flag (int32): a bad bag anywhere, or offsets not from 0 to n_ids (program 0 looks)
        flag = tl.max(bad.to(tl.int32), axis=0)
        if pid == 0:
            first = tl.load(offsets_ptr)
            last = tl.load(offsets_ptr + n_offsets - 1)
            flag = tl.maximum(flag, ((first != 0) | (last != n_ids)).to(tl.int32))
        tl.atomic_max(status_ptr, flag, mask=flag > 0)

    # LookupPlan.arrays()'s combiner codes: 0 sum, 1 mean, 2 sqrtn
    denom = tl.where(combiner == 1, wsum, tl.where(combiner == 2, tl.sqrt(w2sum), 1.0))
    denom = tl.where(wsum > 0, denom, 1.0)
    out = acc / denom[:, None]
    tl.store(out_ptr + b[:, None] * out_stride + col[:, None] * D + d[None, :], out,
             mask=lane[:, None] & dmask[None, :])


def _signature(rows: str, direct: bool, weights: bool) -> dict[str, str]:
    sig = {"rows_ptr": f"*{rows}", "out_ptr": "*fp32", "launch_ptr": "*i64", "feat_table_ptr": "*i64",
           "combiner_ptr": "*i8", "max_norm_ptr": "*fp32", "offsets_ptr": "*i64", "ids_ptr": "*i64",
           "weights_ptr": "*fp32" if weights else "*i64", "slots_ptr": "*i64", "source_ptr": "*i64",
           "prune_neg_ptr": "*i8", "oor_ptr": "*i8", "has_default_ptr": "*i8", "default_id_ptr": "*i64",
           "num_rows_ptr": "*i64", "status_ptr": "*i32", "B": "i64", "D": "i32", "out_stride": "i64",
           "n_ids": "i64", "n_offsets": "i64", "n_bags": "i64", "pid0": "i32"}
    for name in ("DIRECT", "HAS_WEIGHTS", "CLIP", "BLOCK_B", "BLOCK_D"):
        sig[name] = "constexpr"
    return sig


def block_bags(dim: int) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_D) for rows of `dim`: the whole row in one tile (max_norm needs its norm), up to 2048
    values a program; at least 2 columns (triton 3.6 fails to compile a one-column tile of 16-bit rows with
    max_norm for sm_90)."""
    block_d = max(2, triton.next_power_of_2(dim))
    return max(1, min(64, 2048 // block_d)), block_d


# every variant the dispatcher (functional/_triton_stages.py) launches: rows dtype x prepared/direct x
# weights x max_norm, at the tile of a d16 table; and the smallest tile (a d1 or d2 table), whose shape
# the GPU compiler treats apart (a [64, 1] tile of 16-bit rows with max_norm failed to compile on sm_90)
COMPILE_CASES = [
    (f"pooled[{dt},{'direct' if direct else 'prepared'}{',w' if w else ''}{',clip' if clip else ''}"
     f"{',d' + str(dim) if dim != 16 else ''}]",
     pooled_kernel, _signature(dt, direct, w),
     {"DIRECT": direct, "HAS_WEIGHTS": w, "CLIP": clip, "BLOCK_B": block_bags(dim)[0], "BLOCK_D": block_bags(dim)[1]})
    for dt in ("fp32", "fp16", "bf16") for direct in (False, True) for w in (False, True) for clip in (False, True)
    for dim in (16, 1)
]


def launch(n_bags: int, args: dict, constexprs: dict, shuffle: int | None = None) -> None:
    """Runs pooled_kernel over `n_bags` bags: one launch of ``cdiv(n_bags, BLOCK_B)`` programs, or with
    `shuffle` (tests) one launch of one program per program id, in an order drawn from that seed."""
    programs = triton.cdiv(n_bags, constexprs["BLOCK_B"])
    if programs == 0:
        return
    if shuffle is None:
        pooled_kernel[(programs,)](**args, n_bags=n_bags, pid0=0, **constexprs)
        return
    for pid in random.Random(shuffle).sample(range(programs), programs):
        pooled_kernel[(1,)](**args, n_bags=n_bags, pid0=pid, **constexprs)
