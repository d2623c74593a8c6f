"""The clean/dedup, pool and backward stages on the native CPU kernels (csrc/lookup_*.cpp, called
through csrc/lookup_call.cpp).

Each kernel takes its tensors as buffers (hugeembed/_native.call) and checks their
types and lengths itself, so none reads past a buffer; the tables' rows go over as
buffers too, never as addresses.  The torch twin of each stage is in _reference.py;
both produce the same ``Prepared`` structure.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np
import torch

from .. import _native as nat
from ..errors import InputError
from ._grad_rows import row_starts
from ._plan import DimGroup, LookupPlan, Prepared

__all__ = ["NativeScratch", "prepare_native", "pool_native", "unpooled_native", "backward_native", "can_use_native",
           "can_use_native_storages", "unpooled_rows"]

# he_lookup_pool_direct's results (csrc/lookup.h::PoolDirect): pooled, or left to the
# two-stage path, which reports the bag at fault
POOL_DIRECT_POOLED, POOL_DIRECT_TWO_STAGE = 0, 1


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
    for s in _distinct(storages).values():  # the tables of a group read one tensor: checked once
        if not (isinstance(s, torch.Tensor) and s.device.type == "cpu" and s.dtype == torch.float32 and s.dim() == 2
                and (s.stride(1) == 1 or s.size(1) <= 1)):
            return False
    return True


def _distinct(storages: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """id -> tensor of the distinct tensors of `storages` (the tables of a group read one), made
    without Python per table (all are alive, so their ids are distinct)."""
    return dict(zip(map(id, storages), storages))


class NativeScratch:
    """Owns the native dedup scratch (hash tables reused across batches) of one lookup."""

    def __init__(self) -> None:
        # the context's address is the one handle that crosses as an integer (he_lookup_ctx_new)
        self.handle = nat.call("he_lookup_ctx_new")
        self._finalizer = weakref.finalize(self, nat.call, "he_lookup_ctx_free", (), (self.handle,))


class _PlanBuffers:
    """A plan's constant arrays as the kernels take them (csrc/lookup_args.h's head), built once
    per plan: each call then hands over two packed buffers, not ten
    tensors, and builds no per-group arrays (a call's cost grows with its buffers)."""

    __slots__ = ("i64", "i8", "max_norm", "groups", "where", "grad_order", "dim_of", "dims", "dim_list")

    def __init__(self, plan: LookupPlan) -> None:
        a = plan.arrays("cpu")
        self.i64 = torch.cat([a["table"], a["default_id"], a["table_feats"], a["num_rows"], a["dims"],
                              a["table_feat_ptr"]])
        self.i8 = torch.cat([a["prune_neg"], a["oor"], a["has_default"], a["combiner"]])
        self.max_norm = a["max_norm"]
        # the backward's gradient buffers: per dim group (pooled buffer or None, unpooled or None) in
        # the order they are handed over, and per feature (buffer, first element, stride) for the
        # pooled features (an unpooled feature's first element depends on the batch)
        where = [0] * (3 * plan.num_features)
        self.grad_order: list[tuple[int | None, int | None]] = []
        n = 0
        for group in plan.groups:
            D, pooled = group.dim, None
            if group.pooled:
                pooled, n = n, n + 1
                for k, f in enumerate(group.pooled):
                    where[3 * f : 3 * f + 3] = (pooled, k * D, len(group.pooled) * D)
            unpooled = None
            if group.unpooled:
                unpooled, n = n, n + 1
            self.grad_order.append((pooled, unpooled))
        self.where = torch.tensor(where, dtype=torch.int64)
        # per table its dim's index in plan.tables_by_dim, and its dim (gradient rows' positions)
        self.dim_list = list(plan.tables_by_dim)
        self.dim_of = np.array([self.dim_list.index(t.dim) for t in plan.tables], dtype=np.int64)
        self.dims = np.array([t.dim for t in plan.tables], dtype=np.int64)
        # per dim group: pooled features, their output columns, unpooled features
        self.groups: dict[DimGroup, tuple] = {
            g: (torch.tensor(g.pooled, dtype=torch.int64), torch.arange(len(g.pooled), dtype=torch.int64) * g.dim,
                torch.tensor(g.unpooled, dtype=torch.int64)) for g in plan.groups}


_plan_buffers: weakref.WeakKeyDictionary[LookupPlan, _PlanBuffers] = weakref.WeakKeyDictionary()


def _buffers(plan: LookupPlan) -> _PlanBuffers:
    cached = _plan_buffers.get(plan)
    if cached is None:
        cached = _plan_buffers[plan] = _PlanBuffers(plan)
    return cached


_layouts: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}  # see _tables


