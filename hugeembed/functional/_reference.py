"""The plain-PyTorch twin of the lookup stages: any device, any float dtype.

Same contract as _native_stages.py (it runs on CUDA and for dtypes the kernels do not take), in
vectorised torch ops: their number does not grow with the features (one segment reduction per dim
group); only the per-table row gathers are a loop over tables."""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from .._device import host_to_device
from .._tensors import concat_ranges, kept_positions
from ..errors import InputError
from ..types import OutOfRange
from ._clip import clip_rows, clip_rows_backward
from ._plan import DimGroup, LookupPlan, Prepared, raise_offsets_error

__all__ = ["prepare_torch", "pool_torch", "unpooled_torch", "backward_torch", "gradient_rows_torch",
           "weights_backward_torch"]

_SUM, _MEAN, _SQRTN, _NONE = 0, 1, 2, 3


def _padded_ranges(starts: torch.Tensor, sizes: torch.Tensor, cap: int):
    """`concat_ranges` of sizes >= 0 padded to `cap` elements without reading the total: (the
    elements, their owners, which of them are real, the device-side total).  The padding (and
    any element past `cap` when the total exceeds it: the caller checks) repeats the last
    owner, and every owner is a valid index even then."""
    dev = starts.device
    cum = torch.cumsum(sizes, 0)
    total = cum[-1] if sizes.numel() else torch.zeros((), dtype=torch.int64, device=dev)
    at = torch.arange(cap, device=dev)
    if sizes.numel() == 0:
        return at, at, at < 0, total
    owner = torch.searchsorted(cum, at, right=True).clamp_(max=sizes.numel() - 1)
    return at - (cum - sizes).index_select(0, owner) + starts.index_select(0, owner), owner, at < total, total


