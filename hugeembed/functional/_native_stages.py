"""The clean/dedup, pool and backward stages on the native CPU kernels (csrc/lookup.cpp).

Each function checks every tensor it hands to a kernel (dtype, device, length) so
a kernel never reads past a buffer.  The torch twin of each stage is in
_reference.py; both produce the same ``Prepared`` structure.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from .. import _native as nat
from ..errors import InputError
from ._plan import DimGroup, LookupPlan, Prepared

__all__ = ["NativeScratch", "prepare_native", "pool_native", "unpooled_native", "backward_native", "can_use_native",
           "can_use_native_storages", "unpooled_rows"]

I64, I32, F32, PTR = nat.I64, nat.I32, nat.F32, nat.PTR


def can_use_native(sf, storages: Sequence[torch.Tensor]) -> bool:
    """Whether this batch and these tables can take the native path (CPU float32 rows)."""
    if not nat.available() or sf.device.type != "cpu":
        return False
    w = sf.weights_or_none()
    if w is not None and w.dtype != torch.float32:
        return False
    return can_use_native_storages(storages)


def can_use_native_storages(storages: Sequence[torch.Tensor]) -> bool:
    """CPU float32 2-D row storages with unit column stride."""
    return all(isinstance(s, torch.Tensor) and s.device.type == "cpu" and s.dtype == torch.float32 and s.dim() == 2 and
               (s.stride(1) == 1 or s.size(1) <= 1) for s in storages)


class NativeScratch:
    """Owns the native dedup scratch (hash tables reused across batches) of one lookup."""

    def __init__(self) -> None:
        new = nat.fn("he_lookup_ctx_new", restype=PTR)
        free = nat.fn("he_lookup_ctx_free", PTR, restype=None)
        self.handle = new()
        self._finalizer = weakref.finalize(self, free, self.handle)


def _addresses(storages: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    addr = torch.tensor([s.data_ptr() for s in storages], dtype=torch.int64)
    stride = torch.tensor([s.stride(0) for s in storages], dtype=torch.int64)
    return addr, stride


def batch_arrays(sf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ids, int64 offsets, float32 weights or None) of a batch, as the kernels read them."""
    values = nat.check(sf.values(), torch.int64, "ids")
    offsets = sf.offsets()
    if offsets.dtype != torch.int64 or not offsets.is_contiguous():
        offsets = offsets.to(torch.int64).contiguous()
    weights = sf.weights_or_none()
    if weights is not None:
        weights = nat.check(weights.contiguous(), torch.float32, "weights")
    return values, offsets, weights


def _pool_target(storages, group: DimGroup, B: int):
    """(out [B, F_g, D], table addresses, row strides, plan features, output columns) of a pooling kernel."""
    n, D = len(group.pooled), group.dim
    addr, stride = _addresses(storages)
    return (torch.empty(B, n, D, dtype=torch.float32), addr, stride, torch.tensor(group.pooled, dtype=torch.int64),
            torch.arange(n, dtype=torch.int64) * D)


def prepare_native(plan: LookupPlan, sf, scratch: NativeScratch, deduplicate: bool = True) -> Prepared:
    a = plan.arrays("cpu")
    values, offsets, weights = batch_arrays(sf)
    B, F, T = sf.batch_size, plan.num_features, plan.num_tables
    src = plan.source_indices(sf.keys())
    # Only uninitialised allocations between the kernels: a torch op on a batch-sized
    # tensor would wake torch's OpenMP workers, which then spin on the cores our
    # threads need.
    out_offsets = torch.empty(F * B + 1, dtype=torch.int64)
    unique_base = torch.empty(T, dtype=torch.int64)
    totals = torch.empty(2, dtype=torch.int64)
    err = torch.zeros(4, dtype=torch.int64)
    count = nat.fn("he_lookup_count", PTR, I64, PTR, PTR, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64,
                   PTR, PTR, PTR, PTR, PTR, I32)
    code = count(nat.ptr(values), values.numel(), nat.ptr(offsets), nat.ptr(weights), B, F, nat.ptr(src),
                 nat.ptr(a["table"]), nat.ptr(a["num_rows"]), nat.ptr(a["prune_neg"]), nat.ptr(a["oor"]),
                 nat.ptr(a["has_default"]), nat.ptr(a["default_id"]), nat.ptr(a["combiner"]), nat.ptr(out_offsets), T,
                 nat.ptr(a["table_feat_ptr"]), nat.ptr(a["table_feats"]), nat.ptr(unique_base), nat.ptr(totals),
                 nat.ptr(err), nat.nthreads())
    if code:
        raise InputError(plan.describe_id_error(int(err[0]), int(err[1]), int(err[2]), int(err[3]), sf))
    n_kept, capacity = totals.tolist()
    base = unique_base.tolist()
    inverse = torch.empty(n_kept, dtype=torch.int32)
    out_w = torch.empty(n_kept, dtype=torch.float32) if weights is not None else None
    unique_keys = torch.empty(capacity, dtype=torch.int64)
    unique_counts = torch.empty(capacity, dtype=torch.int32)
    unique_count = torch.zeros(T, dtype=torch.int64)
    dedup = nat.fn("he_lookup_dedup", PTR, PTR, PTR, PTR, I64, I64, I64, *([PTR] * 17), I64, I32)
    dedup(scratch.handle, nat.ptr(values), nat.ptr(offsets), nat.ptr(weights), B, F, T, nat.ptr(src),
          nat.ptr(a["table"]), nat.ptr(a["num_rows"]), nat.ptr(a["prune_neg"]), nat.ptr(a["oor"]),
          nat.ptr(a["has_default"]), nat.ptr(a["default_id"]), nat.ptr(a["combiner"]), nat.ptr(a["table_feat_ptr"]),
          nat.ptr(a["table_feats"]), nat.ptr(out_offsets), nat.ptr(unique_base), nat.ptr(inverse), nat.ptr(out_w),
          nat.ptr(unique_keys), nat.ptr(unique_counts), nat.ptr(unique_count), int(deduplicate), nat.nthreads())
    return Prepared(B, out_offsets, inverse, out_w, unique_keys, unique_counts, base, unique_count.tolist(),
                    capacity, native=True, deduplicated=deduplicate)


