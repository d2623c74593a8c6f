"""Scoring a saved model: the metrics of a snapshot on new data or on its run's held-out set."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .. import checkpoint as ckpt
from ..data import Loader
from ..errors import InputError
from ._record import RunRecord
from ._sources import make_source
from ._trainer import build_model, evaluate, resolve_device

__all__ = ["evaluate_snapshot"]


def evaluate_snapshot(path: str | Path, *, data: Sequence[str] = (), batch_size: int | None = None,
                      device: str = "auto") -> dict[str, Any]:
    """AUC, log loss, CTR, PCTR, COPC of the model saved at `path` (a snapshot or a checkpoint root).

    Args:
        path: snapshot directory, or checkpoint root (its newest snapshot).
        data: Criteo files or shards to score; empty: the run's own held-out set (so this
            reproduces the run's final evaluation exactly).
        batch_size: scoring batch size (default: the run's).
        device: where to run.

    Nothing is inserted or counted: unknown ids read as zeros.
    """
    snap = Path(ckpt.read_manifest(path)["_path"])
    saved = RunRecord.from_dict(ckpt.read_extra(snap), str(snap)).config
    changes: dict[str, Any] = {"resume": False, "checkpoint_dir": None, "device": device}
    if batch_size is not None:
        changes["batch_size"] = batch_size
    cfg = saved.replace(**changes)
    dev = resolve_device(cfg.device)
    model, _ = build_model(cfg, dev)
    info = ckpt.load(snap, model.embeddings, model=model, restore_rng=False)
    if data:
        paths = [str(p) for p in data]
        batches = iter(Loader(paths[0] if len(paths) == 1 else paths, cfg.batch_size, prefetch=2))
        source = ", ".join(paths)
    else:
        batches = make_source(cfg).eval_batches()
        source = "the run's held-out set"
    metrics = evaluate(model, batches, dev)
    if metrics["count"] == 0:
        raise InputError(f"{source}: no rows to score")
    return {**metrics, "step": info.step, "snapshot": str(info.path), "data": source, "model": cfg.model}