def prepare_torch(plan: LookupPlan, sf, deduplicate: bool = True) -> Prepared:
    """Clean + dedup of a batch in torch ops (any device) with one read of the device.

    Every array is sized from the batch's shapes alone (the ids the plan may read, plus one
    default id per bag), with a mask of the entries that are real; the batch's checks (offsets,
    weights, ids in range), the number of ids kept, the unique keys per table and each
    feature's extent come back in that one read, and the arrays are then cut to size.  Every
    index stays in range however bad the batch is, so a bad batch raises its error (after the
    read) and never trips a device-side assert.
    """
    dev = sf.device
    a = plan.arrays(dev)
    B, F, T = sf.batch_size, plan.num_features, plan.num_tables
    values = sf.values()
    if values.dtype != torch.int64:
        raise InputError(f"SparseFeatures {list(sf.keys())}: ids must be int64, got {values.dtype}")
    offsets = sf.offsets().to(torch.int64)
    weights = sf.weights_or_none()
    N, FB = values.numel(), F * B
    # valid offsets put every id in one bag of its feature: the plan reads at most this many
    cap = N * plan.source_reads(sf.keys()) if FB else 0
    in_lengths = offsets[1:] - offsets[:-1]
    # every bag in [0, len(values)], none decreasing, and the ends exactly 0 and len(values)
    bad_bags = (in_lengths < 0) | (offsets[1:] > N) | (offsets[:-1] < 0)
    bad_bags = bad_bags.any() | (offsets[0] != 0) | (offsets[-1] != N)
    if plan.reads_in_order(sf.keys()):
        starts, sizes = offsets[:FB], in_lengths[:FB]  # each plan feature reads the input at its place
    else:
        src = plan.source_indices(sf.keys(), dev)
        bag_src = (src[:, None] * B + torch.arange(B, device=dev)).reshape(-1)
        starts, sizes = offsets[:-1].index_select(0, bag_src), in_lengths.index_select(0, bag_src)
    pos, bag, valid, total = _padded_ranges(starts, sizes.clamp(min=0), cap)
    bad_bags = bad_bags | (total > cap)
    pos = pos.clamp(0, max(N - 1, 0))  # in range even for bad offsets (the batch then raises)
    v = values.index_select(0, pos)
    f_of = torch.div(bag, B, rounding_mode="floor") if B else bag
    t_of = a["table"].index_select(0, f_of)
    keep = valid
    w = None
    bad_w = torch.zeros((), dtype=torch.bool, device=dev)
    if weights is not None:
        w = weights.index_select(0, pos)
        bad_w = valid & ~torch.isfinite(w)
        keep = keep & (w > 0)
    # (each step below runs only where some feature of the plan asks for it: a plan constant)
    if plan.prunes_negative:
        keep = keep & ~((v < 0) & a["prune_neg"].index_select(0, f_of).bool())
    err = torch.zeros_like(keep)
    if plan.range_policies:  # static tables: ids in [0, num_rows), else the feature's out_of_range
        nr = a["num_rows"].index_select(0, t_of)
        oob = keep & (nr >= 0) & ((v < 0) | (v >= nr))
        pol = a["oor"].index_select(0, f_of)
        err = oob & (pol == 0)
        if OutOfRange.PRUNE in plan.range_policies:
            keep = keep & ~(oob & (pol == 1))
        if OutOfRange.DEFAULT in plan.range_policies:
            v = torch.where(oob & (pol == 2), a["default_id"].index_select(0, f_of), v)
    lengths = torch.zeros(FB, dtype=torch.int64, device=dev).index_add_(0, bag, keep.to(torch.int64))
    if plan.fills_empty:  # empty pooled bags with a default_id get that id, weight 1: one candidate entry per bag
        bag_feature = torch.arange(FB, device=dev) // max(B, 1)
        fill = (lengths == 0) & a["has_default"].index_select(0, bag_feature).bool() & \
            (a["combiner"].index_select(0, bag_feature) != _NONE)
        lengths = lengths + fill.to(lengths.dtype)
    out_offsets = torch.zeros(FB + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lengths, 0, out=out_offsets[1:])
    # the candidates: the ids (and the fills), each to its place in bag order: a kept id after the
    # kept ids before it (and the filled bags before its own), a fill to its bag's start, the others
    # past the end (n_keep on): a permutation, made without reading n_keep
    cand_v, cand_bag, cand_t, cand_w, cand_keep = v, bag, t_of, w, keep
    at = torch.cumsum(keep.to(torch.int64), 0) - 1
    if plan.fills_empty:
        fills_before = torch.cumsum(fill.to(torch.int64), 0) - fill.to(torch.int64)
        at = torch.cat([at + fills_before.index_select(0, bag), out_offsets[:-1]])
        cand_v = torch.cat([v, a["default_id"].index_select(0, bag_feature)])
        cand_bag = torch.cat([bag, torch.arange(FB, device=dev)])
        cand_t = torch.cat([t_of, a["table"].index_select(0, bag_feature)])
        cand_w = None if w is None else torch.cat([w, torch.ones(FB, dtype=w.dtype, device=dev)])
        cand_keep = torch.cat([keep, fill])
    dest = torch.where(cand_keep, at, out_offsets[-1] + torch.cumsum((~cand_keep).to(torch.int64), 0) - 1)
    M = cand_keep.numel()
    in_bag_order = torch.empty(M, dtype=torch.int64, device=dev).index_copy_(0, dest, torch.arange(M, device=dev))
    # dedup per table: sort by (table, id), unique runs (without dedup: by table only, in bag order,
    # every id its own entry); the candidates not kept sort last, as a table T that is not counted
    tb = torch.where(cand_keep, cand_t, T)
    table_base, sentinel = plan.linear_keys(dev)
    ks = None
    if deduplicate and sentinel is not None:  # every table static: one sort of the keys base[t] + id
        ks, perm = torch.sort(torch.where(cand_keep, table_base.index_select(0, cand_t) + cand_v, sentinel))
    else:  # by id, then stably by table (equal ids in any order: they become one key)
        o1 = torch.argsort(cand_v) if deduplicate else in_bag_order
        perm = o1.index_select(0, torch.argsort(tb.index_select(0, o1), stable=True))
    vs, ts = cand_v.index_select(0, perm), tb.index_select(0, perm)
    new = torch.ones_like(vs, dtype=torch.bool)
    if vs.numel() > 1 and deduplicate:
        new[1:] = (vs[1:] != vs[:-1]) | (ts[1:] != ts[:-1]) if ks is None else ks[1:] != ks[:-1]
    uid_sorted = torch.cumsum(new.to(torch.int64), 0) - 1
    uid = torch.empty_like(uid_sorted).index_copy_(0, perm, uid_sorted)  # of each candidate
    per_table_t = torch.zeros(T + 1, dtype=torch.int64, device=dev).index_add_(0, ts, new.to(torch.int64))[:T]
    edges = out_offsets[::B] if B else torch.zeros(F + 1, dtype=torch.int64, device=dev)
    # the one read of the device: the checks, the ids kept, the keys per table, the features' extents
    checks = torch.stack([bad_bags, bad_w.any(), err.any()]).to(torch.int64)
    host = torch.cat([checks, out_offsets[-1:], per_table_t, edges]).tolist()
    if host[0]:
        raise_offsets_error(sf)
    if host[1]:
        j = int(torch.nonzero(bad_w)[0, 0])
        raise InputError(plan.describe_id_error(2, int(f_of[j]), int(pos[j]), int(values[pos[j]]), sf))
    if host[2]:
        bad_f, bad_pos = f_of[err], pos[err]
        j = int(torch.argmin(bad_f * (N + 1) + bad_pos))  # first by (feature, position)
        raise InputError(plan.describe_id_error(1, int(bad_f[j]), int(bad_pos[j]), int(values[bad_pos[j]]), sf))
    n_keep, per_table, feature_starts = host[3], host[4 : 4 + T], host[4 + T :]
    n_unique = sum(per_table)
    kept = in_bag_order[:n_keep]  # the kept candidates, in bag order
    inverse = uid.index_select(0, kept)
    firsts = kept_positions(new & (ts < T), n_unique)  # each unique key's first candidate, in sorted order
    base = list(accumulate(per_table, initial=0))[:-1]  # the tables' keys end to end
    return Prepared(B, out_offsets, inverse, None if cand_w is None else cand_w.index_select(0, kept),
                    vs.index_select(0, firsts),
                    _count(inverse, n_unique), base, per_table, n_unique, native=False,
                    deduplicated=deduplicate, feature_starts=feature_starts,
                    bags=cand_bag.index_select(0, kept), packed=True, unique_tables=ts.index_select(0, firsts))


