"""Artifact deltas: the rows training changed since the served snapshot, applied to a running model.

A delta is what a snapshot delta is (docs/checkpoint.md), in serving terms, and is
computed by the checkpoint module's own rule (``checkpoint.DeltaParent.changes``): the
rows whose ids were seen after the served snapshot's settled step, and the keys gone
since.  It links to the version it follows exactly as a snapshot delta links to its
parent -- the name, step and manifest sha256 of the training snapshot served::

    artifact/deltas/step-000000500/
      manifest.json   kind "delta", parent {name, step, manifest_sha256} = the served source,
                      source = the snapshot it brings the model to, tables, files + sha256
      program.pt2     the dense part at that step (small: written whole)
      tables/<table>.upsert_keys.npy  <table>.upsert_rows.npy  <table>.removed_keys.npy

Keys that became pending again (evicted, then seen since) are removed: they read zeros, or
the table's shared row when it has one, as in the training model's eval.  Applying a delta builds new tables beside the served
ones (a copy of each group's rows, keys and a hash index rebuilt for the merged keys:
after a delta they live in memory, not in the mapped files) and swaps them in with the
program in one assignment.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint as ckpt
from .._durable import sha256_file
from ..errors import CheckpointError, ConfigError
from ..training import load_snapshot_model
from . import _runtime
from ._export import (GroupSpec, check_servable, export_program, publish_dir, serving_groups, source_record,
                      write_array)
from ._model import Served, ServingModel
from ._quant import quantize, row_width

__all__ = ["export_delta", "pending_deltas", "apply_delta", "DELTAS"]

DELTAS = "deltas"


def export_delta(checkpoint: str | os.PathLike, artifact: str | os.PathLike) -> Path:
    """Writes, under ``artifact/deltas/``, the delta from the version the artifact serves (its base and
    the deltas already there) to the newest snapshot under the checkpoint root `checkpoint`.

    The served snapshot must still be under `checkpoint` (unchanged: its manifest's sha256) and
    before the newest one; tables whose optimizer moves untouched rows (global Adam) refuse: all
    their rows change every step, so export a full artifact.  Returns the delta's directory.
    """
    artifact = Path(artifact)
    served_model = ServingModel.load(artifact)
    served = served_model.served
    model, _, info = load_snapshot_model(checkpoint, device="cpu")
    ec = model.embeddings
    check_servable(ec)
    tip = Path(info.path)
    if tip.name == served.version:
        raise ConfigError(f"{artifact} already serves {tip.name}, the newest snapshot under {tip.parent}: "
                          f"no delta to write")
    moving = [t.name for t, r in zip(ec.tables, ec.rules) if r is not None and r.moves_untouched_rows]
    if moving:
        raise ConfigError(f"tables {moving} use an optimizer that moves every row each step (global Adam): a delta "
                          f"cannot hold them; export a full artifact")
    parent_dir = tip.parent / served.version
    if not (parent_dir / "manifest.json").is_file():
        raise CheckpointError(f"{artifact} serves {served.version}, which is not under {tip.parent} (pruned, or "
                              f"another run): a delta needs it; export a full artifact")
    sha = sha256_file(parent_dir / "manifest.json")
    if sha != served.source["manifest_sha256"]:
        raise CheckpointError(f"{parent_dir} changed after {artifact} was exported from it (its manifest's sha256): "
                              f"export a full artifact")
    if int(info.step) <= int(served.source["step"]):
        raise CheckpointError(f"the newest snapshot {tip.name} is not after the served {served.version}")
    parent = ckpt.DeltaParent(ckpt.resolve_chain(ckpt.read_manifest(parent_dir)), sha)
    groups = serving_groups(ec)
    if [g.__dict__ for g in groups] != [GroupSpec.from_dict(g).__dict__ for g in served_model.manifest["groups"]]:
        raise ConfigError(f"the model at {tip} reads its tables differently from {artifact}: export a full artifact")
    dtype = served_model.dtype
    deltas = artifact / DELTAS
    deltas.mkdir(exist_ok=True)
    tmp = deltas / f".tmp-{tip.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    (tmp / "tables").mkdir(parents=True)
    try:
        files: dict[str, Any] = {}
        tables = []
        for cfg, store in ec.stores():
            ex = store.export_index()
            changed, removed = parent.changes(ec, cfg.name, ex, static=cfg.num_rows is not None)
            full = store.export()  # keys ascending: the changed keys' rows are found by search
            at = torch.searchsorted(full.keys, changed.keys)
            weights = store.layout.weights(full.rows.index_select(0, at))
            gone = torch.cat([removed, changed.pending_keys]).cpu()
            files[f"upsert_keys.{cfg.name}"] = write_array(tmp, f"tables/{cfg.name}.upsert_keys.npy", changed.keys.cpu())
            files[f"upsert_rows.{cfg.name}"] = write_array(tmp, f"tables/{cfg.name}.upsert_rows.npy",
                                                           quantize(weights, dtype))
            files[f"removed_keys.{cfg.name}"] = write_array(tmp, f"tables/{cfg.name}.removed_keys.npy", gone)
            tables.append({"name": cfg.name, "upserted": int(changed.keys.numel()), "removed": int(gone.numel())})
        files["program"] = export_program(model, groups, dtype, [row_width(dtype, s.dim) for s in groups],
                                          tmp / "program.pt2")
        manifest = {"format": _runtime.FORMAT, "format_version": _runtime.FORMAT_VERSION, "kind": "delta",
                    "dtype": dtype, "created_unix": time.time(), "parent": dict(served.source),
                    "source": source_record(tip, info.manifest), "tables": tables, "files": files,
                    "features": served_model.manifest["features"], "groups": served_model.manifest["groups"]}
        ckpt.write_bytes(tmp / _runtime.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        return publish_dir(tmp, deltas / tip.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _delta_manifests(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for d in sorted((directory / DELTAS).glob("step-*")) if (directory / DELTAS).is_dir() else []:
        try:
            found.append((d, _runtime.read_manifest(d)))
        except _runtime.ArtifactError:
            continue  # not complete yet, or foreign: only a delta that links to the served one is applied
    return found


def pending_deltas(directory: Path, served: Served) -> list[Path]:
    """The deltas under ``directory/deltas`` that follow the served version, in chain order: each one's
    parent is the snapshot the one before brings the model to (the served one for the first)."""
    manifests = _delta_manifests(directory)
    chain: list[Path] = []
    source, seen = served.source, set(served.deltas)
    while True:
        nxt = [(d, m) for d, m in manifests if m.get("kind") == "delta" and d.name not in seen
               and (m.get("parent") or {}).get("manifest_sha256") == source["manifest_sha256"]]
        if not nxt:
            return chain
        d, m = nxt[0]
        chain.append(d)
        seen.add(d.name)
        source = m["source"]


def apply_delta(base_manifest: dict[str, Any], served: Served, path: Path) -> Served:
    """The served state with the delta at `path` applied (built beside `served`, which is untouched).

    ArtifactError when the delta does not follow `served` (its parent record), differs in dtype or
    layout, or any file is missing or damaged."""
    m = _runtime.read_manifest(path)
    if m["kind"] != "delta":
        raise _runtime.ArtifactError(f"{path} is not an artifact delta (kind {m['kind']!r})")
    parent = m.get("parent") or {}
    if parent.get("manifest_sha256") != served.source["manifest_sha256"]:
        raise _runtime.ArtifactError(f"{path} follows {parent.get('name')}, the model serves {served.version}: "
                                     f"apply the deltas in order")
    if m["dtype"] != base_manifest["dtype"] or m["groups"] != base_manifest["groups"]:
        raise _runtime.ArtifactError(f"{path}: dtype or table layout differs from the artifact's")
    files = m["files"]
    arrays = {k: _runtime.read_array(path / rec["file"], rec) for k, rec in files.items() if k != "program"}
    program = _runtime.load_program(path / files["program"]["file"], files["program"])
    out: list[list[torch.Tensor]] = [[], [], [], []]
    for g, group in enumerate(base_manifest["groups"]):
        spec = GroupSpec.from_dict(group)
        rows, keys, meta = served.tables.rows[g], served.tables.keys[g], served.tables.meta[g].tolist()
        parts, new_keys = [], []
        for t, name in enumerate(spec.tables):
            k = spec.table_keys[t]
            base, n, key_base = meta[t][_runtime.ROW_BASE], meta[t][_runtime.NUM], meta[t][_runtime.KEY_BASE]
            block = rows[base: base + n]
            up_k, up_r = arrays[f"upsert_keys.{name}"], arrays[f"upsert_rows.{name}"]
            if up_r.shape[1:] != rows.shape[1:]:
                raise _runtime.ArtifactError(f"{path}: table {name!r}: rows of {list(up_r.shape[1:])} columns, the "
                                             f"artifact's have {list(rows.shape[1:])}")
            if k < 0:  # static: ids are rows
                block = block.clone()
                block[up_k] = up_r
                parts.append(block)
                continue
            old = keys[key_base: key_base + n]
            keep = ~torch.isin(old, torch.cat([arrays[f"removed_keys.{name}"], up_k]))
            merged = torch.cat([old[keep], up_k])
            order = torch.argsort(merged)
            new_keys.append(merged[order])
            parts.append(torch.cat([block[keep], up_r])[order])
        # the index is rebuilt for the merged keys here, before the swap: the old tables keep their own
        built = _runtime.group_tables(group, [int(p.shape[0]) for p in parts],
                                      torch.cat([*parts, rows[-1:]]).contiguous(),
                                      torch.cat(new_keys) if new_keys else torch.zeros(0, dtype=torch.int64))
        for part, x in zip(out, built):
            part.append(x)
    return Served(_runtime.Tables(*out), program, m["source"], served.deltas + (path.name,))
