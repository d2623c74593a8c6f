"""The routes of a ShardedEmbeddingCollection, decided once when it is built: which lookup prepares
and pools which tables, the exchange groups (row-wise, replicated, table-wise pooling) with their
header columns, and how the output groups are assembled from local and owner-pooled parts."""

from __future__ import annotations

import torch

from ..functional import FeatureSpec, FusedEmbeddingLookup, LookupPlan, TableSpec
from ..types import Combiner, ShardKind
from ._data_parallel import ReplicatedGroup
from ._row_wise import RowWiseGroup
from ._step import StepState, compute_dtype, group_dtypes
from ._table_wise import TableWisePooling

__all__ = ["build_routes", "route_kind"]


def route_kind(coll, t: int) -> str:
    """How table `t` travels: "replica" (data-parallel), "pool" (a table-wise owner pools), "row" (rows travel)."""
    p = coll.plan[coll.tables[t].name]
    if p.kind is ShardKind.DATA_PARALLEL:
        return "replica"
    if p.kind in (ShardKind.TABLE_WISE, ShardKind.COLUMN_WISE) and coll.tables[t].combiner is not Combiner.NONE:
        return "pool"  # a column-wise table: each rank of its placement pools its block of columns
    return "row"


def build_routes(coll) -> None:
    """Sets the collection's lookups, exchange routes and output assembly (decided once, at construction)."""
    # the collection's plan with its tables in their own order (the lookup's is in group order):
    # the same features and dim groups, feature_table naming collection tables
    full = LookupPlan([TableSpec(t.name, t.dim, num_rows=t.num_rows, max_norm=t.max_norm) for t in coll.tables],
                      coll.lookup.plan.features)
    T = len(coll.tables)
    kinds = [route_kind(coll, t) for t in range(T)]
    local = [t for t in range(T) if kinds[t] != "pool"]
    pool = [t for t in range(T) if kinds[t] == "pool"]
    mine = [t for t in pool if coll.rank in coll.plan[coll.tables[t].name].ranks]

    def dim_here(t: int) -> int:  # a column-wise table's block here is narrower
        p, dim = coll.plan[coll.tables[t].name], coll.tables[t].dim
        return dim // len(p.ranks) if p.kind is ShardKind.COLUMN_WISE else dim

    def specs(ts, rows: bool, own: bool = False):
        return [TableSpec(coll.tables[t].name, dim_here(t) if own else coll.tables[t].dim,
                          num_rows=coll.tables[t].num_rows if rows else None,
                          max_norm=coll.tables[t].max_norm) for t in ts]

    def feats(ts) -> list[FeatureSpec]:
        return [f for f, t in zip(full.features, full.feature_table) if t in ts]

    def lookup(ts, rows: bool, own: bool = False):
        return FusedEmbeddingLookup(specs(ts, rows, own), feats(ts), backend=coll.backend) if ts else None

    # prepare checks ids against num_rows; pooling reads received rows, fewer than num_rows
    # (or a replica's caught-up copies, in eval of global Adam tables: coll.current_rows)
    coll._local_prep, coll._local_pool = lookup(local, True), lookup(local, False)
    # the owner pools a batch it assembled itself (ids checked where they were prepared), from
    # its storage or, in eval of global Adam tables, from caught-up copies of fewer rows
    coll._pool_req, coll._pool_own = lookup(pool, True), lookup(mine, False, own=True)
    coll._local_index = {t: i for i, t in enumerate(local)}
    coll._pool_tables = pool
    dtypes = [t.dtype for t in coll.tables]
    full_dt = group_dtypes(full, dtypes)
    local_dt = group_dtypes(coll._local_pool.plan, [dtypes[t] for t in local]) if local else {}
    coll._routes: list = []
    col = StepState.COMMON
    groups: dict[tuple, list] = {}  # row-wise tables exchange together, per (dim, dtype, trainable)
    for t in local:
        cfg, lt = coll.tables[t], coll._local_index[t]
        if kinds[t] == "row":
            key = (cfg.dim, cfg.dtype, coll.rules[t] is not None)
            groups.setdefault(key, []).append((t, lt, coll.plan[cfg.name].ranks))
    for members in groups.values():
        route = RowWiseGroup(coll, members, col, compute_dtype(local_dt[members[0][1]]))
        coll._routes.append(route)
        col += route.header_cols
    replicas: dict[tuple, list] = {}
    for t in local:
        if kinds[t] == "replica":
            cfg = coll.tables[t]
            replicas.setdefault((cfg.dim, cfg.dtype, coll.rules[t] is not None), []).append(
                (t, coll._local_index[t]))
    for members in replicas.values():
        route = ReplicatedGroup(coll, members, col, compute_dtype(local_dt[members[0][1]]))
        coll._routes.append(route)
        col += route.header_cols
    coll._exchanges = any(k != "replica" for k in kinds)
    if pool:
        # one entry per owner: a table-wise table's, or each block of a column-wise one (in column order)
        tables, wire = [], []
        for i, t in enumerate(pool):
            p = coll.plan[coll.tables[t].name]
            owners = p.ranks if p.kind is ShardKind.COLUMN_WISE else (p.owner,)
            tables += [(t, i, owner, coll.tables[t].dim // len(owners)) for owner in owners]
            wire += [full_dt[t]] * len(owners)
        pooling = TableWisePooling(coll, tables, col, wire)
        coll._routes.append(pooling)
        col += pooling.header_cols
    coll._header_cols = col
    coll._pool_anchor = torch.zeros(0, requires_grad=True, device=coll.device)
    coll._inner_anchor = torch.zeros(0, requires_grad=True, device=coll.device)
    # how each output group of the full plan is assembled: pooled names per group, each
    # from the local lookup or from a table-wise owner; a whole local group is reused as is
    local_groups = {}
    if local:
        lp = coll._local_pool.plan
        local_groups = {tuple(lp.features[f].name for f in g.pooled): i for i, g in enumerate(lp.groups)}
    coll._assembly = []
    for g in full.groups:
        names = tuple(full.features[f].name for f in g.pooled)
        cols = []
        for f in g.pooled:
            t = full.feature_table[f]
            if kinds[t] == "pool":
                pooled = [full.features[h].name for h in full.table_features[t]]
                cols.append(("pool", t, pooled.index(full.features[f].name)))
            else:
                cols.append(("local", full.features[f].name, 0))
        coll._assembly.append((g.dim, full_dt[full.feature_table[g.pooled[0]]] if g.pooled else None,
                               local_groups.get(names) if names else None, cols))
