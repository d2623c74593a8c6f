"""The distributed side of a training run: sharded tables, DDP, merged metrics, aligned eval, errors.

With ``world_size > 1`` (torchrun, or ``hugeembed train --nproc N``) the Trainer builds
the model with a :class:`ShardedEmbeddingCollection` (a plan proposed from the tables,
the memory budget and ``--shard`` overrides), wraps it in DistributedDataParallel for
the dense part, merges every rank's metric accumulators exactly, and turns a failed
collective into a :class:`ShardingError` naming the step and the stage.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from ..data import Batch
from ..distributed import ShardedEmbeddingCollection, estimate_table, propose_plan
from ..distributed._plan import DATA_PARALLEL_BELOW
from ..distributed._liveness import describe_failure
from ..errors import ShardingError
from ..types import ShardKind
from ..features import SparseFeatures
from ..metrics import MetricSet
from ._config import TrainConfig

__all__ = ["sharded_factory", "run_plan", "fit_replicas", "ids_per_step", "expected_rows", "merged_tier_stats",
           "tiered_run", "wrap_ddp", "merge_metrics", "aligned", "empty_batch", "as_sharding_error", "check_process_group", "run_info"]


def check_process_group(rank: int, world_size: int) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ShardingError(f"a run of {world_size} processes needs torch.distributed initialised first: launch "
                            "with `torchrun --nproc_per_node N -m hugeembed train ...` or `hugeembed train --nproc N`")
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ShardingError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, the trainer "
                            f"was told rank {rank} of {world_size}")


def run_plan(cfg: TrainConfig, world_size: int, tables, optimizer, unsized=()):
    """The run's sharding plan: proposed from the tables, the memory per rank, the data's ids per
    bag (:func:`ids_per_step`) and the sizes its distinct ids show small (:func:`expected_rows`),
    with --shard overrides.  `unsized`: tables whose size from the data is not passed (sharded as
    without it: :func:`fit_replicas`)."""
    overrides = dict(item.split("=", 1) for item in cfg.sharding)
    return propose_plan(tables, world_size, cfg.memory_per_rank, optimizer=optimizer, batch_size=cfg.batch_size,
                        expected_rows=_replica_hints(cfg, tables, optimizer, unsized),
                        ids_per_step=ids_per_step(cfg, world_size, tables), overrides=overrides, servers=cfg.servers)


def _replica_hints(cfg: TrainConfig, tables, optimizer, unsized=()) -> dict[str, int]:
    """The rows hints the planner gets: only those that make a table replicated (a sized larger one would
    go table-wise, slower than row-wise, where an unsized one goes, at one id a bag: docs/distributed.md,
    "Measured"), less `unsized`'s."""
    hints = (expected_rows(cfg, tables) if cfg.size_from_data else None) or {}
    return {t.name: hints[t.name] for t in tables if t.name in hints and t.name not in unsized and
            estimate_table(t, optimizer, expected_rows=hints).bytes <= DATA_PARALLEL_BELOW}


def fit_replicas(cfg: TrainConfig, world_size: int, tables, optimizer, tiers):
    """(plan, tiers(tables, plan, optimizer)) of a run with tables on disk: a replica needs its cache on
    every rank, so where the budget cannot hold two batches' rows of every table a rank holds
    (BudgetError), the replicated table sized from the data with the largest such floor is sharded as
    without the size instead, one at a time, until the caches fit; the run fails only where the plan
    without them would (the error then names the tables it sharded).  The same on every rank."""
    from ._tiers import BudgetError

    overrides = {item.split("=", 1)[0] for item in cfg.sharding}
    unsized: list[str] = []
    while True:
        plan = run_plan(cfg, world_size, tables, optimizer, unsized)
        try:
            return plan, tiers(tables, plan, optimizer)
        except BudgetError as e:
            sized = _replica_hints(cfg, tables, optimizer, unsized)
            movable = sorted((-e.floors[n], n) for n in sized if n in e.floors and n not in overrides
                             and plan[n].kind is ShardKind.DATA_PARALLEL)
            if not movable:
                if unsized:
                    raise BudgetError(f"{e} (already sharding the tables {', '.join(unsized)} instead of "
                                      "replicating them on every rank)", e.floors) from None
                raise
            unsized.append(movable[0][1])


