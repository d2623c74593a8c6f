"""Atomic, checksummed snapshots of embedding tables, the dense model, optimizers and RNG.

Layout of a checkpoint root::

    root/
      LATEST                      name of the newest complete snapshot (atomically replaced)
      step-000001000/             one complete snapshot, never modified once renamed in
        manifest.json             format version, step, tables (dim, rows, optimizer, files +
                                  sha256), dense files, world size, plan
        tables/<table>.r<rank>.<field>.npy   keys, rows (weights + optimizer state), counts,
                                  last_step, pending keys/counts/last_step, per shard
        dense_model.pt  dense_optimizer.pt  embedding_optimizer.pt  rng.pt  extra.pt
      .tmp-step-000002000-<pid>-<id>/   a save in progress (or one that crashed): ignored

A save writes everything into a hidden directory beside the target, fsyncs every
file and the directory, renames it into place and then replaces LATEST: a crash at
any point leaves the previous snapshot complete and LATEST pointing at it.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..store import EXPORT_FIELDS, StoreExport
from ._files import atomic_write_text, fsync_dir, read_tensor, verify, write_bytes, write_rows, write_tensor

__all__ = ["save", "load", "latest", "read_manifest", "read_extra", "read_table", "SnapshotInfo", "FORMAT_VERSION",
           "list_snapshots", "validate_manifest"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "LATEST"


@dataclass
class SnapshotInfo:
    """What :func:`load` restored: the snapshot's path, step, manifest and the caller's extra state."""

    path: Path
    step: int
    manifest: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def _snapshot_name(step: int) -> str:
    return f"step-{step:09d}"


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


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def _row_source(store):
    """What a store's ``export_index().slots`` index: its storage, or a tiered table's rows on disk + cache."""
    source = getattr(store, "row_source", None)
    return source() if source is not None else store.storage()


def table_records(collection, directory: Path, rank: int = 0, tables: set[str] | None = None) -> list[dict[str, Any]]:
    """Writes this rank's shard of every table (or of `tables`) under directory/tables; returns manifest entries."""
    (directory / "tables").mkdir(exist_ok=True)
    out = []
    for cfg, store in collection.stores():
        if tables is not None and cfg.name not in tables:
            continue
        ex = store.export_index()  # rows are streamed from the storage: no copy of the table
        files = {}
        for f in EXPORT_FIELDS:
            path = directory / "tables" / f"{cfg.name}.r{rank}.{f}.npy"
            files[f] = write_rows(path, _row_source(store), ex.slots) if f == "rows" else \
                write_tensor(path, getattr(ex, f))
            files[f]["file"] = f"tables/{path.name}"
        out.append({
            "name": cfg.name, "dim": cfg.dim, "num_rows": cfg.num_rows, "width": store.width,
            "state_width": store.state_width, "dtype": str(store.dtype).removeprefix("torch."),
            # rows are written raw: a reader needs the layout that packed them
            "state_dtype": store.layout.describe()["state_dtype"],
            "stochastic_rounding": store.layout.stochastic_rounding,
            # rows created after a resume must start as they would have: same initializer and seed
            "seed": int(store.seed), "initializer": repr(store.initializer),
            "optimizer": None if collection.rules[collection._table_index(cfg.name)] is None
            else collection.rules[collection._table_index(cfg.name)].to_dict(),
            "shards": [{"rank": rank, "rows": int(ex.keys.numel()), "pending": int(ex.pending_keys.numel()),
                        "files": files}],
        })
        stats = getattr(store, "cache_stats", None)
        if stats is not None:  # a tiered table: its cache figures at the save (hugeembed inspect shows them)
            out[-1]["tier"] = {k: v for k, v in stats().items()}
    return out


