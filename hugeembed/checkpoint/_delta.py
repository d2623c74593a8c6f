"""Incremental snapshots (DeepRec's incremental checkpoint): a delta holds the rows seen since its parent.

Which rows.  A row's weights, optimizer state, hit count and last step change only when
its id is seen in a training step, and the store then sets its last step to that step
(global Adam included: an untouched row stays as stored, with the step it was last brought
to, and is caught up when next seen).  So the rows that changed since a parent are the
keys, admitted or pending, whose last step is after the parent's *settled step* (its step,
or one before the oldest training graph still alive at the save: that batch's backward
may land later).  The keys removed since (ttl, capacity, norm eviction, pending keys
forgotten) are those of the parent's table -- its base plus its chain of deltas -- that
are gone now.  A key evicted and seen again since is simply written: its last step is new.
The dense model, optimizers, RNG and extra are small and written in full every time.

When a delta may follow.  Only when the collection's rows are those of the newest
snapshot plus training since: this module remembers, per collection (weakly), the
snapshot it last saved or loaded, with the sha256 of its manifest and the collection's
``tables_version`` then.  ``load_state_dict`` and ``catch_up_rows`` move that version (rows
replaced or changed without their ids being seen); another snapshot written since, or the
collection never saved/loaded, also means the next snapshot must be full.  Re-saving the
newest step (a run's final save after a periodic one at the same step) writes a delta
against the newest snapshot's own parent.

Loading a delta resolves its chain back to the full base and verifies every link first:
the parent exists, its manifest has the sha256 the child recorded, steps strictly
increase, every delta names the same base, every file's checksum; then checks that every
removed key is present where it is removed and that each table's rows fit its capacity.
Only then are the base's tables loaded (``load_state_dict``) and each delta applied in
order: ``store.remove(removed keys)``, then ``store.import_(changed rows)``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..distributed import ShardedEmbeddingCollection
from ..errors import CheckpointError
from ..store import ExportIndex, StoreExport
from ._files import read_tensor, sha256_file, verify
from ._manifest import DELTA_FORMAT_VERSION, MANIFEST, REMOVED, check_tables, is_delta, is_snapshot_name
from ._restore import latest, read_manifest, read_table

__all__ = ["DeltaParent", "remember", "parent_for_delta", "delta_parent", "resolve_chain", "snapshot_chain",
           "chain_names", "read_delta", "check_chain", "apply_deltas", "verify_files", "TableDelta"]


@dataclass(frozen=True)
class _Lineage:
    snapshot: Path  # resolved
    manifest_sha256: str
    tables_version: int


# collection -> the snapshot its rows descend from (weak: a dropped collection is forgotten)
_LINEAGE: "weakref.WeakKeyDictionary[Any, _Lineage]" = weakref.WeakKeyDictionary()


def remember(collection, snap: Path) -> None:
    """After a save or load: the collection's rows are those of `snap` (plus what training changes next)."""
    _LINEAGE[collection] = _Lineage(Path(snap).resolve(), sha256_file(Path(snap) / MANIFEST),
                                    collection.tables_version)


@dataclass(frozen=True)
class DeltaParent:
    """What a delta is written against: the parent's verified chain (base first, parent last)."""

    chain: list[dict[str, Any]]
    sha256: str  # of the parent's manifest file

    @property
    def manifest(self) -> dict[str, Any]:
        return self.chain[-1]

    @property
    def since(self) -> int:
        """Rows seen after this step are written."""
        return int(self.manifest["settled_step"])

    def manifest_fields(self) -> dict[str, Any]:
        p = self.manifest
        return {"format_version": DELTA_FORMAT_VERSION, "kind": "delta",
                "parent": {"name": Path(p["_path"]).name, "step": p["step"], "manifest_sha256": self.sha256},
                "base": Path(self.chain[0]["_path"]).name, "depth": int(p.get("depth", 0)) + 1,
                "changed_after": self.since}

    def changes(self, collection, table: str, index: ExportIndex, static: bool) -> tuple[ExportIndex, torch.Tensor]:
        """(the part of `index` seen after the parent, the keys of the parent's table gone now)."""
        changed = _seen_after(index, self.since)
        if static:  # a static table holds every key, always: nothing to remove
            return changed, torch.empty(0, dtype=torch.int64)
        before = chain_keys(self.chain, collection, table)
        now = torch.cat([index.keys, index.pending_keys]).cpu()
        return changed, before[~torch.isin(before, now)]


