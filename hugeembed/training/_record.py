"""RunRecord: what a training run keeps in a snapshot's ``extra`` (its config, where it stands, its world size).

Written by :meth:`Trainer.save`, read back by resume and ``hugeembed eval``; :meth:`RunRecord.from_dict`
checks every field, so a damaged record is a CheckpointError naming the snapshot and the field,
not a KeyError or TypeError deep in the trainer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..data import Schema
from ..errors import CheckpointError, ConfigError
from ._config import TrainConfig
from ._config_checks import ADAM_OPTIMIZERS
from ._queue import check_queue_state

__all__ = ["TrainState", "RunRecord"]

_HISTORY_KEYS = ("step", "loss", "eval_step", "auc", "logloss", "copc")


@dataclass
class TrainState:
    """Where a run stands; saved with every snapshot so a resume continues exactly here."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    loss_sum: float = 0.0  # since the last record in history
    loss_count: int = 0
    history: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in _HISTORY_KEYS})
    last_eval: dict[str, float] | None = None
    # TrainConfig.average_dense: the mean of the dense parameters over the decay phase so far
    # (in the dense optimizer's parameter order) and the steps it covers; None outside the phase
    dense_average: list[torch.Tensor] | None = None
    dense_average_steps: int = 0
    # --data-queue: the rows of the epoch in progress not trained yet ({"epoch": e, "ranges": [[a, b], ...]})
    data_queue: dict | None = None

    @torch.no_grad()
    def add_to_dense_average(self, params: list[torch.Tensor]) -> None:
        """The running mean of the dense parameters over the decay phase's steps so far (kept here, so a
        snapshot mid-phase resumes it exactly)."""
        if self.dense_average is None:
            self.dense_average, self.dense_average_steps = [p.detach().clone() for p in params], 1
            return
        self.dense_average_steps += 1
        w = 1.0 / self.dense_average_steps
        for avg, p in zip(self.dense_average, params):
            avg.lerp_(p.detach(), w)

    @torch.no_grad()
    def apply_dense_average(self, params: list[torch.Tensor]) -> None:
        """Copies the mean into the parameters and ends the phase (nothing outside one)."""
        if self.dense_average is None:
            return
        for avg, p in zip(self.dense_average, params):
            p.copy_(avg)
        self.dense_average, self.dense_average_steps = None, 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "train state") -> "TrainState":
        """Checks every field (CheckpointError naming `where` and the field), then builds the state."""
        def bad(name: str, what: str, value: Any) -> CheckpointError:
            return CheckpointError(f"{where}: train_state.{name} must be {what}, got {_short(value)}")

        if not isinstance(data, Mapping):
            raise CheckpointError(f"{where}: train_state must be a mapping, got {_short(data)}")
        names = [f.name for f in dataclasses.fields(cls)]
        if "dense_average" not in data and "dense_average_steps" not in data:
            data = {**data, "dense_average": None, "dense_average_steps": 0}  # saved before averaging existed
        if "data_queue" not in data:
            data = {**data, "data_queue": None}  # saved before --data-queue existed
        missing = [n for n in names if n not in data]
        unknown = sorted(set(map(str, data)) - set(names))
        if missing or unknown:
            raise CheckpointError(f"{where}: train_state has missing fields {missing} / unknown fields {unknown}")
        for n in ("step", "epoch", "step_in_epoch", "samples", "loss_count", "dense_average_steps"):
            v = data[n]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(n, "a non-negative integer", v)
        for n in ("train_seconds", "loss_sum"):
            if not _number(data[n]):
                raise bad(n, "a finite number", data[n])
        hist = data["history"]
        if isinstance(hist, Mapping) and set(hist) == set(_HISTORY_KEYS) - {"copc"} and isinstance(hist["auc"], list):
            # saved before COPC was recorded per evaluation: unknown (NaN) at those points
            hist = {**hist, "copc": [float("nan")] * len(hist["auc"])}
            data = {**data, "history": hist}
        if not isinstance(hist, Mapping) or set(hist) != set(_HISTORY_KEYS):
            raise bad("history", f"a mapping with keys {list(_HISTORY_KEYS)}", hist)
        for k in _HISTORY_KEYS:
            if not isinstance(hist[k], list) or not all(_number(x, finite=False) for x in hist[k]):
                raise bad(f"history.{k}", "a list of numbers", hist[k])
        if len(hist["step"]) != len(hist["loss"]) or not len(hist["eval_step"]) == len(hist["auc"]) == \
                len(hist["logloss"]) == len(hist["copc"]):
            raise bad("history", "lists of matching lengths (step/loss, eval_step/auc/logloss/copc)",
                      {k: len(v) for k, v in hist.items()})
        ev = data["last_eval"]
        if ev is not None and not (isinstance(ev, Mapping) and all(isinstance(k, str) and _number(v, finite=False)
                                                                   for k, v in ev.items())):
            raise bad("last_eval", "null or a mapping of metric names to numbers", ev)
        avg = data["dense_average"]
        if avg is not None and not (isinstance(avg, list) and all(isinstance(t, torch.Tensor) for t in avg)):
            raise bad("dense_average", "null or a list of tensors", avg)
        if (avg is None) != (data["dense_average_steps"] == 0):
            raise bad("dense_average_steps", "0 exactly when dense_average is null", data["dense_average_steps"])
        return cls(**{n: data[n] for n in names if n != "data_queue"},
                   data_queue=check_queue_state(data["data_queue"], where))


