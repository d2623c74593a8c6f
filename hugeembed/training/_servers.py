"""``--servers M``: the last M ranks of a run hold the tables' shards and read no data (parameter servers).

A server runs the trainer's loop like a worker, on empty batches: each step's forward and backward
are the sharded collection's collectives, in the same order on every rank, so the servers answer
the workers' id requests and apply the row gradients they receive, under any ``--staleness``.  The
N - M workers read the data (worker w the slice w of every global batch of ``batch_size x (N - M)``
rows), run the dense model and all-reduce its gradients over their own process group.  A server
learns the run's length from worker 0 (it reads nothing to count steps).
"""

from __future__ import annotations

from typing import Iterator

import torch.distributed as dist

from ..data import Batch
from ..distributed import Comm
from ..errors import ConfigError
from ._config import TrainConfig
from ._queue import QueueSource, queue_source
from ._sources import DataSource, make_source

__all__ = ["check_servers", "check_server_plan", "workers_group", "ServerSource", "run_source"]


def check_servers(servers: int, world_size: int) -> None:
    """ConfigError unless `servers` leaves at least one of `world_size` processes to read the data."""
    if servers and world_size == 1:
        raise ConfigError(f"--servers {servers} is about several processes: add --nproc N (N > {servers}), or run "
                          f"under torchrun")
    if servers >= world_size:
        raise ConfigError(f"--servers {servers} leaves no process to read the data: a run of {world_size} processes "
                          f"takes --servers 0..{world_size - 1} (the last M ranks serve the tables)")


def workers_group(world_size: int, servers: int):
    """The process group of the workers (ranks 0..N-M-1), over which the dense gradients are all-reduced;
    None (the default group) without servers.  Collective: every rank calls it."""
    if not servers:
        return None
    return dist.new_group(list(range(world_size - servers)))


class ServerSource(DataSource):
    """A server's data: none.  Each epoch, as many empty batches as the workers have steps (told by worker 0)."""

    def __init__(self, empty: Batch, batch_size: int, workers: int) -> None:
        self.empty, self.batch_size, self.workers = empty, batch_size, workers
        self.description = "no data (a server rank)"

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        for _ in range(skip, self.steps_per_epoch or 0):
            yield self.empty

    def eval_batches(self) -> Iterator[Batch]:
        return iter(())

    def trained(self, batch: Batch, world_size: int) -> int:
        return self.batch_size * self.workers  # the workers' rows of the step


def run_source(cfg: TrainConfig, rank: int, world_size: int, schema, empty: Batch) -> DataSource:
    """This rank's data in a run with servers (collective: every rank calls it).  Workers read their slice
    (or take chunks of --data-queue); servers read nothing and follow worker 0's epoch length."""
    workers = world_size - cfg.servers
    if rank < workers:
        src: DataSource = make_source(cfg, rank, workers, schema)
    else:
        src = ServerSource(empty, cfg.batch_size, workers)
    if cfg.data_queue is not None:
        if rank < workers:
            src = queue_source(src, cfg.data_queue, cfg.batch_size, rank, world_size, cfg.dist_timeout, workers)
        else:  # joins the queue's collectives (its token, every step's row count, snapshot positions) with no rows
            src = QueueSource(src, None, [], [], None, cfg.data_queue, cfg.batch_size, rank, world_size,
                              cfg.dist_timeout, workers, server_batch=empty)
    comm = Comm(dist.group.WORLD, cfg.dist_timeout)
    shape = comm.all_gather_object("data shape", (src.steps_per_epoch, src.estimated_steps_per_epoch, src.description,
                                                  tuple(src.notes)) if rank < workers else None)[0]
    if rank >= workers:
        src.steps_per_epoch = None if cfg.data_queue is not None else shape[0]
        src.estimated_steps_per_epoch, src.description, src.notes = shape[1], shape[2], shape[3]
    if cfg.data_queue is None and shape[0] is None:
        raise ConfigError(f"{shape[2]}: with --servers every rank must know the epoch's steps before reading; text "
                          f"files are read line by line: convert them first (`hugeembed convert FILES -o DIR`, then "
                          f"--data DIR), or give --data-queue")
    return src


def check_server_plan(cfg: TrainConfig, world_size: int) -> None:
    """Before launching `world_size` processes: ConfigError for a bad server count, ShardingError for a plan
    whose tables fit no server under --memory-per-rank (the planner's message), ConfigError for a placement
    the tables refuse (a column-wise table whose dim the ranks do not divide), without a process group
    (the model is built on the meta device: no rows, no data)."""
    import torch

    from ..nn import EmbeddingCollection
    from ._build import build_model
    from ._distributed import run_plan
    from ._sources import run_schema

    check_servers(cfg.servers, world_size)

    def planned(tables, *, optimizer, **kw):
        run_plan(cfg, world_size, tables, optimizer).validate(tables)  # e.g. a column-wise dim the ranks split
        return EmbeddingCollection(tables, optimizer=optimizer, **kw)

    build_model(cfg, torch.device("meta"), 1, run_schema(cfg), collection_factory=planned)