def pool_direct(plan: LookupPlan, sf, storages, group: DimGroup, arrays=None) -> torch.Tensor | None:
    """Pooled output [B, F_g, D] of a group of static tables in one pass over the batch
    (forward only: no dedup, no intermediate arrays), bit-identical to prepare + pool.
    None when a bag holds something to report (the caller runs the two-stage path,
    which raises with the details).  `arrays`: batch_arrays(sf), read once for all groups."""
    a = plan.arrays("cpu")
    values, offsets, weights = arrays if arrays is not None else batch_arrays(sf)
    B, D, n = sf.batch_size, group.dim, len(group.pooled)
    out, addr, stride, feats, cols = _pool_target(storages, group, B)
    if n == 0 or B == 0:
        return out
    src = plan.source_indices(sf.keys())
    fn = nat.fn("he_lookup_pool_direct", PTR, I64, PTR, PTR, I64, I64, *([PTR] * 8), I64, PTR, PTR, PTR, PTR, I64, PTR,
                I64, PTR, I32)
    bad = fn(nat.ptr(values), values.numel(), nat.ptr(offsets), nat.ptr(weights), B, plan.num_features, nat.ptr(src),
             nat.ptr(a["table"]), nat.ptr(a["num_rows"]), nat.ptr(a["prune_neg"]), nat.ptr(a["oor"]),
             nat.ptr(a["has_default"]), nat.ptr(a["default_id"]), nat.ptr(a["combiner"]), n, nat.ptr(feats),
             nat.ptr(addr), nat.ptr(stride), nat.ptr(a["max_norm"]), D, nat.ptr(out), n * D, nat.ptr(cols),
             nat.nthreads())
    return None if bad else out


def _check_slots(prep: Prepared, slots: torch.Tensor) -> torch.Tensor:
    return nat.check(slots, torch.int64, "slots", prep.capacity)


def pool_native(plan: LookupPlan, prep: Prepared, storages, slots, group: DimGroup) -> torch.Tensor:
    """Pooled output [B, F_g, D] of the group's pooled features."""
    a = plan.arrays("cpu")
    B, D, n = prep.batch_size, group.dim, len(group.pooled)
    out, addr, stride, feats, cols = _pool_target(storages, group, B)
    if n == 0 or B == 0:
        return out
    pool = nat.fn("he_lookup_pool", I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64, PTR, I64, PTR, I32,
                  restype=None)
    pool(B, n, nat.ptr(feats), nat.ptr(prep.offsets), nat.ptr(prep.inverse), nat.ptr(prep.weights),
         nat.ptr(_check_slots(prep, slots)), nat.ptr(a["table"]), nat.ptr(addr), nat.ptr(stride), nat.ptr(a["max_norm"]),
         nat.ptr(a["combiner"]), D, nat.ptr(out), n * D, nat.ptr(cols), nat.nthreads())
    return out


def unpooled_rows(prep: Prepared, group: DimGroup) -> list[int]:
    B = prep.batch_size
    offs = prep.offsets
    return [int(offs[(f + 1) * B]) - int(offs[f * B]) for f in group.unpooled]