@dataclass(frozen=True)
class RunRecord:
    """A run's config, state, process count and data schema (with its fitted statistics; None: the
    built-in Criteo schema, as in snapshots written before schemas existed), as saved in ``extra``."""

    config: TrainConfig
    state: TrainState
    world_size: int = 1
    schema: Schema | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"config": self.config.to_dict(), "train_state": self.state.to_dict(), "world_size": self.world_size}
        if self.schema is not None and not self.schema.is_criteo():
            out["schema"] = self.schema.to_dict()
        return out

    @classmethod
    def from_dict(cls, extra: Any, where: str) -> "RunRecord":
        """The record in a snapshot's `extra` (`where`: the snapshot, for messages); CheckpointError if damaged."""
        if not isinstance(extra, Mapping) or "config" not in extra:
            raise CheckpointError(f"{where}: the snapshot holds no training config (was it saved by "
                                  f"`hugeembed train`?)")
        saved = extra["config"]
        if not isinstance(saved, Mapping):
            raise CheckpointError(f"{where}: config must be a mapping, got {_short(saved)}")
        saved = {k: v for k, v in saved.items() if k != "extra"}  # a field of older versions, always empty
        # configs saved before init / admit_min_count existed built their tables with TF's truncated
        # normal (std 1/sqrt(D)) and a row for every id: resume them so, not with today's defaults
        dim = saved.get("embedding_dim", 16)
        if "init" not in saved and isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
            saved["init"] = f"truncnormal:{1.0 / math.sqrt(dim)!r}"
        saved.setdefault("admit_min_count", 1)
        # saved before the training defaults of Adam's betas / eps and dense averaging: torch's
        # Adam settings and the last step's dense parameters
        if saved.get("sparse_optimizer", "adagrad") in ADAM_OPTIMIZERS:
            saved.setdefault("sparse_betas", [0.9, 0.999])
            saved.setdefault("sparse_eps", 1e-8)
        saved.setdefault("average_dense", False)
        try:
            config = TrainConfig.from_dict(saved, source=f"{where}: saved config")
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        world = extra.get("world_size", 1)
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise CheckpointError(f"{where}: world_size must be a positive integer, got {_short(world)}")
        if "train_state" not in extra:
            raise CheckpointError(f"{where}: the snapshot holds no train_state")
        schema = None
        if extra.get("schema") is not None:
            try:
                schema = Schema.from_dict(extra["schema"], source=f"{where}: saved schema")
            except ConfigError as e:
                raise CheckpointError(str(e)) from None
        return cls(config, TrainState.from_dict(extra["train_state"], where), world, schema)


def _number(v: Any, finite: bool = True) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (not finite or math.isfinite(v))


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
