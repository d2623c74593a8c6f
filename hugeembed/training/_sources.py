"""Where training batches come from: the synthetic generator, or data files / shards under a schema.

Both give, per rank, the batches of an epoch (skipping those already trained on when
resuming) and a held-out evaluation set.  With several ranks each reads its own
slice: rank r of a global batch of ``batch_size * world_size`` rows takes rows
``[r*B, (r+1)*B)``, so N ranks see exactly the global batches one process would.
"""

from __future__ import annotations

import abc
import itertools
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from ..data import (Batch, BayesMetrics, Loader, Schema, ShardSet, SyntheticConfig, SyntheticCriteo, count_rows,
                    criteo_schema, fit_stats, load_schema)
from ..distributed import Comm
from ..errors import ConfigError
from ._config import TrainConfig

__all__ = ["DataSource", "SyntheticSource", "FileSource", "make_source", "run_schema", "default_epochs",
           "SMALL_DATA_ROWS"]

# `hugeembed train` on schema data without --steps or --epochs: passes over the training data by its size,
# measured by bench/quality.py --schema (docs/quality.md): a run of 200 steps (the synthetic main job's)
# was 8 passes over 50 k rows and lost 0.08 AUC to overfitting; one pass under 1 M rows left the
# dense layers short of steps (-0.006 AUC against two at 50 k rows), two passes above it gained little.
SMALL_DATA_ROWS = 1_000_000


def default_epochs(cfg: TrainConfig) -> int:
    """Passes over `cfg.data` when the run's length is not given: 2 below SMALL_DATA_ROWS rows, else 1."""
    paths = list(cfg.data)
    if len(paths) == 1 and (Path(paths[0]).is_dir() or Path(paths[0]).name == "manifest.json"):
        rows = ShardSet(paths[0], verify="none").rows
    else:
        rows = count_rows(paths, load_schema(cfg.schema) if cfg.schema else criteo_schema())
    return 2 if rows < SMALL_DATA_ROWS else 1


def run_schema(cfg: TrainConfig, saved: Schema | None = None) -> Schema:
    """The schema a run reads its data with: `cfg.schema`'s file, or the shards' own, or Criteo's; with the
    statistics of its standardize columns fitted on `cfg.data` -- or taken from `saved` (the schema a
    resumed run saved, which must describe the data alike)."""
    shards = None
    if len(cfg.data) == 1 and (Path(cfg.data[0]).is_dir() or Path(cfg.data[0]).name == "manifest.json"):
        shards = ShardSet(cfg.data[0], verify="none").schema
    schema = load_schema(cfg.schema) if cfg.schema else shards or criteo_schema()
    if shards is not None and schema.fingerprint() != shards.fingerprint():
        raise ConfigError(f"{cfg.data[0]} was converted under another schema than {cfg.schema}: leave --schema out "
                          f"(shards carry theirs) or convert the files again")
    if saved is not None:
        if saved.fingerprint() != schema.fingerprint():
            raise ConfigError("the snapshot was trained under another schema than this run's: resume with the "
                              "schema it was trained with")
        return saved
    if shards is not None:
        return shards
    return fit_stats(list(cfg.data), schema) if cfg.data and schema.needs_stats() else schema

# Held-out synthetic rows start far beyond any training row.
_EVAL_START = 1 << 44


class DataSource(abc.ABC):
    """Batches for one rank: training batches per epoch and a held-out evaluation set."""

    description: str = ""
    steps_per_epoch: int | None = None
    # steps per epoch as far as they can be told before reading (text files: from their line count);
    # paces the lr decay and the evaluations, never decides when training stops
    estimated_steps_per_epoch: int | None = None
    notes: tuple[str, ...] = ()  # what the user should be told before training (e.g. how a small file was split)

    @abc.abstractmethod
    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        """Training batches of `epoch`, skipping the first `skip` (already trained on)."""

    @abc.abstractmethod
    def eval_batches(self) -> Iterator[Batch]:
        """The held-out batches of this rank."""

    def bayes(self) -> BayesMetrics | None:
        """Best achievable metrics (known for synthetic data only)."""
        return None

    def trained(self, batch: Batch, world_size: int) -> int:
        """Called after each training step, in order: this rank trained `batch`; returns the step's rows over
        all ranks (every rank a batch of the same size here; --data-queue: training/_queue.py)."""
        return batch.batch_size * world_size