def unpooled_native(plan: LookupPlan, prep: Prepared, storages, slots, group: DimGroup) -> torch.Tensor:
    """One row per kept id of the group's unpooled features, concatenated [sum n_f, D]."""
    a = plan.arrays("cpu")
    counts = unpooled_rows(prep, group)
    out = torch.empty(sum(counts), group.dim, dtype=torch.float32)
    if not counts or out.numel() == 0:
        return out
    addr, stride = _addresses(storages)
    feats = torch.tensor(group.unpooled, dtype=torch.int64)
    row0 = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
    fn = nat.fn("he_lookup_unpooled", I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, PTR, I64, PTR, PTR, I32,
                restype=None)
    fn(prep.batch_size, len(counts), nat.ptr(feats), nat.ptr(prep.offsets), nat.ptr(prep.inverse),
       nat.ptr(prep.weights), nat.ptr(_check_slots(prep, slots)), nat.ptr(a["table"]), nat.ptr(addr), nat.ptr(stride),
       nat.ptr(a["max_norm"]), nat.ptr(a["combiner"]), group.dim, nat.ptr(out), nat.ptr(row0), nat.nthreads())
    return out


def backward_native(plan: LookupPlan, prep: Prepared, storages, slots, pooled_grads, unpooled_grads):
    """Per table, the gradient rows of its unique keys: a list of [U_t, D_t] tensors.

    pooled_grads[g] is the gradient of group g's pooled output [B, F_g, D];
    unpooled_grads[g] that of its unpooled rows [sum n_f, D].
    """
    a = plan.arrays("cpu")
    B, F, T = prep.batch_size, plan.num_features, plan.num_tables
    grad_ptr = [0] * F
    grad_stride = [0] * F
    keep_alive = []
    for g, group in enumerate(plan.groups):
        D = group.dim
        if group.pooled:
            gp = nat.check(pooled_grads[g].contiguous(), torch.float32, "pooled gradient", B * len(group.pooled) * D)
            keep_alive.append(gp)
            for k, f in enumerate(group.pooled):
                grad_ptr[f] = gp.data_ptr() + k * D * 4
                grad_stride[f] = len(group.pooled) * D
        if group.unpooled:
            gu = nat.check(unpooled_grads[g].contiguous(), torch.float32, "unpooled gradient")
            keep_alive.append(gu)
            row = 0
            for f, n in zip(group.unpooled, unpooled_rows(prep, group)):
                grad_ptr[f] = gu.data_ptr() + row * D * 4
                grad_stride[f] = D
                row += n
    # Tables of one dim lie side by side in the gradient buffer: their [U_t, D] blocks come
    # out of one view and one split per dim, not two ops per table.
    dims = [t.dim for t in plan.tables]
    by_dim: dict[int, list[int]] = {}
    for t in range(T):
        by_dim.setdefault(dims[t], []).append(t)
    gbase, total = [0] * T, 0
    for D, ts in by_dim.items():
        for t in ts:
            gbase[t] = total
            total += prep.unique_count[t] * D
    gbuf = torch.empty(total, dtype=torch.float32)
    addr, stride = _addresses(storages)
    # every array handed to the kernel is held by a local: a pointer to a temporary
    # would dangle as soon as the temporary is collected
    i64 = dict(dtype=torch.int64)
    unique_base = torch.tensor(prep.unique_base, **i64)
    unique_count = torch.tensor(prep.unique_count, **i64)
    grad_ptr_t = torch.tensor(grad_ptr, **i64)
    grad_stride_t = torch.tensor(grad_stride, **i64)
    gbase_t = torch.tensor(gbase, **i64)
    fn = nat.fn("he_lookup_backward", I64, I64, I64, *([PTR] * 17), I32, restype=None)
    fn(B, F, T, nat.ptr(a["table_feat_ptr"]), nat.ptr(a["table_feats"]), nat.ptr(prep.offsets), nat.ptr(prep.inverse),
       nat.ptr(prep.weights), nat.ptr(_check_slots(prep, slots)), nat.ptr(addr), nat.ptr(stride), nat.ptr(a["max_norm"]),
       nat.ptr(a["combiner"]), nat.ptr(unique_base), nat.ptr(unique_count), nat.ptr(a["dims"]), nat.ptr(grad_ptr_t),
       nat.ptr(grad_stride_t), nat.ptr(gbuf), nat.ptr(gbase_t), nat.nthreads())
    del keep_alive
    out: list[torch.Tensor] = [gbuf] * T
    for D, ts in by_dim.items():
        start, rows = gbase[ts[0]], [prep.unique_count[t] for t in ts]
        block = gbuf[start : start + sum(rows) * D].view(-1, D)
        for t, g in zip(ts, block.split(rows) if len(ts) > 1 else (block,)):
            out[t] = g
    return out
