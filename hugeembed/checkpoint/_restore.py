"""Reading snapshots back: find the one to use (``LATEST``, the newest by step), read and verify its
manifest, tables and files, and load it (with a delta's chain) into a collection and model.

Everything is read and checked before anything is changed; see :func:`load`.  Writing is _snapshot.py's.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..store import EXPORT_FIELDS, StoreExport
from ._files import read_tensor, verify
from ._manifest import LATEST, MANIFEST, check_tables, is_snapshot_name, snapshot_step, validate_manifest

__all__ = ["load", "latest", "read_manifest", "read_extra", "read_table", "SnapshotInfo", "list_snapshots"]


@dataclass
class SnapshotInfo:
    """What :func:`load` restored: the snapshot's path, step, manifest and the caller's extra state."""

    path: Path
    step: int
    manifest: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def list_snapshots(root: str | os.PathLike) -> list[Path]:
    """Complete snapshots under root (those with a manifest), oldest first: by step, as a number."""
    root = Path(root)
    found = [d for d in root.glob("step-*") if is_snapshot_name(d.name) and (d / MANIFEST).exists()]
    return sorted(found, key=lambda d: snapshot_step(d.name))


def latest(root: str | os.PathLike) -> Path | None:
    """The snapshot ``root/LATEST`` names, or the newest complete one when there is no LATEST or it holds no
    snapshot name (damaged); None when there is none.

    CheckpointError when LATEST names a snapshot that is missing or incomplete (deleted, or never
    completed): another snapshot is never silently used in its place."""
    root = Path(root)
    pointer = root / LATEST
    try:
        name = pointer.read_text(errors="replace").strip()
    except OSError:  # none yet (or not a file): the newest complete one below
        name = ""
    if is_snapshot_name(name):
        if not (root / name / MANIFEST).is_file():
            raise CheckpointError(f"{pointer} names {name}, which is missing from {root} (deleted, or never "
                                  f"completed): the snapshot to use is unknown; point LATEST at it, or delete "
                                  f"LATEST to use the newest complete snapshot")
        return root / name
    snaps = list_snapshots(root)
    return snaps[-1] if snaps else None


def _resolve(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if (path / MANIFEST).exists():
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(f"{path} holds no complete snapshot (no {MANIFEST} in it or its step-* directories)")
    return found


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a snapshot (or of the newest one under a checkpoint root)."""
    snap = _resolve(path)
    try:
        manifest = json.loads((snap / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{snap / MANIFEST} is unreadable: {e}") from None
    validate_manifest(manifest, snap / MANIFEST)
    manifest["_path"] = str(snap)
    return manifest


def read_table(snap: Path, entry: dict[str, Any], rank_filter=None) -> StoreExport:
    """All shards of one table from a snapshot, verified, concatenated (of a delta: the keys seen since its parent).

    `rank_filter` (optional) maps one shard's fields ``{field: tensor}`` to the part to keep;
    it is applied shard by shard, so a rank resharding a big table never holds all of it.
    """
    from ._columns import is_column_blocks, read_column_blocks

    if is_column_blocks(entry):  # a column-wise table: one shard per block of columns, joined
        return read_column_blocks(snap, entry, rank_filter)
    parts = {f: [] for f in EXPORT_FIELDS}
    for shard in entry["shards"]:
        one = {}
        for f in EXPORT_FIELDS:
            rec = shard["files"][f]
            one[f] = read_tensor(snap / rec["file"], rec)
        if rank_filter is not None:
            one = rank_filter(one)
        for f in EXPORT_FIELDS:
            parts[f].append(one[f])
    if not parts["keys"]:
        raise CheckpointError(f"{snap}: table {entry.get('name')!r} has no shard in the manifest")
    cat = {f: torch.cat(v) if len(v) > 1 else v[0] for f, v in parts.items()}
    return StoreExport(**cat)


def _read_file(snap: Path, manifest: dict[str, Any], key: str) -> Any:
    rec = manifest["files"].get(key)
    if rec is None:
        return None
    path = snap / rec["file"]
    verify(path, rec)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad pickle
        raise CheckpointError(f"snapshot file {path} is unreadable: {e}") from None


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """The `extra` state saved with a snapshot (checksum verified), without loading anything else."""
    manifest = read_manifest(path)
    return _read_file(Path(manifest["_path"]), manifest, "extra") or {}


def load(path: str | os.PathLike, collection, *, model: torch.nn.Module | None = None,
         dense_optimizer: torch.optim.Optimizer | None = None, restore_rng: bool = True) -> SnapshotInfo:
    """Loads a snapshot (or the newest under a checkpoint root) into the given objects.

    Any snapshot loads into any collection with the same tables: one saved by N ranks into
    one process (all shards are read), into a ShardedEmbeddingCollection of M ranks or
    another plan (each rank keeps the rows it owns: rows, optimizer state, counts, last
    steps and pending keys move together).  Each rank reads the snapshot on its own.

    A delta loads with its chain: the full base's tables, then each delta's removed keys
    and changed rows in order; the dense model, optimizers, RNG and extra come from the
    delta itself (written in full).  The result is the collection as it was when the delta
    was saved, bit for bit (rows, optimizer state, counts, last steps, pending keys).

    Everything is read and verified (manifests, every link of a delta's chain, table layout,
    checksums, the removed keys of each delta, capacities) before anything is changed, so a
    bad snapshot or chain raises CheckpointError and leaves the model untouched.
    """
    from ._delta import apply_deltas, check_chain, read_delta, remember, resolve_chain, verify_files
    from ._sharded import owned_filter, rng_key

    manifest = read_manifest(path)
    snap = Path(manifest["_path"])
    chain = resolve_chain(manifest)  # [manifest] for a full snapshot
    for m in chain:
        check_tables(m, collection)
    base = chain[0]
    base_snap = Path(base["_path"])
    # a sharded collection keeps the keys it owns under ITS plan, whatever the saved layout
    exports = {t["name"]: read_table(base_snap, t, owned_filter(collection, t["name"])) for t in base["tables"]}
    deltas = [(m, read_delta(m, collection)) for m in chain[1:]]
    check_chain(collection, exports, deltas, base_snap)
    for m in chain[:-1]:  # the links' own dense files are not loaded, but a torn link is refused all the same
        verify_files(m)
    dense = _read_file(snap, manifest, "dense_model")
    dense_opt = _read_file(snap, manifest, "dense_optimizer")
    emb_opt = _read_file(snap, manifest, "embedding_optimizer")
    rng = _read_file(snap, manifest, rng_key(collection, manifest))
    extra = _read_file(snap, manifest, "extra") or {}
    if model is not None and dense is None:
        raise CheckpointError(f"{snap} holds no dense model")
    if dense_optimizer is not None and dense_opt is None:
        raise CheckpointError(f"{snap} holds no dense optimizer state")
    # all read and checked: now apply
    state = {"step": torch.tensor(manifest["collection_step"])}
    for name, ex in exports.items():
        for f in EXPORT_FIELDS:
            state[f"tables.{name}.{f}"] = getattr(ex, f)
    collection.load_state_dict(state)
    apply_deltas(collection, deltas)
    remember(collection, snap)  # a delta may follow this snapshot
    if emb_opt is not None:
        collection.optimizer.load_state_dict(emb_opt)
    if model is not None:
        _load_dense(model, collection, dense, snap)
    if dense_optimizer is not None:
        dense_optimizer.load_state_dict(dense_opt)
    if restore_rng and rng is not None:
        _set_rng_state(rng)
    return SnapshotInfo(snap, int(manifest["step"]), manifest, extra)


def _load_dense(model: torch.nn.Module, collection, state: dict[str, torch.Tensor], snap: Path) -> None:
    prefixes = [f"{n}." for n, m in model.named_modules() if m is collection]
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not any(k.startswith(p) for p in prefixes)]
    # buffers newer than some snapshots (a model's `optional_buffers`): absent, they are zero (what they were then)
    optional = set(getattr(model, "optional_buffers", ()))
    for k in [k for k in missing if k in optional]:
        model.get_buffer(k).zero_()
        missing.remove(k)
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{snap}: dense model does not match: missing {missing}, "
                              f"unexpected {list(result.unexpected_keys)}")