def _tables(storages: Sequence[torch.Tensor]) -> tuple[list, torch.Tensor, list[int]]:
    """The tables' rows as the kernels take them (csrc/lookup_call.cpp): the distinct row storages
    (the tables of a group read one), int64 ``of_table [T]`` (which one each table reads) and the
    storages' row strides.  A whole storage goes over as itself, a view of some columns as rows().

    Which tables share a storage is found once per layout of the list (cached by the tensors' ids:
    equal ids in one list are one tensor, so a hit has the same sharing), so a call costs no
    Python per table and hands over no int per table."""
    key = tuple(map(id, storages))
    layout = _layouts.get(key)
    if layout is None:
        first = dict(zip(reversed(key), range(len(key) - 1, -1, -1)))  # id -> its first position
        positions = sorted(first.values())
        rank = {key[p]: i for i, p in enumerate(positions)}
        layout = (positions, torch.tensor(list(map(rank.__getitem__, key)), dtype=torch.int64))
        if len(_layouts) >= 64:  # (lists rebuilt with new tensors: keep the cache small)
            _layouts.clear()
        _layouts[key] = layout
    positions, of_table = layout
    distinct = [storages[p] for p in positions]
    return [d if d.is_contiguous() else nat.rows(d) for d in distinct], of_table, [d.stride(0) for d in distinct]


def batch_arrays(sf) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ids, int64 offsets, float32 weights or None) of a batch, as the kernels read them."""
    values = sf.values()
    offsets = sf.offsets()
    if offsets.dtype != torch.int64 or not offsets.is_contiguous():
        offsets = offsets.to(torch.int64).contiguous()
    weights = sf.weights_or_none()
    if weights is not None:
        weights = weights.contiguous()
    return values, offsets, weights


def prepare_native(plan: LookupPlan, sf, scratch: NativeScratch, deduplicate: bool = True) -> Prepared:
    pb = _buffers(plan)
    values, offsets, weights = batch_arrays(sf)
    B, F, T = sf.batch_size, plan.num_features, plan.num_tables
    src = plan.source_indices(sf.keys())
    # Only uninitialised allocations between the kernels: a torch op on a batch-sized
    # tensor would wake torch's OpenMP workers, which then spin on the cores our
    # threads need.
    out_offsets = torch.empty(F * B + 1, dtype=torch.int64)
    # The kernels' counts in one buffer, read once after both kernels: the totals (n_kept,
    # capacity), unique_base [T], unique_count [T].
    counts = torch.empty(2 + 2 * T, dtype=torch.int64)
    totals, unique_base, unique_count = counts[:2], counts[2 : 2 + T], counts[2 + T :]
    batch = [pb.i64, pb.i8, values, offsets, weights, src, out_offsets, unique_base]
    bad = None
    try:
        nat.call("he_lookup_count", batch + [totals], (B, F, T))
    except nat.KernelError as e:
        if e.status != nat.Status.BAD_VALUE:
            raise
        bad = e.detail  # (code, plan feature, position, value): raised below, without the kernel's error as context
    if bad is not None:
        raise InputError(plan.describe_id_error(*bad[:4], sf))
    # Dedup's outputs sized from the batch's shapes alone (each plan feature keeps at most its
    # input feature's ids, plus one default id per bag), so that nothing is read between the
    # kernels: the arrays are cut to size after the one read.
    bound = values.numel() * plan.source_reads(sf.keys()) + F * B
    inverse = torch.empty(bound, dtype=torch.int32)
    out_w = torch.empty(bound, dtype=torch.float32) if weights is not None else None
    unique_keys = torch.empty(bound, dtype=torch.int64)
    unique_counts = torch.empty(bound, dtype=torch.int32)
    nat.call("he_lookup_dedup", batch + [inverse, out_w, unique_keys, unique_counts, unique_count],
             (B, F, T, int(deduplicate), scratch.handle))
    host = counts.tolist()
    n_kept, capacity, base, per_table = host[0], host[1], host[2 : 2 + T], host[2 + T :]
    if out_w is not None and values.numel() == 0:
        # weights given for no ids: the kernels get no weights buffer (an empty one crosses as
        # null) and write none, and every entry kept is a filled bag's default id, of weight 1
        out_w[:n_kept].fill_(1.0)
    return Prepared(B, out_offsets, inverse[:n_kept], None if out_w is None else out_w[:n_kept],
                    unique_keys[:capacity], unique_counts[:capacity], base, per_table,
                    capacity, native=True, deduplicated=deduplicate, native_counts=counts[2:])


def pool_direct(plan: LookupPlan, sf, storages, group: DimGroup, arrays=None) -> torch.Tensor | None:
    """Pooled output [B, F_g, D] of a group of static tables in one pass over the batch
    (forward only: no dedup, no intermediate arrays), bit-identical to prepare + pool.
    None when a bag holds something to report (the caller runs the two-stage path,
    which raises with the details).  `arrays`: batch_arrays(sf), read once for all groups."""
    pb = _buffers(plan)
    values, offsets, weights = arrays if arrays is not None else batch_arrays(sf)
    B, D, n = sf.batch_size, group.dim, len(group.pooled)
    out = torch.empty(B, n, D, dtype=torch.float32)
    if n == 0 or B == 0:
        return out
    src = plan.source_indices(sf.keys())
    feats, cols = pb.groups[group][:2]
    rows, of_table, strides = _tables(storages)
    done = nat.call("he_lookup_pool_direct",
                    [pb.i64, pb.i8, pb.max_norm, feats, cols, values, offsets, weights, src, out, of_table, *rows],
                    (B, plan.num_features, plan.num_tables, D, n * D, len(rows), *strides))
    return out if done == POOL_DIRECT_POOLED else None


def pool_native(plan: LookupPlan, prep: Prepared, storages, slots, group: DimGroup) -> torch.Tensor:
    """Pooled output [B, F_g, D] of the group's pooled features."""
    pb = _buffers(plan)
    B, D, n = prep.batch_size, group.dim, len(group.pooled)
    out = torch.empty(B, n, D, dtype=torch.float32)
    if n == 0 or B == 0:
        return out
    feats, cols = pb.groups[group][:2]
    rows, of_table, strides = _tables(storages)
    nat.call("he_lookup_pool",
             [pb.i64, pb.i8, pb.max_norm, feats, cols, prep.offsets, prep.inverse, prep.weights, slots, out, of_table,
              *rows],
             (B, plan.num_features, plan.num_tables, D, prep.capacity, n * D, len(rows), *strides))
    return out


