"""The clean + dedup stage on the triton kernels (hugeembed/_triton/prepare.py): ``prepare_torch``'s
Prepared, equal to it field by field, in a few launches and one read of the device (the report: the
batch's checks, the ids kept, the keys per table, the features' extents), which raises the same errors.

What it takes: int64 ids, float32 (or no) weights that need no gradient (the kernels' writes carry no
graph), a batch of at least one bag.  Anything else takes ``prepare_torch``.
"""

from __future__ import annotations

import contextlib
from itertools import accumulate

import torch

from ..errors import InputError
from ._plan import LookupPlan, Prepared, raise_offsets_error

__all__ = ["prepare_triton"]

_BLOCK = 256


def prepare_triton(plan: LookupPlan, sf, deduplicate: bool = True, shuffle: int | None = None) -> Prepared | None:
    """Clean + dedup of `sf` on the kernels, or None when they do not take it (see the module docstring).

    `shuffle`: for tests, each launch's programs one at a time in an order drawn from this seed."""
    import triton

    from .._triton import prepare as k
    from .._triton._grid import launch, shuffled_programs
    from .._triton.dedup import Dedup

    values, weights = sf.values(), sf.weights_or_none()
    B, F, T = sf.batch_size, plan.num_features, plan.num_tables
    if values.dtype != torch.int64 or B * F == 0 or (weights is not None and (
            weights.dtype != torch.float32 or (weights.requires_grad and torch.is_grad_enabled()))):
        return None
    dev = values.device
    a = plan.arrays(dev)
    offsets = sf.offsets()
    offsets = offsets if offsets.dtype == torch.int64 else offsets.to(torch.int64)
    src = plan.source_indices(sf.keys(), dev)
    N, FB, n_in = values.numel(), F * B, offsets.numel() - 1
    M = N * plan.source_reads(sf.keys()) + FB  # every kept id and one default id per bag, at most
    table_base, sentinel = plan.linear_keys(dev)
    linear = sentinel is not None and deduplicate
    key_dtype = torch.int32 if linear and sentinel < 2**31 - 1 else torch.int64
    feats = dict(src=src, feat_table=a["table"], num_rows=a["num_rows"], prune_neg=a["prune_neg"], oor=a["oor"],
                 has_default=a["has_default"], default_id=a["default_id"], combiner=a["combiner"])
    report = torch.zeros(k.REPORT_HEAD + T + F + 1, dtype=torch.int64, device=dev)
    lengths = torch.empty(FB, dtype=torch.int64, device=dev)
    out_offsets = torch.empty(FB + 1, dtype=torch.int64, device=dev)
    ids = torch.empty(M, dtype=torch.int64, device=dev)
    tabs = torch.empty(M, dtype=torch.int32, device=dev)
    w_out = torch.empty(M, dtype=torch.float32, device=dev) if weights is not None else None
    keys = torch.empty(M, dtype=key_dtype, device=dev) if linear else ids
    w_arg = weights if weights is not None else values
    with shuffled_programs(shuffle) if shuffle is not None else contextlib.nullcontext():
        nbb = triton.cdiv(FB, k.BAG_BLOCK)  # programs over the bags; those past them check offsets / pad
        launch(k._clean_bags, nbb + triton.cdiv(max(n_in, 1), _BLOCK), offsets, values, w_arg, **feats,
               lengths=lengths, out_offsets=out_offsets, report=report, B=B, FB=FB, n_in=n_in, N=N, NBB=nbb,
               HAS_W=weights is not None, BLOCK_B=k.BAG_BLOCK, BLOCK=_BLOCK)
        torch.cumsum(lengths, 0, out=out_offsets[1:])
        launch(k._scatter_bags, nbb + triton.cdiv(M, _BLOCK), offsets, values, w_arg, **feats, table_base=table_base,
               out_offsets=out_offsets, ids_out=ids, w_out=w_out if w_out is not None else values, tab_out=tabs,
               key_out=keys, report=report, B=B, F=F, FB=FB, N=N, M=M, T=T,
               sentinel=sentinel if sentinel is not None else 0, NBB=nbb, HAS_W=weights is not None, LINEAR=linear,
               BLOCK_B=k.BAG_BLOCK, BLOCK=_BLOCK)
        two_sorts = deduplicate and not linear
        if two_sorts:  # (dynamic tables: any int64 id; by id, then a stable sort by table: _run_heads gathers)
            by_id = torch.sort(ids, stable=True)[1]
            by_table = torch.sort(tabs[by_id], stable=True)[1]
            perm = torch.empty(M, dtype=torch.int64, device=dev)
        else:
            perm = by_id = by_table = _sort(keys, tabs, linear)
        heads = torch.empty(M, dtype=torch.int32, device=dev)
        grid = triton.cdiv(M, _BLOCK)
        launch(k._run_heads, grid, perm, by_id, by_table, ids, tabs, heads, M, T, DEDUP=deduplicate,
               TWO_SORTS=two_sorts, BLOCK=_BLOCK)
        uid = torch.cumsum(heads, 0, dtype=torch.int32)
        unique_keys = torch.empty(M, dtype=torch.int64, device=dev)
        unique_tables = torch.empty(M, dtype=torch.int32, device=dev)
        inverse = torch.empty(M, dtype=torch.int64, device=dev)
        unique_counts = torch.zeros(M, dtype=torch.int64, device=dev)
        seg_start = torch.empty(M + 1, dtype=torch.int32, device=dev)
        counts = torch.empty(2, dtype=torch.int32, device=dev)
        launch(k._encode_runs, triton.cdiv(M + 1, _BLOCK), perm, ids, tabs, heads, uid, out_offsets, unique_keys,
               unique_tables, inverse, unique_counts, seg_start, counts, report, M, FB, T, BLOCK=_BLOCK)
    host = report.tolist()  # the one read of the device
    _raise_errors(plan, sf, host, N)
    n_keep, per_table = host[3], host[k.REPORT_HEAD : k.REPORT_HEAD + T]
    n_unique = sum(per_table)
    base = list(accumulate(per_table, initial=0))[:-1]  # the tables' keys end to end
    # the runs as the update kernels read them (rows: the lookup's slots, given by the backward)
    runs = Dedup(perm, unique_keys, unique_tables, seg_start, inverse, counts) if deduplicate else None
    return Prepared(B, out_offsets, inverse[:n_keep], None if w_out is None else w_out[:n_keep],
                    unique_keys[:n_unique], unique_counts[:n_unique], base, per_table, n_unique, native=False,
                    deduplicated=deduplicate, feature_starts=host[k.REPORT_HEAD + T :], runs=runs, packed=True,
                    unique_tables=unique_tables[:n_unique].to(torch.int64))  # (the fetch's table column: no host
    #                                                                        -made column copied in each step)


def _sort(keys, tabs, linear: bool) -> torch.Tensor:
    """The entries' order by their linear key (table, id), or (without dedup) by table only, stable
    (uncounted entries last)."""
    return torch.sort(keys if linear else tabs, stable=True)[1]


def _raise_errors(plan: LookupPlan, sf, host: list[int], N: int) -> None:
    """prepare_torch's errors, in its order: the offsets, a weight not finite, an id out of range."""
    from .._triton.prepare import BIG

    if host[0]:
        raise_offsets_error(sf)
    for code, first in ((2, host[1]), (1, host[2])):
        if first:
            f, pos = divmod(BIG - first, N + 1)
            raise InputError(plan.describe_id_error(code, f, pos, int(sf.values()[pos]), sf))

