"""Splitting a run's --memory-budget between its tiered tables, by the traffic each one sees.

A table's share of the budget is what its rows are worth to the cache: the distinct ids a
batch reads from it (measured on the first batches of the data) times its row size.  A
table never gets less than two batches' distinct rows (one being trained, one evaluated
or pinned), nor more than its whole size (a static table that fits is all resident and
never writes to disk); what a capped table leaves goes to the others (water-filling).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import torch

from ..errors import ConfigError
from ..nn import TableConfig
from ..store import SLOT_METADATA_BYTES

__all__ = ["batch_traffic", "shard_traffic", "split_memory_budget", "split_memory_budget_per_rank", "tiered_tables",
           "BudgetError"]


class BudgetError(ConfigError):
    """The budget cannot hold two batches' rows of every table a rank holds: `floors` (table -> the
    least bytes it needs) of the rank that fails (the trainer shards a replicated table it sized from
    the data instead, training/_distributed.py::fit_replicas)."""

    def __init__(self, message: str, floors: dict[str, int]):
        super().__init__(message)
        self.floors = floors


def batch_traffic(tables: Sequence[TableConfig], batches: Iterable) -> dict[str, float]:
    """Mean distinct ids per batch of each table over `batches` (Batch objects)."""
    seen = {t.name: [] for t in tables}
    for batch in batches:
        sparse = batch.sparse
        for t in tables:
            ids = [sparse.feature(f).values for f in t.features if f in sparse]
            if ids:
                seen[t.name].append(int(torch.unique(torch.cat(ids)).numel()))
    return {name: (sum(v) / len(v) if v else 1.0) for name, v in seen.items()}


def shard_traffic(tables: Sequence[TableConfig], batches: Iterable, plan) -> dict[int, dict[str, float]]:
    """Mean distinct ids per global batch that each rank's shard of each table holds under `plan`
    (rank -> table -> ids), over `batches` (Batch objects of the global batch): a table-wise
    owner and every data-parallel replica hold all of a table's ids, a row-wise shard those
    its rank owns (measured, not assumed 1/n: ids may favour one residue)."""
    from ..distributed._row_wise import owner_index
    from ..types import ShardKind

    seen: dict[int, dict[str, list[int]]] = {r: {} for r in range(plan.world_size)}
    for batch in batches:
        sparse = batch.sparse
        for t in tables:
            ids = [sparse.feature(f).values for f in t.features if f in sparse]
            uniq = torch.unique(torch.cat(ids)) if ids else torch.empty(0, dtype=torch.int64)
            p = plan[t.name]
            if p.kind is ShardKind.DATA_PARALLEL:
                held = {r: uniq.numel() for r in range(plan.world_size)}
            else:
                owners = torch.bincount(owner_index(uniq, len(p.ranks), t.num_rows is not None),
                                        minlength=len(p.ranks))
                held = {r: int(owners[i]) for i, r in enumerate(p.ranks)}
            for r, n in held.items():
                seen[r].setdefault(t.name, []).append(n)
    return {r: {name: sum(v) / len(v) for name, v in per.items()} for r, per in seen.items()}


def split_floors(tables: Sequence[TableConfig], traffic: dict[str, float], row_bytes: dict[str, int],
                 num_rows: dict[str, int | None]) -> dict[str, int]:
    """Per table the least cache it gets: two batches of its distinct rows, at most all its rows."""
    out = {}
    for t in tables:
        slot = row_bytes[t.name] + SLOT_METADATA_BYTES
        f = int(2 * max(1.0, traffic.get(t.name, 1.0)) + 1) * slot
        out[t.name] = f if num_rows[t.name] is None else min(f, num_rows[t.name] * slot)
    return out


def split_memory_budget(tables: Sequence[TableConfig], budget: int, traffic: dict[str, float],
                        row_bytes: dict[str, int], num_rows: dict[str, int | None] | None = None,
                        where: str = "", floors: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes of cache per table (see the module docstring); ConfigError when `budget` cannot hold
    two batches' rows of every table.  `num_rows`: the rows each table holds where its cache
    lives (default: its TableConfig's; a shard holds fewer); `where` prefixes the error;
    `floors`: the least per table, when not split_floors' (a shard's, from all its ranks)."""
    held = {t.name: t.num_rows for t in tables} if num_rows is None else num_rows
    slot = {t.name: row_bytes[t.name] + SLOT_METADATA_BYTES for t in tables}
    cap = {t.name: (held[t.name] * slot[t.name] if held[t.name] is not None else None) for t in tables}
    floor = split_floors(tables, traffic, row_bytes, held) if floors is None else {t.name: floors[t.name]
                                                                                   for t in tables}
    if sum(floor.values()) > budget:
        raise BudgetError(f"{where}memory-budget {budget} B cannot hold two batches of rows of every table "
                          f"(needs {sum(floor.values())} B: "
                          + ", ".join(f"{n} {b} B" for n, b in floor.items()) + "); raise it or lower batch-size",
                          floor)
    share = dict(floor)
    left = budget - sum(share.values())
    open_ = [t.name for t in tables if cap[t.name] is None or share[t.name] < cap[t.name]]
    while left > 0 and open_:
        weight = {n: traffic.get(n, 1.0) * slot[n] for n in open_}
        total = sum(weight.values())
        given = 0
        for n in list(open_):
            add = int(left * weight[n] / total)
            if cap[n] is not None and share[n] + add >= cap[n]:
                add = cap[n] - share[n]
                open_.remove(n)
            share[n] += add
            given += add
        left -= given
        if given == 0:
            break
    return share


