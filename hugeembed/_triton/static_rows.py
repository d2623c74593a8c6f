"""The static tables' training fetch on the GPU (store/_static.py's ``touch``): rows of (table, key) pairs, every key
checked first, then each row's hit count and last step, in two launches and the one read of the check, where its
torch reference (``StaticGroup._rows_torch``) is ~20 small ops.  Keys a prepare proved in range (the collection's
own batch: Prepared.id_bounds equal to the group's tables' rows) are not checked again: two launches, no read.

    _static_rows   a program per BLOCK pairs: row ``first[t] + k // shards[t]`` (-1 where t < 0) and (CHECK)
                   the first bad pair's position (key outside [0, num_rows), another shard's key, a count < 1)
                   by an atomic min: the error names the first, as the reference's
    _static_count  after the caller read that no pair is bad: each row's count += the pair's count (integer
                   atomics: exact in any order), its last step = step (every writer writes the same value)

``info`` is the group's int64 [T, 4] (first row, num_rows, shard, num_shards); ``meta`` its int64 [R, 2]
(hit count, last step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._grid import launch

__all__ = ["static_rows", "static_count", "COMPILE_CASES"]

BLOCK = 256
NONE = 2**62  # no bad pair


@triton.jit
def _static_rows(pid0, tids, keys, counts, info, out, first_bad, n, HAS_COUNTS: tl.constexpr, CHECK: tl.constexpr,
                 BLOCK: tl.constexpr):
    at = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = at < n
    t = tl.load(tids + at, mask=m, other=-1)
    k = tl.load(keys + at, mask=m, other=0)
    sel = m & (t >= 0)
    row_info = info + tl.where(sel, t, 0) * 4
    first = tl.load(row_info, mask=sel, other=0)
    nrows = tl.load(row_info + 1, mask=sel, other=1)
    shard = tl.load(row_info + 2, mask=sel, other=0)
    shards = tl.load(row_info + 3, mask=sel, other=1)
    if CHECK:
        bad = sel & ((k < 0) | (k >= nrows) | (k % shards != shard))
        if HAS_COUNTS:
            bad = bad | (sel & (tl.load(counts + at, mask=sel, other=1) < 1))
        tl.store(out + at, tl.where(sel, first + tl.where(bad, 0, k) // shards, -1), mask=m)
        first_at = tl.min(tl.where(bad, at, 2**62), axis=0)
        tl.atomic_min(first_bad, first_at, mask=first_at < 2**62)
    else:
        tl.store(out + at, tl.where(sel, first + k // shards, -1), mask=m)


@triton.jit
def _static_count(pid0, rows, counts, meta, step, n, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
    at = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r = tl.load(rows + at, mask=at < n, other=-1)
    ok = r >= 0
    if HAS_COUNTS:
        c = tl.load(counts + at, mask=ok, other=0)
    else:
        c = tl.where(ok, 1, 0).to(tl.int64)
    tl.atomic_add(meta + r * 2, c, mask=ok)
    tl.store(meta + r * 2 + 1, tl.zeros((BLOCK,), tl.int64) + step, mask=ok)


def static_rows(tids: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor | None, info: torch.Tensor,
                out: torch.Tensor, check: bool = True) -> int | None:
    """Rows of the pairs into `out` (int64, like `keys`); the position of the first bad pair, or None: the one
    read of the device (none when not `check`: keys a prepare proved in range, counts >= 1).  tids, keys, counts:
    int64 [n]; info: the group's int64 [T, 4] on their device."""
    n = keys.numel()
    first_bad = torch.full((1,), NONE, dtype=torch.int64, device=keys.device) if check else keys
    launch(_static_rows, triton.cdiv(n, BLOCK), tids, keys, counts if counts is not None else keys, info, out,
           first_bad, n, HAS_COUNTS=counts is not None, CHECK=check, BLOCK=BLOCK)
    if not check:
        return None
    at = int(first_bad.item())
    return None if at == NONE else at


def static_count(rows: torch.Tensor, counts: torch.Tensor | None, meta: torch.Tensor, step: int) -> None:
    """Each row's hit count grown by its pair's count (1 each without counts) and its last step set (rows -1:
    skipped), in `meta` (int64 [R, 2], contiguous)."""
    n = rows.numel()
    launch(_static_count, triton.cdiv(n, BLOCK), rows, counts if counts is not None else rows, meta, int(step), n,
           HAS_COUNTS=counts is not None, BLOCK=BLOCK)


def _cases():
    rows_sig = {"pid0": "i32", "tids": "*i64", "keys": "*i64", "counts": "*i64", "info": "*i64", "out": "*i64",
                "first_bad": "*i64", "n": "i32", "HAS_COUNTS": "constexpr", "CHECK": "constexpr", "BLOCK": "constexpr"}
    count_sig = {"pid0": "i32", "rows": "*i64", "counts": "*i64", "meta": "*i64", "step": "i64", "n": "i32",
                 "HAS_COUNTS": "constexpr", "BLOCK": "constexpr"}
    return ([(f"static_rows.rows[counts={int(c)},check={int(k)}]", _static_rows, rows_sig,
              {"HAS_COUNTS": c, "CHECK": k, "BLOCK": BLOCK}) for c in (False, True) for k in (False, True)]
            + [(f"static_rows.count[counts={int(c)}]", _static_count, count_sig, {"HAS_COUNTS": c, "BLOCK": BLOCK})
               for c in (False, True)])


COMPILE_CASES = _cases()