def _shard_set(cfg: TrainConfig):
    """The run's converted shards (one directory or its manifest.json), else None (text files, synthetic)."""
    from pathlib import Path

    from ..data import ShardSet

    if len(cfg.data) != 1 or not (Path(cfg.data[0]).is_dir() or Path(cfg.data[0]).name == "manifest.json"):
        return None
    return ShardSet(cfg.data[0], verify="none")


def ids_per_step(cfg: TrainConfig, world_size: int, tables) -> dict[str, float] | None:
    """Ids per global step of each table, for the planner: converted shards' mean ids per bag of each
    feature (``ShardSet.ids_per_bag``: exact over the whole data, from the shard manifest, the same on
    every rank) times the planner's bags per step.  None for text files and synthetic data (one id per
    bag: the text's bags are unknown before reading it all, and ranks must agree on the plan)."""
    shards = _shard_set(cfg)
    if shards is None:
        return None
    per_bag = shards.ids_per_bag()
    bags = cfg.batch_size * world_size  # per feature, as propose_plan counts them
    return {t.name: bags * sum(per_bag.get(f, 1.0) for f in t.features) for t in tables}


def expected_rows(cfg: TrainConfig, tables) -> dict[str, int] | None:
    """Rows hint of each table read only by features whose distinct ids the data tells, for the planner
    (which replicates a dynamic table it knows to be small): the sum over the table's features (an
    upper bound when several share it) of the synthetic generator's capped cardinality + 1 (the missing
    id), or of converted shards' estimates (``ShardSet.distinct_ids``, from the manifest); at most the
    table's capacity.  The same on every rank (the config; the manifest file).  None for text files
    (unknown before reading them all) and for shards converted before manifests held the estimate."""
    if not cfg.data:
        from ..data import SyntheticConfig
        from ..data._schema import CAT_NAMES

        cards = SyntheticConfig(max_cardinality=cfg.synthetic_max_cardinality).cardinalities()
        distinct: dict[str, int] | None = {name: c + 1 for name, c in zip(CAT_NAMES, cards)}
    else:
        shards = _shard_set(cfg)
        distinct = None if shards is None else shards.distinct_ids()
    if distinct is None:
        return None
    hints = {}
    for t in tables:
        if all(f in distinct for f in t.features):
            rows = sum(distinct[f] for f in t.features)
            # a table keeps at most its capacity's rows (the planner takes the hint over the capacity)
            hints[t.name] = rows if t.capacity is None else min(rows, t.capacity)
    return hints


def sharded_factory(cfg: TrainConfig, world_size: int, tiers=None):
    """Builds a ShardedEmbeddingCollection from the model's tables with the run's plan; `tiers`
    (tables, plan, optimizer) -> (tables, storage owner) puts them on disk (training/_tiers.py)."""

    def build(tables, *, optimizer, **kw) -> ShardedEmbeddingCollection:
        owner = None
        if tiers is None:
            plan = run_plan(cfg, world_size, tables, optimizer)
        else:
            plan, (tables, owner) = fit_replicas(cfg, world_size, tables, optimizer, tiers)
        return ShardedEmbeddingCollection(tables, optimizer=optimizer, plan=plan, timeout=cfg.dist_timeout,
                                          storage_owner=owner, staleness=cfg.staleness or None, servers=cfg.servers,
                                          stale_row_scale=cfg.stale_scale,
                                          stale_compensation=float(cfg.stale_compensation),
                                          # replicas (the small, hot tables) follow the dense part's delay
                                          # (with DC-ASGD their drift counts from that read)
                                          replicated_staleness=min(cfg.staleness, cfg.dense_staleness)
                                          if cfg.staleness else None, **kw)

    return build


_SUMMED = ("accesses", "hits", "rows_read", "rows_written", "rows_prefetched", "resident_rows", "capacity_rows",
           "stored_rows")