def _remove_stale_tmp(root: Path) -> None:
    """Deletes temp directories of saves whose process is gone (crashed mid-save)."""
    for d in root.glob(".tmp-*"):
        try:
            pid = int(d.name.split("-")[3])
        except (IndexError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()
        except OSError:
            alive = False
        if not alive:
            shutil.rmtree(d, ignore_errors=True)


def save(root: str | os.PathLike, collection, *, model: torch.nn.Module | None = None,
         dense_optimizer: torch.optim.Optimizer | None = None, step: int | None = None,
         extra: dict[str, Any] | None = None, keep: int | None = None, rng: bool = True) -> Path:
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
        keep: keep only the newest `keep` snapshots (None: keep all).
        rng: save torch/CUDA/NumPy/Python RNG states (for bit-identical resume).
    """
    from ..distributed import ShardedEmbeddingCollection

    if isinstance(collection, ShardedEmbeddingCollection):
        from ._sharded import save_sharded

        return save_sharded(root, collection, model=model, dense_optimizer=dense_optimizer, step=step, extra=extra,
                            keep=keep, rng=rng)
    root = Path(root)
    step = collection.step if step is None else int(step)
    name = _snapshot_name(step)
    tmp = new_tmp_dir(root, name)
    try:
        tables = table_records(collection, tmp)
        files = dense_files(tmp, collection, model, dense_optimizer, extra)
        if rng:
            files["rng"] = rng_file(tmp)
        from .. import __version__

        manifest = {
            "format_version": FORMAT_VERSION, "hugeembed_version": __version__, "step": step,
            "created_unix": time.time(), "world_size": 1, "plan": None,
            "collection_step": collection.step, "tables": tables, "files": files,
        }
        final = publish(root, tmp, name, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep)
    return final


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
        trash = root / f".tmp-old-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / LATEST, name + "\n")
    return final


def prune(root: Path, keep: int | None) -> None:
    if keep is not None:
        for old in list_snapshots(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def _dense_state(model: torch.nn.Module, collection) -> dict[str, torch.Tensor]:
    """The model's state_dict without the embedding tables (saved separately, per shard)."""
    with collection.tables_left_out_of_state_dict():
        return model.state_dict()


def list_snapshots(root: str | os.PathLike) -> list[Path]:
    """Complete snapshots under root (those with a manifest), oldest first."""
    root = Path(root)
    found = [d for d in root.glob("step-*") if (d / MANIFEST).exists()]
    return sorted(found, key=lambda d: d.name)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete snapshot under root, or None."""
    root = Path(root)
    pointer = root / LATEST
    try:
        name = pointer.read_text(errors="replace").strip()
    except OSError:  # none yet (or not a file): the newest complete one below
        name = ""
    if name.startswith("step-") and "/" not in name and (root / name / MANIFEST).exists():
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


def validate_manifest(m: Any, where: Path) -> None:
    """Checks the shape of a snapshot manifest before anything uses it.

    CheckpointError naming the file and the first field that is missing or of the wrong
    type (instead of a KeyError or TypeError wherever the field is first read).
    """
    def need(ok: bool, name: str, what: str, value: Any) -> None:
        if not ok:
            text = repr(value)
            raise CheckpointError(f"{where}: {name} must be {what}, got {text if len(text) <= 60 else text[:57] + '...'}")

    def get(d: dict, key: str, name: str) -> Any:
        if key not in d:
            raise CheckpointError(f"{where}: {name} is missing (a damaged or foreign manifest)")
        return d[key]

    def integer(v: Any, low: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    def record(rec: Any, name: str, tensor: bool) -> None:
        need(isinstance(rec, dict), name, "a file record (a mapping)", rec)
        f = get(rec, "file", f"{name}.file")
        need(isinstance(f, str) and f != "" and not Path(f).is_absolute() and ".." not in Path(f).parts,
             f"{name}.file", "a relative path inside the snapshot", f)
        need(integer(get(rec, "bytes", f"{name}.bytes")), f"{name}.bytes", "a non-negative integer", rec["bytes"])
        sha = get(rec, "sha256", f"{name}.sha256")
        need(isinstance(sha, str) and len(sha) == 64, f"{name}.sha256", "a hex sha256", sha)
        if tensor:
            need(isinstance(get(rec, "dtype", f"{name}.dtype"), str), f"{name}.dtype", "a string", rec["dtype"])
            shape = get(rec, "shape", f"{name}.shape")
            need(isinstance(shape, list) and all(integer(d) for d in shape), f"{name}.shape",
                 "a list of non-negative integers", shape)

    need(isinstance(m, dict), "the manifest", "a JSON object", m)
    version = get(m, "format_version", "format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{where}: snapshot format version {version!r}, this hugeembed reads {FORMAT_VERSION}")
    for key in ("step", "collection_step"):
        need(integer(get(m, key, key)), key, "a non-negative integer", m[key])
    need(integer(get(m, "world_size", "world_size"), 1), "world_size", "a positive integer", m["world_size"])
    need(isinstance(m.get("hugeembed_version", ""), str), "hugeembed_version", "a string", m.get("hugeembed_version"))
    need(m.get("plan") is None or isinstance(m["plan"], dict), "plan", "null or a mapping", m.get("plan"))
    files = get(m, "files", "files")
    need(isinstance(files, dict), "files", "a mapping of names to file records", files)
    for k, rec in files.items():
        record(rec, f"files.{k}", tensor=False)
    tables = get(m, "tables", "tables")
    need(isinstance(tables, list), "tables", "a list of table records", tables)
    for i, t in enumerate(tables):
        need(isinstance(t, dict), f"tables[{i}]", "a table record (a mapping)", t)
        name = get(t, "name", f"tables[{i}].name")
        need(isinstance(name, str) and name != "", f"tables[{i}].name", "a table name", name)
        at = f"table {name!r}"
        for key in ("dim", "width"):
            need(integer(get(t, key, f"{at} {key}"), 1), f"{at} {key}", "a positive integer", t[key])
        need(integer(get(t, "state_width", f"{at} state_width")), f"{at} state_width", "a non-negative integer",
             t["state_width"])
        need(get(t, "num_rows", f"{at} num_rows") is None or integer(t["num_rows"], 1), f"{at} num_rows",
             "null or a positive integer", t["num_rows"])
        need(t.get("seed") is None or integer(t["seed"]), f"{at} seed", "null or a non-negative integer",
             t.get("seed"))
        opt = get(t, "optimizer", f"{at} optimizer")
        need(opt is None or (isinstance(opt, dict) and isinstance(opt.get("name"), str)), f"{at} optimizer",
             "null or a mapping with a name", opt)
        shards = get(t, "shards", f"{at} shards")
        need(isinstance(shards, list) and len(shards) > 0, f"{at} shards", "a non-empty list of shard records",
             shards)
        for j, sh in enumerate(shards):
            sat = f"{at} shards[{j}]"
            need(isinstance(sh, dict), sat, "a shard record (a mapping)", sh)
            for key in ("rank", "rows", "pending"):
                need(integer(get(sh, key, f"{sat}.{key}")), f"{sat}.{key}", "a non-negative integer", sh[key])
            fl = get(sh, "files", f"{sat}.files")
            need(isinstance(fl, dict), f"{sat}.files", "a mapping of fields to file records", fl)
            for f in EXPORT_FIELDS:
                record(get(fl, f, f"{sat}.files.{f}"), f"{sat}.files.{f}", tensor=True)


def read_table(snap: Path, entry: dict[str, Any], rank_filter=None) -> StoreExport:
    """All shards of one table from a snapshot, verified, concatenated.

    `rank_filter` (optional) maps one shard's fields ``{field: tensor}`` to the part to keep;
    it is applied shard by shard, so a rank resharding a big table never holds all of it.
    """
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


def check_tables(manifest: dict[str, Any], collection) -> None:
    """Raises CheckpointError naming the first table that does not fit the collection."""
    saved = {t["name"]: t for t in manifest["tables"]}
    for cfg, store in collection.stores():
        t = saved.get(cfg.name)
        where = manifest.get("_path", "the snapshot")
        if t is None:
            raise CheckpointError(f"{where} has no table {cfg.name!r} (it has {sorted(saved)})")
        if t["dim"] != cfg.dim:
            raise CheckpointError(f"table {cfg.name!r}: dim {t['dim']} in {where}, {cfg.dim} in the model")
        if t["num_rows"] != cfg.num_rows:
            raise CheckpointError(f"table {cfg.name!r}: num_rows {t['num_rows']} in {where}, {cfg.num_rows} in the model")
        if t["state_width"] != store.state_width:
            raise CheckpointError(f"table {cfg.name!r}: optimizer state width {t['state_width']} in {where}, "
                                  f"{store.state_width} in the model (optimizer {t['optimizer'] and t['optimizer']['name']!r} "
                                  f"was saved)")
        # Snapshots from before typed layouts kept the state in the weight dtype.
        saved_layout = (t.get("dtype", "float32"), t.get("state_dtype", t.get("dtype", "float32")))
        mine = store.layout.describe()
        if saved_layout != (mine["dtype"], mine["state_dtype"]):
            raise CheckpointError(f"table {cfg.name!r}: rows in {where} are stored as {saved_layout[0]} weights with "
                                  f"{saved_layout[1]} optimizer state, the model's as {mine['dtype']} weights with "
                                  f"{mine['state_dtype']} state: build the table with dtype/state_dtype of the "
                                  f"snapshot")
        if t.get("seed") is not None and int(t["seed"]) != int(store.seed):
            raise CheckpointError(f"table {cfg.name!r}: initializer seed {t['seed']} in {where}, {store.seed} in the "
                                  f"model: build the collection with the seed of the saved run")
        rule = collection.rules[collection._table_index(cfg.name)]
        saved_rule = t["optimizer"]["name"] if t["optimizer"] else None
        if (rule.name if rule else None) != saved_rule:
            raise CheckpointError(f"table {cfg.name!r}: optimizer {saved_rule!r} in {where}, "
                                  f"{rule.name if rule else None!r} in the model")
    extra = sorted(set(saved) - {c.name for c in collection.tables})
    if extra:
        raise CheckpointError(f"{manifest.get('_path', 'the snapshot')} has tables {extra} the model does not")


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

    Everything is read and verified (manifest, table layout, checksums) before anything is
    changed, so a bad snapshot raises CheckpointError and leaves the model untouched.
    """
    manifest = read_manifest(path)
    snap = Path(manifest["_path"])
    check_tables(manifest, collection)
    from ._sharded import owned_filter, rng_key

    # a sharded collection keeps the keys it owns under ITS plan, whatever the saved layout
    exports = {t["name"]: read_table(snap, t, owned_filter(collection, t["name"])) for t in manifest["tables"]}
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
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{snap}: dense model does not match: missing {missing}, "
                              f"unexpected {list(result.unexpected_keys)}")