def _count(index: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: occurrences of each value in [0, n) in `index` (bincount would read the
    device for its output size)."""
    return torch.zeros(n, dtype=torch.int64, device=index.device).index_add_(0, index, torch.ones_like(index))


def _unique_rows(plan: LookupPlan, prep: Prepared, storages, slots, dim: int, dtype, runs=None,
                 every_row: bool = False) -> torch.Tensor:
    """[capacity, D] rows of every unique key of the tables of this dim (zeros for slot -1), clipped;
    `every_row`: no slot is -1 (a training lookup whose every id got a row): nothing to zero.

    `runs`: ``runs[D]`` lists the runs ``(first, last)`` of consecutive tables of dim D that read one
    storage (FusedEmbeddingLookup's row_groups); each run's rows are one gather over the span of its
    tables' unique keys (a gap between tables holds slot -1: zeros).  None: every table alone."""
    dev = prep.offsets.device
    emb = None  # (made only when the spans do not cover the whole capacity in one gather)
    spans = runs[dim] if runs is not None else [(t, t) for t, spec in enumerate(plan.tables) if spec.dim == dim]
    base, count = prep.unique_base, prep.unique_count
    for t0, t1 in spans:
        lo, hi = base[t0], base[t1] + count[t1]
        if hi <= lo:
            continue
        rows = _rows_at(storages[t0], slots[lo:hi], dim, dtype, every_row)
        for t in plan.clipped:  # (the tables with max_norm)
            mn = plan.tables[t].max_norm
            if t0 <= t <= t1 and count[t]:
                at = slice(base[t] - lo, base[t] - lo + count[t])
                rows[at] = clip_rows(rows[at], mn)
        if lo == 0 and hi == prep.capacity:
            return rows
        if emb is None:
            emb = torch.zeros(prep.capacity, dim, dtype=dtype, device=dev)
        emb[lo:hi] = rows
    return emb if emb is not None else torch.zeros(prep.capacity, dim, dtype=dtype, device=dev)


def _rows_at(storage: torch.Tensor, slots: torch.Tensor, dim: int, dtype, every_row: bool = False) -> torch.Tensor:
    """``storage[slots, :dim]`` as `dtype`, zero rows where the slot is -1 (an unknown id).

    A dynamic table with no rows yet (evaluated before any training) has an empty storage,
    which index_select refuses even for clamped slots: every slot is then -1, all zeros.
    """
    if storage.size(0) == 0:
        return torch.zeros(slots.numel(), dim, dtype=dtype, device=slots.device)
    if every_row:  # (contiguous: torch gathers rows of a strided tensor one TensorIterator copy each, ~40x slower)
        return storage.index_select(0, slots)[:, :dim].to(dtype).contiguous()
    rows = storage.index_select(0, slots.clamp(min=0))[:, :dim].to(dtype)
    return rows * (slots >= 0).unsqueeze(1).to(dtype)


def _derived(prep: Prepared, key, make):
    """``make()``, made once per prepared batch and key (which names the plan: a batch prepared
    once may be read by several plans): the forward and its backward share it."""
    got = prep.derived.get(key)
    if got is None:
        got = prep.derived[key] = make()
    return got


def _group_ids(plan: LookupPlan, prep: Prepared, feats: tuple[int, ...]):
    """Positions of the kept ids of `feats` (a slice when they are one range, else an index tensor: either
    indexes a kept-id array with ``x[pos]``), the feature slot k of each, and its sample."""
    return _derived(prep, ("ids", plan, feats), lambda: _make_group_ids(plan, prep, feats))


def _make_group_ids(plan: LookupPlan, prep: Prepared, feats: tuple[int, ...]):
    dev = prep.offsets.device
    B = prep.batch_size
    if feats and prep.bags is not None and prep.feature_starts is not None and \
            plan.memo(("consecutive", feats), lambda: feats == tuple(range(feats[0], feats[0] + len(feats)))):
        # consecutive features (one dim's, usually every feature): their
        # ids are one range, whose bags the prepare gives: `pos` is a slice (a view, no gather)
        lo, hi = prep.feature_starts[feats[0]], prep.feature_starts[feats[-1] + 1]
        bag = prep.bags[lo:hi]
        feature = torch.div(bag, max(B, 1), rounding_mode="floor")
        return slice(lo, hi), feature - feats[0], bag - feature * B
    f = plan.on_device(feats, dev)
    if prep.feature_starts is None:
        starts, ends = prep.offsets[f * B], prep.offsets[(f + 1) * B]
        pos, owner = concat_ranges(starts, ends - starts)
    else:  # the features' extents known on the host: no read of the device
        fs, k = np.asarray(prep.feature_starts, dtype=np.int64), np.asarray(feats, dtype=np.int64)
        starts, sizes = fs[k], fs[k + 1] - fs[k]  # (numpy: no Python per feature)
        pos, owner = concat_ranges(host_to_device(starts, torch.int64, dev), host_to_device(sizes, torch.int64, dev),
                             int(sizes.sum()))
    bag = prep.bags.index_select(0, pos) if prep.bags is not None else \
        torch.searchsorted(prep.offsets, pos, right=True) - 1
    sample = bag - f.index_select(0, owner) * B
    return pos, owner, sample


def _bag_denominators(plan: LookupPlan, prep: Prepared, group: DimGroup, pos, owner, sample, dtype):
    """Per output bag (b*F_g + k): the combiner's divisor (1 for sum, 0 for empty bags; None when every
    one is 1: a group of sums), each id's weight (None: the batch has none, every weight 1) and its
    output bag."""
    return _derived(prep, ("denominators", plan, group, dtype),
                    lambda: _make_bag_denominators(plan, prep, group, pos, owner, sample, dtype))


def _make_bag_denominators(plan: LookupPlan, prep: Prepared, group: DimGroup, pos, owner, sample, dtype):
    dev = prep.offsets.device
    nbag = prep.batch_size * len(group.pooled)
    out_bag = sample * len(group.pooled) + owner
    w = prep.weights[pos].to(dtype) if prep.weights is not None else None
    if group in plan.summed_groups:  # every divisor 1: the ones the passes below would give
        return None, w, out_bag
    if w is None:
        w = torch.ones(out_bag.numel(), dtype=dtype, device=dev)
    wsum = torch.zeros(nbag, dtype=dtype, device=dev).index_add_(0, out_bag, w)
    w2sum = torch.zeros(nbag, dtype=dtype, device=dev).index_add_(0, out_bag, w * w)
    comb = plan.arrays(dev)["combiner"][plan.on_device(group.pooled, dev)]
    comb = comb.repeat(prep.batch_size)
    denom = torch.where(comb == _MEAN, wsum, torch.where(comb == _SQRTN, torch.sqrt(w2sum), torch.ones_like(wsum)))
    return torch.where(wsum > 0, denom, torch.ones_like(denom)), w, out_bag


def _combine(rows: torch.Tensor, w: torch.Tensor | None, out_bag: torch.Tensor, denom: torch.Tensor | None,
             n_bags: int) -> torch.Tensor:
    """[n_bags, D]: each bag's weighted sum of its rows divided by its combiner's denominator (a weight
    or a divisor of None: 1, no pass)."""
    out = torch.zeros(n_bags, rows.shape[1], dtype=rows.dtype, device=rows.device)
    out.index_add_(0, out_bag, rows if w is None else rows * w.unsqueeze(1))
    return out if denom is None else out / denom.unsqueeze(1)


def pool_torch(plan: LookupPlan, prep: Prepared, storages, slots, group: DimGroup, dtype,
               runs=None, every_row: bool = False) -> torch.Tensor:
    B, D, n = prep.batch_size, group.dim, len(group.pooled)
    dev = prep.offsets.device
    if n == 0 or B == 0:
        return torch.zeros(B, n, D, dtype=dtype, device=dev)
    emb = _unique_rows(plan, prep, storages, slots, D, dtype, runs, every_row)
    pos, owner, sample = _group_ids(plan, prep, group.pooled)
    denom, w, out_bag = _bag_denominators(plan, prep, group, pos, owner, sample, dtype)
    return _combine(emb.index_select(0, prep.inverse[pos]), w, out_bag, denom, B * n).view(B, n, D)


def unpooled_torch(plan: LookupPlan, prep: Prepared, storages, slots, group: DimGroup, dtype,
                   runs=None, every_row: bool = False) -> torch.Tensor:
    dev = prep.offsets.device
    if not group.unpooled:
        return torch.zeros(0, group.dim, dtype=dtype, device=dev)
    emb = _unique_rows(plan, prep, storages, slots, group.dim, dtype, runs, every_row)
    pos, _, _ = _group_ids(plan, prep, group.unpooled)
    rows = emb.index_select(0, prep.inverse[pos])
    if prep.weights is not None:
        rows = rows * prep.weights[pos].to(dtype).unsqueeze(1)
    return rows


def backward_torch(plan: LookupPlan, prep: Prepared, storages, slots, pooled_grads, unpooled_grads,
                   grads_by_dim: dict[int, torch.Tensor] | None = None):
    """Per table, gradient rows [U_t, D_t] of its unique keys (backward_native gives them by dim), from
    `grads_by_dim` (gradient_rows_torch's result, or its triton twin's) when given."""
    dev = prep.offsets.device
    if grads_by_dim is None:
        grads_by_dim = gradient_rows_torch(plan, prep, pooled_grads, unpooled_grads)
    parts = {D: prep.per_table(acc) for D, acc in grads_by_dim.items()}  # one split per dim, not a slice per table
    out = []
    for t, spec in enumerate(plan.tables):
        b, n = prep.unique_base[t], prep.unique_count[t]
        g = parts[spec.dim][t] if spec.dim in parts else torch.zeros(n, spec.dim, device=dev)
        if spec.max_norm and n:
            g = clip_rows_backward(_rows_at(storages[t], slots[b : b + n], spec.dim, g.dtype), g, spec.max_norm)
        out.append(g)
    return out


def gradient_rows_torch(plan: LookupPlan, prep: Prepared, pooled_grads, unpooled_grads) -> dict[int, torch.Tensor]:
    """Per dim D, ``[capacity, D]``: the summed output gradient of each unique key of its tables
    (rows of the other dims' keys stay zero), before any max_norm clipping.  With one dim, no
    table clipped and a torch prepare (tables end to end from 0) it is backward_native's block."""
    dev = prep.offsets.device
    grads_by_dim: dict[int, torch.Tensor] = {}
    for g, group in enumerate(plan.groups):
        D = group.dim
        dtype = (pooled_grads[g] if group.pooled else unpooled_grads[g]).dtype
        acc = torch.zeros(prep.capacity, D, dtype=dtype, device=dev)
        if group.pooled and prep.batch_size:
            pos, owner, sample = _group_ids(plan, prep, group.pooled)
            denom, w, out_bag = _bag_denominators(plan, prep, group, pos, owner, sample, dtype)
            go = pooled_grads[g].reshape(-1, D).contiguous().index_select(0, out_bag)  # (see _rows_at)
            if denom is not None:
                w = (torch.ones_like(denom[out_bag]) if w is None else w) / denom[out_bag]
            acc.index_add_(0, prep.inverse[pos], go if w is None else go * w.unsqueeze(1))
        if group.unpooled:
            pos, _, _ = _group_ids(plan, prep, group.unpooled)
            go = unpooled_grads[g]
            if prep.weights is not None:
                go = go * prep.weights[pos].to(dtype).unsqueeze(1)
            acc.index_add_(0, prep.inverse[pos], go)
        grads_by_dim[D] = acc if D not in grads_by_dim else grads_by_dim[D] + acc
    return grads_by_dim


def weights_backward_torch(plan: LookupPlan, prep: Prepared, storages, slots, pooled_grads,
                           unpooled_grads, runs=None) -> torch.Tensor:
    """Gradient w.r.t. ``prep.weights`` (the kept per-id weights): TF's pooling differentiated.

    With e_i the (clipped) row of id i, g its bag's output gradient and out the bag's output:
    sum ``<g, e_i>``; mean ``<g, e_i - out> / sum(w)``; sqrtn
    ``<g, e_i> / q - <g, out> w_i / q^2`` with q = sqrt(sum(w^2)); unpooled ``<g_i, e_i>``.
    Dropped ids (weight <= 0, pruned) are not in ``prep.weights``: autograd gives them 0.
    """
    dev = prep.offsets.device
    gw = torch.zeros(prep.weights.numel(), dtype=torch.float64 if prep.weights.dtype == torch.float64 else
                     torch.float32, device=dev)
    for g, group in enumerate(plan.groups):
        D = group.dim
        if group.pooled and prep.batch_size:
            go_all = pooled_grads[g]
            dtype = go_all.dtype
            emb = _unique_rows(plan, prep, storages, slots, D, dtype, runs)
            pos, owner, sample = _group_ids(plan, prep, group.pooled)
            denom, w, out_bag = _bag_denominators(plan, prep, group, pos, owner, sample, dtype)
            e = emb.index_select(0, prep.inverse[pos])
            go = go_all.reshape(-1, D)[out_bag]
            out = _combine(e, w, out_bag, denom, go_all.reshape(-1, D).shape[0])  # the forward's bag outputs
            ge = (go * e).sum(1)
            gout = (go * out[out_bag]).sum(1)
            d = denom[out_bag] if denom is not None else torch.ones_like(w)
            comb = plan.arrays(dev)["combiner"][plan.on_device(group.pooled, dev)][owner]
            grad = torch.where(comb == _MEAN, (ge - gout) / d,
                               torch.where(comb == _SQRTN, ge / d - gout * w / (d * d), ge))
            gw[pos] = grad.to(gw.dtype)
        if group.unpooled:
            go = unpooled_grads[g]
            emb = _unique_rows(plan, prep, storages, slots, D, go.dtype, runs)
            pos, _, _ = _group_ids(plan, prep, group.unpooled)
            gw[pos] = (go * emb.index_select(0, prep.inverse[pos])).sum(1).to(gw.dtype)
    return gw