def merged_tier_stats(collection: Any) -> dict | None:
    """``collection.tier_stats()`` over all ranks (collective): counts and bytes summed per table,
    hit rates recomputed from the sums.  A data-parallel table's replicas each count (each
    holds its rows, in memory and on disk).  None without tiered tables (no collective then:
    every rank has the same table configs; a rank holding no tiered shard -- a --servers worker --
    takes part with nothing)."""
    if not tiered_run(collection):
        return None
    parts = [p for p in collection.comm.all_gather_object("tier stats", collection.tier_stats()) if p is not None]
    tables: dict[str, dict] = {}
    for part in parts:
        for name, st in part["tables"].items():
            into = tables.setdefault(name, dict.fromkeys(_SUMMED, 0))
            for k in _SUMMED:
                into[k] += st[k]
    for st in tables.values():
        st["hit_rate"] = st["hits"] / st["accesses"] if st["accesses"] else 0.0
    acc, hits = sum(t["accesses"] for t in tables.values()), sum(t["hits"] for t in tables.values())
    return {"cache_hit_rate": hits / acc if acc else 0.0, "tables": tables,
            "table_bytes_resident": sum(p["table_bytes_resident"] for p in parts),
            "table_bytes_stored": sum(p["table_bytes_stored"] for p in parts)}


def tiered_run(collection: Any) -> bool:
    """Whether the run's tables live on disk: by their configs, the same on every rank (a rank may hold no
    tiered shard itself)."""
    return any(t.storage_dir is not None for t in collection.tables)


def wrap_ddp(model: torch.nn.Module, device: torch.device, process_group=None) -> torch.nn.Module:
    """The dense part under DistributedDataParallel (the tables hold no Parameter: DDP never sees them), over
    `process_group` (None: every rank; with --servers: the workers')."""
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                     else None, process_group=process_group)


def merge_metrics(collection: ShardedEmbeddingCollection, ms: MetricSet) -> MetricSet:
    """Every rank's accumulators merged in rank order (exact: the metrics of all predictions)."""
    merged = MetricSet()
    for part in collection.comm.all_gather_object("eval metrics", ms):
        merged.merge(part)
    return merged


def empty_batch(keys: Iterable[str], num_dense: int, device: torch.device) -> Batch:
    keys = list(keys)
    sparse = SparseFeatures(keys, torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(1, dtype=torch.int64),
                            batch_size=0)
    return Batch(torch.zeros(0, num_dense), sparse, torch.zeros(0)).to(device)


def aligned(batches: Iterable[Batch], collection: ShardedEmbeddingCollection, empty: Batch) -> Iterator[Batch]:
    """This rank's batches, then empty ones until every rank has run out.

    Every rank must run the same number of forwards (each is a collective); ranks whose
    slice of a held-out set is shorter look up empty batches meanwhile.
    """
    it = iter(batches)
    while True:
        batch = next(it, None)
        if collection.comm.all_reduce_max("eval batches", int(batch is not None)) == 0:
            return
        yield batch if batch is not None else empty


def as_sharding_error(e: BaseException, rank: int, step: int, stage: str) -> ShardingError | None:
    """A ShardingError for a failed collective outside the embedding group (DDP's all-reduce), else None."""
    if isinstance(e, ShardingError):
        return None
    text = str(e)
    comm_failure = isinstance(e, getattr(dist, "DistBackendError", ())) or any(
        s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed", "timed out", "Timed out",
                            "pair closure"))
    if not comm_failure:
        return None
    first = text.splitlines()[0] if text else type(e).__name__
    return ShardingError(f"rank {rank}: {stage} at step {step} failed: a peer process died or hung; resume from "
                         f"the last snapshot with --resume. Cause: {type(e).__name__}: {first}." + describe_failure())


def run_info(collection: Any) -> dict[str, Any]:
    """Rows and bytes of the tables over all ranks (collective)."""
    rows = collection.global_num_rows()
    table_bytes = sum(sum(m.values()) for m in collection.comm.all_gather_object("table bytes",
                                                                                  collection.memory_bytes()))
    return {"rows": rows, "bytes": table_bytes}

