"""Choosing a run's number of passes on a held-out tail of its training rows (``choose_epochs``).

A trial run trains the run's model on all but the tail of the training data, one pass at a time, and scores
the tail after each pass; the run then makes the best trial's number of passes over all of it.  The tail is
the last rows of the data (in file order: the rows nearest a later test period when the data drift over
time), whole batches, and the trial never trains on them.  As the plain-PyTorch reference of
bench/quality.py --schema chooses its epochs (docs/quality.md).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from ..data import Batch, Loader, Schema
from ..errors import ConfigError
from ._config import TrainConfig
from ._sources import DataSource, FileSource

__all__ = ["TailSource", "EpochChoice", "choose_epochs"]

# the trial stops after this many passes without a better tail AUC (the reference's patience)
PATIENCE = 2


class TailSource(DataSource):
    """The training data of `cfg` split in two: batches ``[head, n - h)`` train, the last ``h`` batches are
    held out (``h = max(1, round(fraction * (n - head)))``, of the data's ``n`` whole batches of
    ``cfg.batch_size`` rows; rows after the last whole batch are read by neither, as a run drops them).
    `head`: the first batches, which neither side reads (the run's own evaluation rows when it has no
    eval data)."""

    def __init__(self, cfg: TrainConfig, schema: Schema, fraction: float, head: int = 0) -> None:
        self.cfg = cfg
        paths = list(cfg.data)
        self.loader = Loader(paths[0] if len(paths) == 1 else paths, cfg.batch_size, drop_last=True, seed=cfg.seed,
                             prefetch=cfg.prefetch, schema=schema)
        if self.loader.shards is not None:
            batches = len(self.loader)
        else:  # a text file's line count may differ from its rows (quoted newlines): count the batches read
            self.loader.set_epoch(0)
            batches = sum(1 for _ in self.loader)
        self.head = head
        self.tail = max(1, round(fraction * (batches - head)))
        if batches - head - self.tail < 1:
            raise ConfigError(f"choose-epochs: {', '.join(paths)} has {batches} batch(es) of {cfg.batch_size} rows: "
                              f"too few to hold out a tail and train on the rest (give more data or a smaller "
                              f"--batch-size, or --epochs)")
        self._stop = batches - self.tail
        self.steps_per_epoch = self.estimated_steps_per_epoch = self._stop - head
        self.description = f"data {', '.join(paths)}, batches {head} to {self._stop - 1} (the last {self.tail} held out)"
        self._tail_cache: list[Batch] | None = None

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        self.loader.set_epoch(epoch)
        return itertools.islice(iter(self.loader), self.head + skip, self._stop)

    def eval_batches(self) -> Iterator[Batch]:
        if self._tail_cache is None:
            self.loader.set_epoch(0)
            self._tail_cache = list(itertools.islice(iter(self.loader), self._stop, None))
        yield from self._tail_cache


@dataclass(frozen=True)
class EpochChoice:
    """The trial's outcome: the chosen passes and the tail's AUC after each pass it made."""

    epochs: int
    tail_auc: tuple[float, ...]
    tail_batches: int

    def message(self) -> str:
        aucs = ", ".join(f"{a:.4f}" for a in self.tail_auc)
        return (f"choose-epochs: {self.epochs} pass(es) (held-out tail of {self.tail_batches} batch(es), AUC after "
                f"each trial pass: {aucs})")


def choose_epochs(cfg: TrainConfig, schema: Schema) -> EpochChoice:
    """Up to ``cfg.choose_epochs`` trial passes over all but the last ``cfg.choose_holdout`` of the training
    batches (and, without eval data, but the run's own held-out first batches), with constant learning rates and the last step's dense layers (the count, not the schedule, is
    chosen); stops after PATIENCE passes without a better tail AUC.  Seeded as the run."""
    from ._trainer import Trainer

    if not cfg.data:
        raise ConfigError("choose-epochs holds out a tail of --data: the synthetic generator has none (give --steps)")
    # without eval data the run evaluates on its first batches: the trial reads neither them nor the tail
    head = 0 if cfg.eval_data else FileSource(cfg, schema=schema).holdout
    source = TailSource(cfg, schema, cfg.choose_holdout, head)
    trial = cfg.replace(choose_epochs=None, steps=None, epochs=cfg.choose_epochs, eval_data=(), eval_every=0,
                        lr_decay=0.0, average_dense=False, checkpoint_dir=None, checkpoint_every=0, resume=False,
                        overwrite=False)
    trainer = Trainer(trial, source=source)
    aucs: list[float] = []
    best = 0
    for epoch in range(trial.epochs):
        for batch in source.train_batches(epoch):
            trainer._train_step(batch)
        aucs.append(trainer.evaluate()["auc"])
        if aucs[-1] > aucs[best]:
            best = epoch
        elif epoch - best >= PATIENCE:
            break
    return EpochChoice(best + 1, tuple(aucs), source.tail)
