"""Artifact deltas: the rows and dense weights training changed since the served snapshot, as plain arrays.

A delta is what a snapshot delta is (docs/checkpoint.md), in serving terms, computed by the
checkpoint module's own rule (``checkpoint.DeltaParent.changes``): the rows whose ids were seen
after the served snapshot's settled step, and the keys gone since.  It links to the version it
follows as a snapshot delta links to its parent -- the name, step and manifest sha256 of the
training snapshot served::

    artifact/deltas/step-000000500/
      manifest.json   kind "delta", delta_format 2, parent {name, step, manifest_sha256} = the
                      served source, source = the snapshot it brings the model to, tables, files + sha256
      manifest.sig    with --delta-key: HMAC-SHA256 of manifest.json (see _trust.py)
      tables/<table>.upsert_keys.npy  <table>.upsert_rows.npy  <table>.removed_keys.npy
      dense/<weight>.npy   the dense program's weights at that step, by name

**A delta is data.**  Nothing in it is unpickled or executed: arrays are ``.npy`` files read with
``allow_pickle=False``, checked against the manifest (shape, dtype, sha256) and against the base
artifact (its tables, dtype, groups; its program's weights: same names, shapes, dtypes), and the
dense weights are assigned to a fresh module of the **base artifact's** program (the code the
operator deployed).  A delta of another model structure is refused.  Deltas written before this
format carried a ``program.pt2`` (code, unpickled by ``torch.export.load``): refused.  Keys that
became pending again (evicted, then seen since) are removed: they read zeros, or the table's
shared row, as in the training model's eval.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint as ckpt
from .._durable import fsync_write, sha256_file
from ..checkpoint._manifest import is_snapshot_name, snapshot_step
from ..errors import CheckpointError, ConfigError
from ..training import load_snapshot_model
from . import _runtime, _trust
from ._export import GroupSpec, check_servable, dense_spec, dense_state, publish_dir, serving_groups, source_record, \
    write_array
from ._quant import quantize, row_width, storage_dtype

__all__ = ["export_delta", "DELTAS", "DELTA_FORMAT", "DeltaHeader", "DeltaData", "scan_deltas", "read_header",
           "read_delta", "served_chain"]

DELTAS = "deltas"
DELTA_FORMAT = 2  # 2: rows and dense weights as plain arrays (1, unversioned: the dense part as a program)
_ARRAY_FIELDS = ("upsert_keys", "upsert_rows", "removed_keys")


@dataclass(frozen=True)
class DeltaHeader:
    """A delta directory and its manifest (None, with the reason, when it cannot be read or trusted)."""

    path: Path
    manifest: dict[str, Any] | None
    error: str | None = None

    @property
    def parent_sha(self) -> str | None:
        parent = (self.manifest or {}).get("parent")
        return parent.get("manifest_sha256") if isinstance(parent, dict) else None


@dataclass(frozen=True)
class DeltaData:
    """A delta's arrays, read, verified and checked against the base artifact (copies, not file maps)."""

    path: Path
    manifest: dict[str, Any]
    upserts: dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (keys, rows in the artifact's format)
    removed: dict[str, torch.Tensor]  # table -> keys
    dense: dict[str, torch.Tensor]  # the program's weights by name

    @property
    def nbytes(self) -> int:
        tensors = [*(t for kr in self.upserts.values() for t in kr), *self.removed.values(), *self.dense.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


# -- finding deltas ---------------------------------------------------------------------------------------------


def read_header(path: Path, key: bytes | None, *, strict: bool = True) -> DeltaHeader:
    """The manifest of the delta at `path`; `strict`: its directory and manifest trusted (_trust); with a `key`,
    its signature checked.  Never raises: a delta that cannot be read carries the reason."""
    try:
        if strict:
            _trust.check_dir(path)
            raw = _trust.check_file(path, _runtime.MANIFEST).read_bytes()
        else:
            if path.is_symlink():
                raise _runtime.ArtifactError(f"{path} is a symbolic link: refused")
            raw = (path / _runtime.MANIFEST).read_bytes()
        if key is not None:
            _trust.check_signature(path, raw, key)
        m = _runtime.parse_manifest(raw, path / _runtime.MANIFEST)
        if m["kind"] != "delta":
            raise _runtime.ArtifactError(f"{path} is not an artifact delta (kind {m['kind']!r})")
        return DeltaHeader(path, m)
    except (_runtime.ArtifactError, OSError) as e:
        return DeltaHeader(path, None, str(e).splitlines()[0])


def scan_deltas(directory: Path, key: bytes | None, *, skip: tuple[str, ...] = (), strict: bool = True
                ) -> list[DeltaHeader]:
    """The deltas under ``directory/deltas`` but `skip`, by step (a number); ArtifactError when the deltas
    directory itself is not trusted (`strict`)."""
    root = directory / DELTAS
    if not os.path.lexists(root):
        return []
    if strict:
        _trust.check_dir(root)
    names = sorted((d.name for d in root.iterdir() if is_snapshot_name(d.name) and d.name not in skip),
                   key=snapshot_step)
    return [read_header(root / n, key, strict=strict) for n in names]


def served_chain(directory: Path, base: dict[str, Any], key: bytes | None, *, strict: bool = True
                 ) -> list[DeltaHeader]:
    """The deltas that follow the base, link after link, as their manifests say (nothing else is read)."""
    headers = scan_deltas(directory, key, strict=strict)
    chain, source = [], base["source"]
    while True:
        nxt = next((h for h in headers if h.manifest is not None and h.parent_sha == source.get("manifest_sha256")
                    and h not in chain), None)
        if nxt is None:
            return chain
        chain.append(nxt)
        source = nxt.manifest.get("source") or {}


# -- reading one -------------------------------------------------------------------------------------------------


def _fail(path: Path, what: str) -> _runtime.ArtifactError:
    return _runtime.ArtifactError(f"delta {path}: {what}")


def _array(path: Path, rec: Any, strict: bool) -> torch.Tensor:
    """A verified .npy of the delta (allow_pickle=False), as an owned tensor (bfloat16 stored as int16 bits)."""
    if not isinstance(rec, dict):
        raise _fail(path, f"a file record must be a mapping, got {rec!r}")
    file = _trust.check_file(path, rec.get("file")) if strict else _runtime.artifact_file(path, rec)
    bits = rec.get("dtype") == "bfloat16"
    t = _runtime.read_array(file, {**rec, "dtype": "int16"} if bits else rec).clone()
    return t.view(torch.bfloat16) if bits else t


def read_delta(header: DeltaHeader, base: dict[str, Any], spec: dict[str, dict[str, Any]], *,
               strict: bool = True) -> DeltaData:
    """The delta's arrays, every file verified and checked against the base artifact's manifest `base` and
    its program's weights `spec` (name -> shape, dtype).  ArtifactError naming the delta and what is wrong."""
    path, m = header.path, header.manifest
    if m is None:
        raise _runtime.ArtifactError(header.error or f"delta {path} is unreadable")
    files = m["files"]
    if m.get("delta_format") != DELTA_FORMAT or "program" in files:
        raise _fail(path, "written by an older hugeembed: its dense part is a program (code, which a server never "
                          "loads from a delta); export it again with this hugeembed (export --delta)")
    for what in ("dtype", "groups", "features"):
        if m[what] != base[what]:
            raise _fail(path, f"its {what} differ from the base artifact's: a delta of another model is refused")
    base_tables = {t["name"]: t for t in base["tables"]}
    if not isinstance(m["tables"], list) or sorted(t.get("name") for t in m["tables"] if isinstance(t, dict)) \
            != sorted(base_tables):
        raise _fail(path, f"its tables differ from the base artifact's {sorted(base_tables)}")
    expected = {f"{f}.{n}" for n in base_tables for f in _ARRAY_FIELDS} | {f"dense.{n}" for n in spec}
    if set(files) != expected:
        extra, missing = sorted(set(files) - expected), sorted(expected - set(files))
        raise _fail(path, f"its files differ from what the base artifact's model needs (unexpected {extra[:4]}, "
                          f"missing {missing[:4]}): a delta of another model structure is refused")
    store, group_of = storage_dtype(m["dtype"]), {}
    for g in base["groups"]:
        for t, name in enumerate(g["tables"]):
            group_of[name] = (g, t)
    upserts, removed = {}, {}
    for name in base_tables:
        g, t = group_of[name]
        keys, rows, gone = (_array(path, files[f"{f}.{name}"], strict) for f in _ARRAY_FIELDS)
        width = row_width(m["dtype"], int(g["dim"]))
        if keys.dtype != torch.int64 or keys.dim() != 1 or gone.dtype != torch.int64 or gone.dim() != 1:
            raise _fail(path, f"table {name!r}: keys must be int64 vectors")
        if rows.dtype != store or list(rows.shape) != [keys.numel(), width]:
            raise _fail(path, f"table {name!r}: rows are {rows.dtype} {list(rows.shape)}, the artifact's are {store} "
                              f"[{keys.numel()}, {width}]")
        if torch.unique(keys).numel() != keys.numel():
            raise _fail(path, f"table {name!r}: a key is upserted twice")
        if g["table_keys"][t] < 0:  # static: the keys are rows
            n = int(g["table_rows"][t])
            bad = keys[(keys < 0) | (keys >= n)]
            if bad.numel() or gone.numel():
                raise _fail(path, f"table {name!r} has {n} rows: ids {bad[:3].tolist()} are outside it"
                            if bad.numel() else f"table {name!r} is static: nothing can be removed from it")
        upserts[name], removed[name] = (keys, rows), gone
    dense = {}
    for name, want in spec.items():
        rec = files[f"dense.{name}"]
        if not isinstance(rec, dict) or rec.get("dtype") != want["dtype"] \
                or list(rec.get("shape", [])) != want["shape"]:
            raise _fail(path, f"dense weight {name!r} is {rec.get('dtype') if isinstance(rec, dict) else rec} "
                              f"{rec.get('shape') if isinstance(rec, dict) else ''}, the base program's "
                              f"{want['dtype']} {want['shape']}: a delta of another model structure is refused")
        dense[name] = _array(path, rec, strict)
    return DeltaData(path, m, upserts, removed, dense)


# -- writing one -------------------------------------------------------------------------------------------------


def export_delta(checkpoint: str | os.PathLike, artifact: str | os.PathLike, *, key: bytes | None = None) -> Path:
    """Writes, under ``artifact/deltas/``, the delta from the version the artifact serves (its base and the
    deltas already there) to the newest snapshot under the checkpoint root `checkpoint`.

    Reads nothing of the artifact but its manifests (JSON): no program, no array.  With `key` (the bytes of
    the server's ``--delta-key`` file), signs the delta, and follows only signed deltas.  The served snapshot
    must still be under `checkpoint` (unchanged: its manifest's sha256) and before the newest one; tables
    whose optimizer moves untouched rows (global Adam) refuse: all their rows change every step, so export
    a full artifact.  Returns the delta's directory.
    """
    artifact = Path(artifact)
    base = _runtime.read_manifest(artifact)
    if base["kind"] != "full":
        raise ConfigError(f"{artifact} is an artifact delta: give the full artifact it follows")
    if not isinstance(base.get("dense"), dict):
        raise ConfigError(f"{artifact} was exported by an older hugeembed (its manifest does not describe the "
                          f"program's weights): export a full artifact with this one")
    chain = served_chain(artifact, base, key, strict=False)
    served = chain[-1].manifest["source"] if chain else base["source"]
    model, _, info = load_snapshot_model(checkpoint, device="cpu")
    ec = model.embeddings
    check_servable(ec)
    tip = Path(info.path)
    if tip.name == served["name"]:
        raise ConfigError(f"{artifact} already serves {tip.name}, the newest snapshot under {tip.parent}: "
                          f"no delta to write")
    moving = [t.name for t, r in zip(ec.tables, ec.rules) if r is not None and r.moves_untouched_rows]
    if moving:
        raise ConfigError(f"tables {moving} use an optimizer that moves every row each step (global Adam): a delta "
                          f"cannot hold them; export a full artifact")
    parent_dir = tip.parent / served["name"]
    if not (parent_dir / "manifest.json").is_file():
        raise CheckpointError(f"{artifact} serves {served['name']}, which is not under {tip.parent} (pruned, or "
                              f"another run): a delta needs it; export a full artifact")
    sha = sha256_file(parent_dir / "manifest.json")
    if sha != served["manifest_sha256"]:
        raise CheckpointError(f"{parent_dir} changed after {artifact} was exported from it (its manifest's sha256): "
                              f"export a full artifact")
    if int(info.step) <= int(served["step"]):
        raise CheckpointError(f"the newest snapshot {tip.name} is not after the served {served['name']}")
    parent = ckpt.DeltaParent(ckpt.resolve_chain(ckpt.read_manifest(parent_dir)), sha)
    groups = serving_groups(ec)
    if [g.__dict__ for g in groups] != [GroupSpec.from_dict(g).__dict__ for g in base["groups"]]:
        raise ConfigError(f"the model at {tip} reads its tables differently from {artifact}: export a full artifact")
    dtype = base["dtype"]
    weights = dense_state(model, groups, dtype)
    if dense_spec(weights) != base["dense"]:
        raise ConfigError(f"the dense layers at {tip} differ from those of {artifact}'s program (names, shapes or "
                          f"dtypes): export a full artifact")
    deltas = artifact / DELTAS
    deltas.mkdir(exist_ok=True)
    tmp = deltas / f".tmp-{tip.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    (tmp / "tables").mkdir(parents=True)
    (tmp / "dense").mkdir()
    try:
        files: dict[str, Any] = {}
        tables = []
        for cfg, store in ec.stores():
            ex = store.export_index()
            changed, removed = parent.changes(ec, cfg.name, ex, static=cfg.num_rows is not None)
            full = store.export()  # keys ascending: the changed keys' rows are found by search
            at = torch.searchsorted(full.keys, changed.keys)
            rows = store.layout.weights(full.rows.index_select(0, at))
            gone = torch.cat([removed, changed.pending_keys]).cpu()
            for field, t in (("upsert_keys", changed.keys.cpu()), ("upsert_rows", quantize(rows, dtype)),
                             ("removed_keys", gone)):
                files[f"{field}.{cfg.name}"] = write_array(tmp, f"tables/{cfg.name}.{field}.npy", t)
            tables.append({"name": cfg.name, "upserted": int(changed.keys.numel()), "removed": int(gone.numel())})
        for name, w in weights.items():
            files[f"dense.{name}"] = write_array(tmp, f"dense/{name}.npy", w)
        manifest = {"format": _runtime.FORMAT, "format_version": _runtime.FORMAT_VERSION, "kind": "delta",
                    "delta_format": DELTA_FORMAT, "dtype": dtype, "created_unix": time.time(),
                    "parent": dict(served), "source": source_record(tip, info.manifest), "tables": tables,
                    "files": files, "features": base["features"], "groups": base["groups"], "signed": key is not None}
        raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
        ckpt.write_bytes(tmp / _runtime.MANIFEST, raw)
        if key is not None:
            fsync_write(tmp / _trust.SIGNATURE, _trust.sign(raw, key).encode(), exclusive=True)
        return publish_dir(tmp, deltas / tip.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
