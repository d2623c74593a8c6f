"""Atomic, checksummed snapshots of embedding tables, the dense model, optimizers and RNG.

Layout of a checkpoint root::

    root/
      LATEST                      name of the newest complete snapshot (atomically replaced)
      step-000001000/             one complete snapshot, never modified once renamed in
        manifest.json             format version, kind, step, tables (dim, rows, optimizer,
                                  files + sha256), dense files, world size, plan (_manifest.py)
        tables/<table>.r<rank>.<field>.npy   keys, rows (weights + optimizer state), counts,
                                  last_step, pending keys/counts/last_step, per shard
                                  (a delta: the keys seen since its parent, + removed_keys)
        dense_model.pt  dense_optimizer.pt  embedding_optimizer.pt  rng.pt  extra.pt
      .tmp-step-000002000-<pid>-<id>/   a save in progress (or one that crashed): ignored

A save writes everything into a hidden directory beside the target, fsyncs every
file and the directory, renames it into place and then replaces LATEST: a crash at
any point leaves the previous snapshot complete and LATEST pointing at it.

A snapshot is full or a *delta* (``save(..., delta=True)``): only the rows seen since its
parent, the keys removed since, and the dense state in full.  Loading a delta applies its
chain of parents from the full base; pruning keeps every snapshot a kept delta needs.
See _delta.py.

A snapshot names the run that wrote it (``run_id`` in its manifest): pruning removes only
the pruning run's own snapshots, and a save never replaces another run's ``step-N``.
Snapshots sort by their step as a number (``step-1000000000`` after ``step-999999999``).

This module writes; _restore.py finds, reads, verifies and loads.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._durable import process_alive
from ..errors import CheckpointError
from ..store import EXPORT_FIELDS, ExportIndex
from ._files import atomic_write_text, fsync_dir, write_bytes, write_rows, write_tensor
from ._manifest import FORMAT_VERSION, LATEST, MANIFEST, REMOVED, snapshot_name
from ._restore import list_snapshots
from ._runs import describe_run, run_of

__all__ = ["save", "FORMAT_VERSION", "publish", "prune"]


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "python": random.getstate(),
    }


def _row_source(store):
    """Where a snapshot reads a store's rows from: ``[R, W]`` rows indexed by ``export_index().slots``
    (its storage, or a tiered table's ``row_source()``: rows from its cache and its file on disk).

    Every read of rows for a snapshot (full or delta) goes through here.
    """
    source = getattr(store, "row_source", None)
    return source() if source is not None else store.storage()


def table_records(collection, directory: Path, rank: int = 0, tables: set[str] | None = None,
                  parent=None) -> list[dict[str, Any]]:
    """Writes this rank's shard of every table (or of `tables`) under directory/tables; returns manifest entries.

    With `parent` (a _delta.DeltaParent) only the keys seen since it are written, plus the
    keys removed since (``removed_keys``).
    """
    (directory / "tables").mkdir(exist_ok=True)
    out = []
    # a sharded collection's column-wise tables come as this rank's block of columns
    save = getattr(collection, "stores_to_save", None)
    for cfg, store in (save(parent is not None) if save is not None else collection.stores()):
        if tables is not None and cfg.name not in tables:
            continue
        ex = store.export_index()  # rows are streamed from the storage: no copy of the table
        removed = None
        if parent is not None:
            ex, removed = parent.changes(collection, cfg.name, ex, static=cfg.num_rows is not None)
        shard = {"rank": rank, "rows": int(ex.keys.numel()), "pending": int(ex.pending_keys.numel()),
                 "files": _write_shard(directory, f"{cfg.name}.r{rank}", store, ex, removed)}
        if removed is not None:
            shard["removed"] = int(removed.numel())
        if getattr(store, "columns", None) is not None:  # one block of a column-wise table (_columns.py)
            shard["columns"] = dict(store.columns)
        rule = collection.rules[collection._table_index(cfg.name)]
        out.append({
            "name": cfg.name, "dim": cfg.dim, "num_rows": cfg.num_rows, "width": store.width,
            "state_width": store.state_width, "dtype": str(store.dtype).removeprefix("torch."),
            # rows are written raw: a reader needs the layout that packed them
            "state_dtype": store.layout.describe()["state_dtype"],
            "stochastic_rounding": store.layout.stochastic_rounding,
            # rows created after a resume must start as they would have: same initializer and seed
            "seed": int(store.seed), "initializer": repr(store.initializer),
            "optimizer": None if rule is None else rule.to_dict(), "shards": [shard],
        })
        stats = getattr(store, "cache_stats", None)
        if stats is not None:  # a tiered table: its cache figures at the save (hugeembed inspect shows them)
            out[-1]["tier"] = {k: v for k, v in stats().items()}
    return out


def _write_shard(directory: Path, stem: str, store, ex: ExportIndex, removed: torch.Tensor | None
                 ) -> dict[str, Any]:
    """The files of one table shard: the fields of `ex` (rows read through _row_source) and `removed`."""
    files = {}
    fields = {f: getattr(ex, f) for f in EXPORT_FIELDS if f != "rows"}
    if removed is not None:
        fields[REMOVED] = removed
    for f in (*EXPORT_FIELDS, *([REMOVED] if removed is not None else [])):
        path = directory / "tables" / f"{stem}.{f}.npy"
        files[f] = write_rows(path, _row_source(store), ex.slots) if f == "rows" else write_tensor(path, fields[f])
        files[f]["file"] = f"tables/{path.name}"
    return files


_TMP_PID = re.compile(r"\.tmp-.*-([0-9]+)-[0-9a-f]{8}")  # .tmp-<name>-<pid>-<id>, .tmp-old-<name>-<pid>-<id>


def _remove_stale_tmp(root: Path) -> None:
    """Deletes temp directories of saves whose process is gone (crashed mid-save)."""
    for d in root.glob(".tmp-*"):
        m = _TMP_PID.fullmatch(d.name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and not process_alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def save(root: str | os.PathLike, collection, *, model: torch.nn.Module | None = None,
         dense_optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
         extra: dict[str, Any] | None = None, keep: int | None = None, rng: bool = True,
         delta: bool = False, run_id: str | None = None) -> Path:
    """Saves a complete, atomic snapshot under `root` and returns its directory.

    Args:
        root: checkpoint directory (created if needed); the snapshot goes to
            ``root/step-<step>`` and ``root/LATEST`` then names it.
        collection: the EmbeddingCollection (tables: keys, weights, optimizer state, counts).
        model: the dense model (its ``state_dict``; embedding tables inside it are saved
            from `collection`, not twice).
        dense_optimizer: the torch optimizer of the dense parameters.
        step: the training step (default: the collection's).
        extra: more state to keep (lr scheduler state, data position...): plain data/tensors.
        keep: keep only the newest `keep` snapshots of this run (`run_id`; None: keep all), and
            every snapshot that a kept delta needs (its parents up to its full base): a delta
            alone loads nothing.  Other runs' snapshots are never removed.
        rng: save torch/CUDA/NumPy/Python RNG states (for bit-identical resume).
        delta: write only the table rows whose ids were seen since the newest snapshot under
            `root` (admitted and pending) and the keys removed since; the dense model,
            optimizers, RNG and `extra` in full.  CheckpointError (before anything is written)
            when no delta can follow: no snapshot yet, the collection did not save or load
            the newest one, its rows were replaced since (``load_state_dict``,
            ``catch_up_rows``), or its tables differ.  :func:`delta_parent` asks first.
        run_id: the run writing (recorded in the manifest): pruning removes only its snapshots, and
            a ``step-N`` of another run is never replaced (CheckpointError).  None: the snapshots
            that have none (written by a program that does not name its runs).

    Example::

        save("runs/x", ec, model=model, dense_optimizer=opt, step=1000)              # full
        save("runs/x", ec, model=model, dense_optimizer=opt, step=1100, delta=True)  # rows seen since 1000
        load("runs/x", ec2, model=model2)   # step-1000, then the delta: the state at step 1100
    """
    from ..distributed import ShardedEmbeddingCollection

    if isinstance(collection, ShardedEmbeddingCollection):
        from ._sharded import save_sharded

        return save_sharded(root, collection, model=model, dense_optimizer=dense_optimizer, step=step, extra=extra,
                            keep=keep, rng=rng, delta=delta, run_id=run_id)
    from ._delta import parent_for_delta, remember

    root = Path(root)
    step = collection.step if step is None else int(step)
    parent = parent_for_delta(root, collection, step) if delta else None  # checked before anything is written
    name = snapshot_name(step)
    tmp = new_tmp_dir(root, name)
    try:
        tables = table_records(collection, tmp, parent=parent)
        files = dense_files(tmp, collection, model, dense_optimizer, extra)
        if rng:
            files["rng"] = rng_file(tmp)
        manifest = {**manifest_head(collection, step, 1, None, parent, run_id), "tables": tables, "files": files}
        final = publish(root, tmp, name, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remember(collection, final)
    prune(root, keep, run_id)
    return final


def manifest_head(collection, step: int, world_size: int, plan: dict | None, parent, run_id: str | None
                  ) -> dict[str, Any]:
    """A manifest's fields but its tables and files; a delta's name its parent (`parent`, a DeltaParent)."""
    from .. import __version__

    head = {"format_version": FORMAT_VERSION, "kind": "full", "hugeembed_version": __version__, "step": step,
            "created_unix": time.time(), "world_size": world_size, "plan": plan, "collection_step": collection.step,
            # rows last seen at or before it change only when seen again: what a delta after this one holds
            "settled_step": collection.settled_step(), "depth": 0}
    if run_id is not None:
        head["run_id"] = run_id
    if parent is not None:
        head.update(parent.manifest_fields())
    return head


def new_tmp_dir(root: Path, name: str) -> Path:
    """A fresh hidden directory beside the snapshots for a save in progress (crashed ones are removed)."""
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root)
    tmp = root / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def dense_files(tmp: Path, collection, model, dense_optimizer, extra) -> dict[str, Any]:
    """Writes the dense model, the optimizers' state and `extra` into tmp; returns their records."""
    files: dict[str, Any] = {}
    if model is not None:
        files["dense_model"] = write_bytes(tmp / "dense_model.pt", _torch_bytes(_dense_state(model, collection)))
    if dense_optimizer is not None:
        files["dense_optimizer"] = write_bytes(tmp / "dense_optimizer.pt", _torch_bytes(dense_optimizer.state_dict()))
    files["embedding_optimizer"] = write_bytes(tmp / "embedding_optimizer.pt",
                                               _torch_bytes(collection.optimizer.state_dict()))
    if extra is not None:
        files["extra"] = write_bytes(tmp / "extra.pt", _torch_bytes(extra))
    return files


def rng_file(tmp: Path, name: str = "rng.pt") -> dict[str, Any]:
    return write_bytes(tmp / name, _torch_bytes(_rng_state()))


def publish(root: Path, tmp: Path, name: str, manifest: dict[str, Any]) -> Path:
    """Writes the manifest, fsyncs, renames tmp into place and points LATEST at it (the commit point)."""
    write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    if (tmp / "tables").exists():
        fsync_dir(tmp / "tables")
    fsync_dir(tmp)
    final = root / name
    if final.exists():  # re-saving a step: move the old one aside, swap, then delete it
        theirs = run_of(final)
        if theirs != manifest.get("run_id"):
            raise CheckpointError(f"{final} was written by another run ({describe_run(theirs)}), not by this one "
                                  f"({describe_run(manifest.get('run_id'))}): it is not replaced; give this run its "
                                  f"own checkpoint directory")
        trash = root / f".tmp-old-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, name + "\n")
    return final


def prune(root: Path, keep: int | None, run_id: str | None = None) -> None:
    """Deletes all but the newest `keep` snapshots of run `run_id`, and never one that a kept snapshot's
    chain needs (a delta's parents and base, of any run).  Other runs' snapshots are never deleted."""
    if keep is None or keep <= 0:
        return
    from ._delta import chain_names

    snaps = list_snapshots(root)
    mine = [s for s in snaps if run_of(s) == run_id]
    doomed = mine[:-keep]
    kept = [s for s in snaps if s not in doomed]
    needed = set().union(*(chain_names(s) for s in kept))
    for old in doomed:
        if old.name not in needed:
            shutil.rmtree(old, ignore_errors=True)


def _dense_state(model: torch.nn.Module, collection) -> dict[str, torch.Tensor]:
    """The model's state_dict without the embedding tables (saved separately, per shard)."""
    with collection.tables_left_out_of_state_dict():
        return model.state_dict()

