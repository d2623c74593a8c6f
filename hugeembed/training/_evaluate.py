"""Scoring a model: its metrics over batches (evaluate), and a saved model's on new data or on its
run's held-out set."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import checkpoint as ckpt
from .._durable import atomic_write_text
from ..data import Loader, criteo_schema
from ..errors import InputError
from ..metrics import MetricSet
from ._record import RunRecord
from ._sources import make_source
from ._build import build_model, resolve_device

__all__ = ["evaluate", "evaluate_snapshot", "load_snapshot_model"]


def load_snapshot_model(path: str | Path, *, device: str = "auto", batch_size: int | None = None):
    """The model a run saved at `path` (a snapshot or a checkpoint root: its newest), in eval mode.

    Returns ``(model, config, info)``: the run's TrainConfig (with `device` and `batch_size`
    applied) and the :class:`~hugeembed.checkpoint.SnapshotInfo` of what was loaded; the run's data
    schema is ``model.schema`` (hugeembed.data.Schema, with its fitted statistics).
    """
    snap = Path(ckpt.read_manifest(path)["_path"])
    record = RunRecord.from_dict(ckpt.read_extra(snap), str(snap))
    saved = record.config
    changes: dict[str, Any] = {"resume": False, "checkpoint_dir": None, "device": device}
    if batch_size is not None:
        changes["batch_size"] = batch_size
    cfg = saved.replace(**changes)
    schema = record.schema or criteo_schema()
    model, _ = build_model(cfg, resolve_device(cfg.device, tiered=cfg.memory_budget is not None), schema=schema)
    info = ckpt.load(snap, model.embeddings, model=model, restore_rng=False)
    model.eval()
    model.schema = schema
    return model, cfg, info


def evaluate_snapshot(path: str | Path, *, data: Sequence[str] = (), batch_size: int | None = None,
                      device: str = "auto", predictions: str | Path | None = None) -> dict[str, Any]:
    """AUC, log loss, CTR, PCTR, COPC of the model saved at `path` (a snapshot or a checkpoint root).

    Args:
        path: snapshot directory, or checkpoint root (its newest snapshot).
        data: files (in the run's schema, saved in the snapshot) or shards to score; empty: the run's
            own held-out set (so this reproduces the run's final evaluation exactly).
        batch_size: scoring batch size (default: the run's).
        device: where to run.
        predictions: also write one click probability per scored row to this file, in input
            order (``%.9g``: float32 exactly), written atomically once all rows are scored.

    Nothing is inserted or counted: unknown ids read as zeros.
    """
    model, cfg, info = load_snapshot_model(path, device=device, batch_size=batch_size)
    dev = resolve_device(cfg.device, tiered=cfg.memory_budget is not None)
    if data:
        paths = [str(p) for p in data]
        batches = iter(Loader(paths[0] if len(paths) == 1 else paths, cfg.batch_size, prefetch=2, schema=model.schema))
        source = ", ".join(paths)
    else:
        batches = make_source(cfg, schema=model.schema).eval_batches()
        source = "the run's held-out set"
    kept: list[torch.Tensor] = []
    metrics = evaluate(model, batches, dev, keep_predictions=kept if predictions is not None else None)
    if metrics["count"] == 0:
        raise InputError(f"{source}: no rows to score")
    if predictions is not None:
        probs = torch.cat(kept).numpy() if kept else np.zeros(0, np.float32)
        atomic_write_text(Path(predictions), "".join(f"{p:.9g}\n" for p in probs.tolist()))
    return {**metrics, "step": info.step, "snapshot": str(info.path), "data": source, "model": cfg.model}


@torch.no_grad()
def evaluate(model, batches, device: torch.device, merge: Callable[[MetricSet], MetricSet] | None = None,
             keep_predictions: list[torch.Tensor] | None = None) -> dict[str, float]:
    """AUC, log loss, CTR, PCTR and COPC of `model` over `batches` (eval mode: nothing inserted).

    `keep_predictions`: a list that receives each batch's probabilities (CPU float32), in order."""
    was_training = model.training
    model.eval()
    ms = MetricSet()
    try:
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            probs = torch.sigmoid(model(batch.dense, batch.sparse))
            ms.update(probs, batch.labels)
            if keep_predictions is not None:
                keep_predictions.append(probs.float().cpu())
    finally:
        model.train(was_training)
    if merge is not None:
        ms = merge(ms)
    return ms.compute()
