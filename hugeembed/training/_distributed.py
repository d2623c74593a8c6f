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
from ..distributed import ShardedEmbeddingCollection, propose_plan
from ..errors import ShardingError
from ..features import SparseFeatures
from ..metrics import MetricSet
from ._config import TrainConfig

__all__ = ["sharded_factory", "wrap_ddp", "merge_metrics", "aligned", "empty_batch", "as_sharding_error",
           "check_process_group", "run_info"]


def check_process_group(rank: int, world_size: int) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ShardingError(f"a run of {world_size} processes needs torch.distributed initialised first: launch "
                            "with `torchrun --nproc_per_node N -m hugeembed train ...` or `hugeembed train --nproc N`")
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ShardingError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, the trainer "
                            f"was told rank {rank} of {world_size}")


def sharded_factory(cfg: TrainConfig, world_size: int):
    """Builds a ShardedEmbeddingCollection from the model's tables with the run's plan."""

    def build(tables, *, optimizer, **kw) -> ShardedEmbeddingCollection:
        overrides = dict(item.split("=", 1) for item in cfg.sharding)
        plan = propose_plan(tables, world_size, cfg.memory_per_rank, optimizer=optimizer,
                            batch_size=cfg.batch_size, overrides=overrides)
        return ShardedEmbeddingCollection(tables, optimizer=optimizer, plan=plan, timeout=cfg.dist_timeout, **kw)

    return build


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The dense part under DistributedDataParallel (the tables hold no Parameter: DDP never sees them)."""
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                     else None)


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
                         f"the last snapshot with --resume. Cause: {type(e).__name__}: {first}")


def run_info(collection: Any) -> dict[str, Any]:
    """Rows and bytes of the tables over all ranks (collective)."""
    rows = collection.global_num_rows()
    table_bytes = sum(sum(m.values()) for m in collection.comm.all_gather_object("table bytes",
                                                                                  collection.memory_bytes()))
    return {"rows": rows, "bytes": table_bytes}