def split_memory_budget_per_rank(tables: Sequence[TableConfig], plan, budget: int,
                                 traffic: dict[int, dict[str, float]], row_bytes: dict[str, int]) -> dict[str, int]:
    """Bytes of cache of each rank's shard of each table under a sharding `plan`, so that no rank's
    caches exceed `budget` (the budget is per rank).

    `traffic`: rank -> table -> the ids per step its shard holds (shard_traffic); a rank holds
    the tables with an entry.  A row-wise shard of n ranks holds 1/n of a static table's rows
    (its cap).  Each rank splits its budget over the tables it holds, each table at least the
    floor of its busiest shard; a table held by several ranks takes the smallest of their
    shares, the same on every rank (every rank computes this alike)."""
    from ..types import ShardKind

    held, rows = {}, {}
    for r in range(plan.world_size):
        held[r] = [t for t in tables if t.name in traffic.get(r, {})]
        for t in held[r]:
            p = plan[t.name]
            n = 1 if p.kind is ShardKind.DATA_PARALLEL else len(p.ranks)
            rows[t.name] = None if t.num_rows is None else -(-t.num_rows // n)
    # every shard of a table gets the floor of its busiest one (the same cache size on every rank)
    floors: dict[str, int] = {}
    for r, ts in held.items():
        for name, b in split_floors(ts, traffic.get(r, {}), row_bytes, rows).items():
            floors[name] = max(floors.get(name, 0), b)
    share: dict[str, int] = {}
    for r, ts in held.items():
        if ts:
            mine = split_memory_budget(ts, budget, traffic[r], row_bytes, rows, where=f"rank {r}: ", floors=floors)
            for name, b in mine.items():
                share[name] = min(share.get(name, b), b)
    return share


def tiered_tables(tables: Sequence[TableConfig], budget: int, storage_dir: str, cache_policy: str,
                  traffic, row_bytes: dict[str, int], plan=None) -> list[TableConfig]:
    """`tables` with their rows on disk under `storage_dir`, the budget split by `traffic`
    (batch_traffic; with a sharding `plan`, shard_traffic: the budget is each rank's, see
    split_memory_budget_per_rank)."""
    share = split_memory_budget(tables, budget, traffic, row_bytes) if plan is None else \
        split_memory_budget_per_rank(tables, plan, budget, traffic, row_bytes)
    return [dataclasses.replace(t, storage_dir=os.fspath(storage_dir), memory_budget=share[t.name],
                                cache_policy=cache_policy) for t in tables]
