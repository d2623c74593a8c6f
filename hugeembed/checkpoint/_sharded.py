"""Snapshots of a ShardedEmbeddingCollection: every rank writes its shards, rank 0 commits.

Save, on N ranks::

    rank 0      : create root/.tmp-step-<s>-<pid>-<id>/  ── its name to every rank
    every rank  : tables/<table>.r<rank>.<field>.npy of the rows it holds (a replicated
                  table by rank 0 only), rng.r<rank>.pt; each file fsynced
    all-gather  : every rank's file records (or its error)
    rank 0      : dense model + optimizers + extra, manifest (world size, plan, each table's
                  shards of every rank), fsync, rename into place, LATEST  (the commit point)
    all-gather  : the outcome, so every rank returns the same path or raises

A rank dying at any point leaves the previous snapshot untouched (the others stop with
a ShardingError at the next collective).  Loading needs no collective: each rank reads
every shard and keeps the keys it owns under its own plan (see ``load``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ..distributed import ShardedEmbeddingCollection
from ..errors import CheckpointError
from ._snapshot import (FORMAT_VERSION, _snapshot_name, dense_files, new_tmp_dir, prune, publish, rng_file,
                        table_records)

__all__ = ["save_sharded", "owned_filter", "rng_key"]


def save_sharded(root, collection: ShardedEmbeddingCollection, *, model=None, dense_optimizer=None,
                 step: int | None = None, extra: dict[str, Any] | None = None, keep: int | None = None,
                 rng: bool = True) -> Path:
    """The multi-rank :func:`hugeembed.checkpoint.save` (collective: every rank calls it)."""
    comm, rank = collection.comm, collection.rank
    root = Path(root)
    step = collection.step if step is None else int(step)
    name = _snapshot_name(step)
    tmp, err = None, None
    if rank == 0:
        try:
            tmp = new_tmp_dir(root, name)
        except OSError as e:
            err = f"rank 0 cannot create a snapshot directory under {root}: {e}"
    tmp_name, err = comm.all_gather_object("checkpoint save (start)", (tmp.name if tmp else None, err))[0]
    if err:
        raise CheckpointError(err)
    tmp = root / tmp_name
    mine, err = None, None
    try:
        tables = table_records(collection, tmp, rank, {t.name for t in collection.tables
                                                       if collection.writes_shard(t.name)})
        files = {f"rng.r{rank}": rng_file(tmp, f"rng.r{rank}.pt")} if rng else {}
        mine = (tables, files)
    except Exception as e:  # reported to every rank below; the snapshot is then abandoned
        err = f"rank {rank} could not write its shards: {type(e).__name__}: {e}"
    try:
        everyone = comm.all_gather_object("checkpoint save (shards written)", (mine, err))
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    errors = [e for _, e in everyone if e]
    final, err = None, None
    if rank == 0:
        try:
            if errors:
                raise CheckpointError("; ".join(errors))
            final = str(_commit(root, tmp, name, step, collection, [m for m, _ in everyone], model,
                                dense_optimizer, extra))
            prune(root, keep)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = f"snapshot {name} not saved: {e}"
    final, err = comm.all_gather_object("checkpoint save (commit)", (final, err))[0]
    if err:
        raise CheckpointError(err)
    return Path(final)


def _commit(root: Path, tmp: Path, name: str, step: int, collection, records, model, dense_optimizer,
            extra) -> Path:
    from .. import __version__

    by_table: dict[str, dict[str, Any]] = {}
    files: dict[str, Any] = {}
    for tables, rank_files in records:  # rank order: shards listed rank by rank
        files.update(rank_files)
        for entry in tables:
            merged = by_table.setdefault(entry["name"], {**entry, "shards": []})
            merged["shards"].extend(entry["shards"])
    missing = [t.name for t in collection.tables if t.name not in by_table]
    if missing:
        raise CheckpointError(f"no rank wrote tables {missing} (internal error)")
    files.update(dense_files(tmp, collection, model, dense_optimizer, extra))
    if "rng.r0" in files:
        files["rng"] = files["rng.r0"]  # what a single process restores
    manifest = {
        "format_version": FORMAT_VERSION, "hugeembed_version": __version__, "step": step,
        "created_unix": time.time(), "world_size": collection.world_size, "plan": collection.plan.to_dict(),
        "collection_step": collection.step, "tables": [by_table[t.name] for t in collection.tables],
        "files": files,
    }
    return publish(root, tmp, name, manifest)


def owned_filter(collection, table: str):
    """For read_table: keeps the keys of one shard that `collection` holds (None: keep everything)."""
    if not isinstance(collection, ShardedEmbeddingCollection):
        return None

    def keep(fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = collection.owned_mask(table, fields["keys"])
        pend = collection.owned_mask(table, fields["pending_keys"])
        out = {}
        for f, t in fields.items():
            out[f] = t[pend] if f.startswith("pending") else t[rows]
        return out

    return keep


def rng_key(collection, manifest: dict[str, Any]) -> str:
    """The RNG file a rank restores: its own when the world size is unchanged, else rank 0's."""
    if isinstance(collection, ShardedEmbeddingCollection) and manifest.get("world_size") == collection.world_size:
        key = f"rng.r{collection.rank}"
        if key in manifest.get("files", {}):
            return key
    return "rng"