def _seen_after(ex: ExportIndex, step: int) -> ExportIndex:
    rows, pend = ex.last_step > step, ex.pending_last_step > step
    return ExportIndex(ex.keys[rows], ex.slots[rows], ex.counts[rows], ex.last_step[rows], ex.pending_keys[pend],
                       ex.pending_counts[pend], ex.pending_last_step[pend])


def _owned(collection, table: str, keys: torch.Tensor) -> torch.Tensor:
    """The keys of `table` this rank holds (all of them in one process)."""
    if isinstance(collection, ShardedEmbeddingCollection):
        return keys[collection.owned_mask(table, keys)]
    return keys


def _entry(manifest: dict[str, Any], table: str) -> dict[str, Any]:
    for t in manifest["tables"]:
        if t["name"] == table:
            return t
    raise CheckpointError(f"{manifest['_path']} has no table {table!r}")


def _shard_keys(snap: Path, entry: dict[str, Any], field: str, collection) -> torch.Tensor:
    """One int64 field (keys, pending_keys, removed_keys) of every shard of a table, verified, owned keys only."""
    from ._columns import key_shards  # a column-wise table's blocks hold the same keys: one block's

    parts = [_owned(collection, entry["name"], read_tensor(snap / sh["files"][field]["file"], sh["files"][field]))
             for sh in key_shards(entry)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def chain_keys(chain: list[dict[str, Any]], collection, table: str) -> torch.Tensor:
    """The keys (admitted and pending) of `table` after the base and deltas of `chain`, ascending."""
    keys = torch.empty(0, dtype=torch.int64)
    for m in chain:
        snap, entry = Path(m["_path"]), _entry(m, table)
        if is_delta(m):
            keys = keys[~torch.isin(keys, _shard_keys(snap, entry, REMOVED, collection))]
        keys = torch.cat([keys, _shard_keys(snap, entry, "keys", collection),
                          _shard_keys(snap, entry, "pending_keys", collection)]).unique()
    return keys


# -- chains ---------------------------------------------------------------------------------------------------------


def resolve_chain(tip: dict[str, Any]) -> list[dict[str, Any]]:
    """The manifests from the full base to `tip` (a validated manifest with its ``_path``), every link verified.

    CheckpointError naming the snapshot and what is wrong: a parent missing, a parent's
    manifest changed since the child was written (sha256), steps not strictly increasing,
    a parent that is the child itself or an earlier link (a cycle), a base that differs.
    """

    chain = [tip]
    seen = {Path(tip["_path"]).name}
    m = tip
    while is_delta(m):
        here = Path(m["_path"])
        link = m["parent"]
        name = link["name"]
        if name in seen:
            raise CheckpointError(f"{here}: its parent {name} is itself or a later link of its own chain (a cycle: "
                                  f"two deltas of one chain claim the same parent)")
        parent_dir = here.parent / name
        if not (parent_dir / MANIFEST).is_file():
            raise CheckpointError(f"{here} is a delta of {name}, which is missing from {here.parent} (deleted or "
                                  f"never completed): the chain to its base {m['base']} is broken")
        sha = sha256_file(parent_dir / MANIFEST)
        if sha != link["manifest_sha256"]:
            raise CheckpointError(f"{here} is a delta of {parent_dir}, whose manifest changed after the delta was "
                                  f"written (sha256 {sha[:16]}..., the delta recorded {link['manifest_sha256'][:16]}"
                                  f"...): the parent was replaced or edited")
        parent = read_manifest(parent_dir)
        if parent["step"] != link["step"]:
            raise CheckpointError(f"{here}: its parent {name} is at step {parent['step']}, the delta recorded step "
                                  f"{link['step']}")
        if parent["step"] >= m["step"]:
            raise CheckpointError(f"{here} (step {m['step']}) is out of order: its parent {name} is at step "
                                  f"{parent['step']}, not before it")
        base = parent["base"] if is_delta(parent) else name
        if base != m["base"]:
            raise CheckpointError(f"{here} names {m['base']} as its base, but its chain reaches the full snapshot "
                                  f"{base}")
        seen.add(name)
        chain.append(parent)
        m = parent
    return chain[::-1]


def snapshot_chain(path) -> list[Path]:
    """The snapshots that loading `path` (a snapshot, or the newest under a root) reads, base first.

    A full snapshot is its own chain; a delta's chain runs back to its full base, every
    link verified (see :func:`resolve_chain`).
    """

    return [Path(m["_path"]) for m in resolve_chain(read_manifest(path))]


def chain_names(snap: Path) -> set[str]:
    """Names of the snapshots `snap` needs (itself, its parents, its base), for pruning.

    Lenient: follows the parent names in the manifests as far as they lead and never raises,
    so pruning keeps what a damaged chain might still need and deletes nothing it names.
    """
    import json

    names: set[str] = set()
    here = Path(snap)
    while here.name not in names:
        names.add(here.name)
        try:
            m = json.loads((here / MANIFEST).read_text())
            parent = m["parent"]["name"] if m.get("kind") == "delta" else None
        except (OSError, ValueError, TypeError, KeyError):
            break
        if not is_snapshot_name(parent):
            break
        here = here.parent / parent
    return names


def parent_for_delta(root: Path, collection, step: int) -> DeltaParent:
    """The parent a delta of `collection` at `step` under `root` is written against; CheckpointError saying why none.

    The newest snapshot, when the collection's rows descend from it unchanged but by
    training (see the module docstring); when `step` is the newest snapshot's own step (a
    re-save), that delta's parent.
    """

    newest = latest(root)
    if newest is None:
        raise CheckpointError(f"no snapshot under {root} to write a delta against: the first snapshot must be full")
    mine = _LINEAGE.get(collection)
    if mine is None:
        raise CheckpointError(f"a delta holds the rows seen since its parent, but this collection was neither saved "
                              f"to nor loaded from a snapshot: write a full snapshot under {root} first")
    if mine.tables_version != collection.tables_version:
        raise CheckpointError(f"the collection's rows were replaced or changed outside training (load_state_dict, "
                              f"catch_up_rows or a store's import_ / scatter / remove) since {mine.snapshot}: write "
                              f"a full snapshot")
    if mine.snapshot != newest.resolve():
        raise CheckpointError(f"the newest snapshot under {root} is {newest.name}, but the collection's rows descend "
                              f"from {mine.snapshot}: a delta against {newest.name} would be wrong; write a full "
                              f"snapshot")
    sha = sha256_file(newest / MANIFEST)
    if sha != mine.manifest_sha256:
        raise CheckpointError(f"{newest} was rewritten after this collection saved or loaded it (its manifest's "
                              f"sha256 changed): write a full snapshot")
    manifest = read_manifest(newest)
    chain = resolve_chain(manifest)
    if step == manifest["step"] and is_delta(manifest):  # re-saving the newest step: the same parent
        chain, sha = chain[:-1], manifest["parent"]["manifest_sha256"]
    elif step <= manifest["step"]:
        what = "a full snapshot: re-save it in full" if step == manifest["step"] else "save a later step"
        raise CheckpointError(f"a delta at step {step} needs a parent before it; the newest snapshot {newest.name} "
                              f"is at step {manifest['step']} ({what})")
    parent = chain[-1]
    if "settled_step" not in parent:
        raise CheckpointError(f"{parent['_path']} was written by a hugeembed without incremental snapshots (no "
                              f"settled_step in its manifest): it cannot be a delta's parent; write a full snapshot")
    for m in chain:
        check_tables(m, collection)
    return DeltaParent(chain, sha)


def delta_parent(root, collection, step: int | None = None) -> Path | None:
    """The snapshot a delta of `collection` saved under `root` now (at `step`, default the
    collection's) would name as its parent, or None when the next snapshot must be full
    (``save(..., delta=True)`` then raises, saying why).

    Example::

        parent = checkpoint.delta_parent("runs/x", ec)
        checkpoint.save("runs/x", ec, delta=parent is not None)
    """
    try:
        found = parent_for_delta(Path(root), collection, collection.step if step is None else int(step))
    except CheckpointError:
        return None
    return Path(found.manifest["_path"])


# -- loading --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableDelta:
    """One table's part of a delta, as this rank keeps it: the rows seen since the parent and the keys gone."""

    changed: StoreExport
    removed: torch.Tensor


def read_delta(manifest: dict[str, Any], collection) -> dict[str, TableDelta]:
    """Every table of a delta (all shards, verified; a sharded collection keeps the keys it owns)."""
    from ._sharded import owned_filter

    snap = Path(manifest["_path"])
    return {t["name"]: TableDelta(read_table(snap, t, owned_filter(collection, t["name"])),
                                  _shard_keys(snap, t, REMOVED, collection)) for t in manifest["tables"]}


def verify_files(manifest: dict[str, Any]) -> None:
    """Checksums of the dense, optimizer, RNG and extra files of a snapshot whose tables alone are read."""
    snap = Path(manifest["_path"])
    for rec in manifest["files"].values():
        verify(snap / rec["file"], rec)


def check_chain(collection, base: dict[str, StoreExport], deltas: list[tuple[dict, dict[str, TableDelta]]],
                base_path: Path) -> None:
    """Before anything changes: every removed key is present where it is removed, and every table's rows fit
    its capacity after the base and after each delta (CheckpointError naming snapshot, table and key)."""
    for cfg, store in collection.stores():
        rows, pending = base[cfg.name].keys.cpu(), base[cfg.name].pending_keys.cpu()
        _check_fits(store, cfg.name, rows.numel(), base_path)
        for manifest, tables in deltas:
            d = tables[cfg.name]
            gone, new_rows, new_pending = d.removed, d.changed.keys.cpu(), d.changed.pending_keys.cpu()
            absent = gone[~torch.isin(gone, torch.cat([rows, pending]))]
            if absent.numel():
                raise CheckpointError(f"{manifest['_path']}: table {cfg.name!r}: the delta removes key "
                                      f"{int(absent[0])}, which its parent does not hold ({absent.numel()} such keys): "
                                      f"the chain is inconsistent")
            rows = torch.cat([rows[~torch.isin(rows, torch.cat([gone, new_pending]))], new_rows]).unique()
            pending = torch.cat([pending[~torch.isin(pending, torch.cat([gone, new_rows]))], new_pending]).unique()
            _check_fits(store, cfg.name, rows.numel(), Path(manifest["_path"]))


def _check_fits(store, table: str, rows: int, snap: Path) -> None:
    cap = getattr(store, "capacity", None)
    if cap is not None and rows > cap:
        raise CheckpointError(f"table {table!r}: {snap} holds {rows} rows here, more than the table's capacity "
                              f"{cap}: build the table with a capacity of at least {rows}")


def apply_deltas(collection, deltas: list[tuple[dict, dict[str, TableDelta]]]) -> None:
    """Applies checked deltas, in order, to the tables the base was just loaded into."""
    for _, tables in deltas:
        for cfg, store in collection.stores():
            d = tables[cfg.name]
            if d.removed.numel():
                store.remove(d.removed.to(store.device))
            if d.changed.keys.numel() or d.changed.pending_keys.numel():
                store.import_(d.changed)
