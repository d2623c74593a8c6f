"""Snapshots of a ShardedEmbeddingCollection: every rank writes its shards, rank 0 commits.

Save, on N ranks::

    every rank  : a delta: checks it can write one (its collection saved or loaded the parent)
    rank 0      : create root/.tmp-step-<s>-<pid>-<id>/  ── its name to every rank
    every rank  : tables/<table>.r<rank>.<field>.npy of the rows it holds (a replicated
                  table by rank 0 only; a delta: those seen since the parent, and the keys
                  of the parent's chain it owns that are gone), rng.r<rank>.pt; each fsynced
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
from pathlib import Path
from typing import Any

import torch

from ..distributed import ShardedEmbeddingCollection
from ..errors import CheckpointError
from ._manifest import snapshot_name
from ._snapshot import dense_files, manifest_head, new_tmp_dir, prune, publish, rng_file, table_records

__all__ = ["save_sharded", "owned_filter", "rng_key"]


def save_sharded(root, collection: ShardedEmbeddingCollection, *, model=None, dense_optimizer=None,
                 step: int | None = None, extra: dict[str, Any] | None = None, keep: int | None = None,
                 rng: bool = True, delta: bool = False, run_id: str | None = None) -> Path:
    """The multi-rank :func:`hugeembed.checkpoint.save` (collective: every rank calls it).

    A delta (``delta=True`` on every rank) holds each rank's rows seen since the parent and the
    keys of its shard removed since (those of the parent's chain it owns under its plan).
    """
    from ._delta import parent_for_delta, remember

    comm, rank = collection.comm, collection.rank
    root = Path(root)
    step = collection.step if step is None else int(step)
    name = snapshot_name(step)
    parent, why_not = None, None
    if delta:  # every rank checks its own collection's lineage: one that cannot write a delta stops them all
        try:
            parent = parent_for_delta(root, collection, step)
        except CheckpointError as e:
            why_not = f"rank {rank}: {e}"
    tmp, err = None, None
    if rank == 0:
        try:
            tmp = new_tmp_dir(root, name)
        except OSError as e:
            err = f"rank 0 cannot create a snapshot directory under {root}: {e}"
    started = comm.all_gather_object("checkpoint save (start)", (tmp.name if tmp else None, err, delta, why_not))
    tmp_name, err = started[0][:2]
    if err is None and len({d for _, _, d, _ in started}) > 1:
        err = f"ranks disagree on delta: {[d for _, _, d, _ in started]} (pass the same delta= on every rank)"
    err = err or "; ".join(w for *_, w in started if w) or None
    if err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(err)
    tmp = root / tmp_name
    mine, err = None, None
    try:
        tables = table_records(collection, tmp, rank, {t.name for t in collection.tables
                                                       if collection.writes_shard(t.name)}, parent=parent)
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
                                dense_optimizer, extra, parent, run_id))
            prune(root, keep, run_id)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = f"snapshot {name} not saved: {e}"
    final, err = comm.all_gather_object("checkpoint save (commit)", (final, err))[0]
    if err:
        raise CheckpointError(err)
    remember(collection, Path(final))
    return Path(final)


def _commit(root: Path, tmp: Path, name: str, step: int, collection, records, model, dense_optimizer,
            extra, parent, run_id: str | None) -> Path:
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
    manifest = {**manifest_head(collection, step, collection.world_size, collection.plan.to_dict(), parent, run_id),
                "tables": [by_table[t.name] for t in collection.tables], "files": files}
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
        out["rows"] = collection.column_block_of(table, out["rows"])  # a column-wise rank keeps its block only
        return out

    return keep


def rng_key(collection, manifest: dict[str, Any]) -> str:
    """The RNG file a rank restores: its own when the world size is unchanged, else rank 0's."""
    if isinstance(collection, ShardedEmbeddingCollection) and manifest.get("world_size") == collection.world_size:
        key = f"rng.r{collection.rank}"
        if key in manifest.get("files", {}):
            return key
    return "rng"