def unpooled_rows(prep: Prepared, group: DimGroup) -> list[int]:
    B = prep.batch_size
    offs = prep.offsets
    return [int(offs[(f + 1) * B]) - int(offs[f * B]) for f in group.unpooled]


def unpooled_native(plan: LookupPlan, prep: Prepared, storages, slots, group: DimGroup) -> torch.Tensor:
    """One row per kept id of the group's unpooled features, concatenated [sum n_f, D]."""
    pb = _buffers(plan)
    counts = unpooled_rows(prep, group)
    out = torch.empty(sum(counts), group.dim, dtype=torch.float32)
    if not counts or out.numel() == 0:
        return out
    feats = pb.groups[group][2]
    row0 = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
    rows, of_table, strides = _tables(storages)
    nat.call("he_lookup_unpooled",
             [pb.i64, pb.i8, pb.max_norm, feats, row0, prep.offsets, prep.inverse, prep.weights, slots, out, of_table,
              *rows],
             (prep.batch_size, plan.num_features, plan.num_tables, group.dim, prep.capacity, len(rows), *strides))
    return out


def backward_native(plan: LookupPlan, prep: Prepared, storages, slots, pooled_grads, unpooled_grads):
    """(blocks, row0): per dim D, the gradient rows of its tables' unique keys end to end, [n_D, D]
    (functional/_grad_rows.py), and each table's first row in its dim's block.

    pooled_grads[g] is the gradient of group g's pooled output [B, F_g, D];
    unpooled_grads[g] that of its unpooled rows [sum n_f, D].
    """
    pb = _buffers(plan)
    B, F, T = prep.batch_size, plan.num_features, plan.num_tables
    # each feature's gradient: (which of `grads`, its first element, elements between samples or ids);
    # the kernel checks each against the length of its buffer.  Decided with the plan but for the
    # unpooled features' first rows.
    grads: list[torch.Tensor] = []
    seq = None  # the plan's `where` with the unpooled features' first rows, when there are some
    for g, (group, (p, u)) in enumerate(zip(plan.groups, pb.grad_order)):
        if p is not None:
            grads.append(pooled_grads[g].contiguous())
        if u is not None:
            grads.append(unpooled_grads[g].contiguous())
            seq = pb.where.tolist() if seq is None else seq
            row, D = 0, group.dim
            for f, n in zip(group.unpooled, unpooled_rows(prep, group)):
                seq[3 * f : 3 * f + 3] = (u, row * D, D)
                row += n
    where = pb.where if seq is None else torch.tensor(seq, dtype=torch.int64)
    # Tables of one dim lie side by side in the gradient buffer: a dim's rows are one view of it.
    row0, rows = row_starts(plan, prep)
    sizes = np.array([rows[D] * D for D in pb.dim_list], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    total = int(sizes.sum())
    gbase = torch.from_numpy(starts[pb.dim_of] + np.asarray(row0, dtype=np.int64) * pb.dims)
    gbuf = torch.empty(total, dtype=torch.float32)
    unique = prep.native_counts if prep.native_counts is not None else \
        torch.tensor(prep.unique_base + prep.unique_count, dtype=torch.int64)
    tables, of_table, strides = _tables(storages)  # (it reads rows only to differentiate max_norm)
    nat.call("he_lookup_backward",
             [pb.i64, pb.i8, pb.max_norm, prep.offsets, prep.inverse, prep.weights, slots, gbuf, unique, gbase,
              where, of_table, *grads, *tables],
             (B, F, T, prep.capacity, len(grads), len(tables), *strides))
    return {D: gbuf[a : a + n].view(-1, D) for D, a, n in zip(pb.dim_list, starts.tolist(), sizes.tolist())}, row0