class SyntheticSource(DataSource):
    def __init__(self, cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.gen = SyntheticCriteo(SyntheticConfig(seed=cfg.seed, max_cardinality=cfg.synthetic_max_cardinality))
        self.steps_per_epoch = cfg.synthetic_rows // (cfg.batch_size * world_size)
        self.estimated_steps_per_epoch = self.steps_per_epoch
        if self.steps_per_epoch < 1:
            raise ConfigError(f"synthetic-rows={cfg.synthetic_rows} is less than one global batch")
        self.description = (f"synthetic Criteo-like data (seed {cfg.seed}, {cfg.synthetic_rows} rows/epoch, "
                            f"cardinalities capped at {cfg.synthetic_max_cardinality})")

    def _batch(self, start: int) -> Batch:
        return Batch.from_block(self.gen.rows(start, self.cfg.batch_size))

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        B, W = self.cfg.batch_size, self.world
        first = epoch * self.steps_per_epoch * B * W
        for step in range(skip, self.steps_per_epoch):
            yield self._batch(first + step * B * W + self.rank * B)

    def eval_batches(self) -> Iterator[Batch]:
        B, W = self.cfg.batch_size, self.world
        per_rank = max(1, self.cfg.eval_rows // (B * W))
        for k in range(per_rank):
            yield self._batch(_EVAL_START + k * B * W + self.rank * B)

    def bayes(self) -> BayesMetrics:
        return self.gen.bayes_metrics(rows=min(200_000, max(self.cfg.eval_rows, 50_000)), start=_EVAL_START)


class FileSource(DataSource):
    """Criteo TSV/.gz files or a converted shard directory.

    Without eval data, the first ``eval_rows`` rows of each rank's stream are held out
    (never trained on) and serve as the evaluation set.  A stream too small for that
    (it would all be held out) keeps ``eval_fraction`` of its batches (at least one)
    for evaluation instead, and says so in :attr:`notes`.
    """

    def __init__(self, cfg: TrainConfig, rank: int = 0, world_size: int = 1, schema: Schema | None = None) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.schema = schema if schema is not None else run_schema(cfg)
        paths = list(cfg.data)
        source = paths[0] if len(paths) == 1 else paths
        self.loader = Loader(source, cfg.batch_size, drop_last=True, seed=cfg.seed, rank=rank, world_size=world_size,
                             prefetch=cfg.prefetch, schema=self.schema)
        self.description = f"{'Criteo data' if self.schema.is_criteo() else 'data'} {', '.join(paths)}"
        self._eval_cache: list[Batch] | None = None
        self._eval_loader: Loader | None = None
        self._text_comm = None
        self.holdout = 0
        if not cfg.eval_data:
            self._plan_holdout(", ".join(paths))
        if self.loader.shards is not None:
            self.steps_per_epoch = self.estimated_steps_per_epoch = len(self.loader) - self.holdout
        else:  # rank r reads lines i % world == r, in whole batches
            rows = (count_rows(paths, self.schema) + world_size - 1 - rank) // world_size
            self.estimated_steps_per_epoch = max(0, rows // cfg.batch_size - self.holdout)

    def _plan_holdout(self, name: str) -> None:
        """How many of this rank's first batches are held out for evaluation."""
        cfg, B = self.cfg, self.cfg.batch_size
        want = max(1, -(-cfg.eval_rows // B))
        if self.loader.shards is not None:
            batches = len(self.loader)
        else:  # text: the row count is unknown; read (and keep) the held-out batches, plus one to see more exist
            self.loader.set_epoch(0)
            it = iter(self.loader)
            try:
                first = list(itertools.islice(it, want + 1))
            finally:
                it.close()
            batches = len(first) if len(first) <= want else None
            self._eval_cache = first[:want]
        if batches is None or batches > want:
            self.holdout = want
            return
        if batches < 2:
            raise ConfigError(f"{name}: {batches * B} usable rows per process (batches of {B}) cannot be split into "
                              f"training and held-out rows: give more data, a smaller --batch-size, or --eval-data")
        self.holdout = max(1, int(batches * cfg.eval_fraction))
        if self._eval_cache is not None:
            self._eval_cache = self._eval_cache[:self.holdout]
        per = " per process" if self.world > 1 else ""
        self.notes = (f"{name} has {batches * B} rows{per} in batches of {B}, fewer than --eval-rows {cfg.eval_rows}: "
                      f"holding out the first {self.holdout * B} rows for evaluation (eval_fraction "
                      f"{cfg.eval_fraction}), training on the other {(batches - self.holdout) * B}",)

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        self.loader.set_epoch(epoch)
        mine = itertools.islice(iter(self.loader), self.holdout + skip, None)
        if self.world > 1 and self.loader.shards is None and dist.is_initialized():
            return _while_every_rank_has_one(mine, self._comm())
        return mine

    def _comm(self):
        if self._text_comm is None:
            self._text_comm = Comm(dist.group.WORLD, self.cfg.dist_timeout)
        return self._text_comm

    def eval_batches(self) -> Iterator[Batch]:
        if self.cfg.eval_data:
            if self._eval_loader is None:  # kept: shards are checksum-verified once, not at every evaluation
                paths = list(self.cfg.eval_data)
                self._eval_loader = Loader(paths[0] if len(paths) == 1 else paths, self.cfg.batch_size,
                                           rank=self.rank, world_size=self.world, prefetch=self.cfg.prefetch,
                                           schema=self.schema)
            yield from self._eval_loader
            return
        # read once and kept (eval_rows rows are small): the training iterator may be
        # mid-stream on the same files when an evaluation runs
        if self._eval_cache is None:
            self.loader.set_epoch(0)
            self._eval_cache = list(itertools.islice(iter(self.loader), self.holdout))
        yield from self._eval_cache


def make_source(cfg: TrainConfig, rank: int = 0, world_size: int = 1, schema: Schema | None = None) -> DataSource:
    """The run's data; `schema`: the run's (default: :func:`run_schema`)."""
    if not cfg.data:
        return SyntheticSource(cfg, rank, world_size)
    return FileSource(cfg, rank, world_size, schema if schema is not None else run_schema(cfg))


def _while_every_rank_has_one(batches: Iterator[Batch], comm) -> Iterator[Batch]:
    """The batches while every rank has one: ranks reading text take lines i % N == r in whole
    batches, so one may hold a batch more than another at the end of an epoch; that batch is left
    out (as a short one is), since every step's collectives need every rank.  One int64 all-reduce
    per step, on the default group from the training thread (the embedding exchanges have their own)."""
    for batch in itertools.chain(batches, [None]):
        if comm.all_reduce_max("end of the epoch's text", int(batch is None)):
            return
        yield batch
