"""The manifest of a snapshot: format versions, names, and the shape check every reader runs first.

A full snapshot's manifest (format version 1)::

    {"format_version": 1, "kind": "full", "step": 1000, "collection_step": 1000,
     "settled_step": 1000, "depth": 0, "world_size": 1, "plan": null,
     "tables": [{"name", "dim", ..., "shards": [{"rank", "rows", "pending", "files": {field: record}}]}],
     "files": {"dense_model": record, ...}}

A delta's (format version 2: a reader that knows only full snapshots refuses it instead of
loading its few rows as whole tables) adds ``parent`` (name, step and the sha256 of its
manifest file), ``base`` (the full snapshot its chain starts from), ``depth`` (deltas since
the base), ``changed_after`` (the parent's settled step: rows seen after it are in the
delta) and, per shard, ``removed`` with a ``removed_keys`` file.  Manifests written before
incremental snapshots have no kind (full), settled_step or depth.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..store import EXPORT_FIELDS

__all__ = ["FORMAT_VERSION", "DELTA_FORMAT_VERSION", "MANIFEST", "LATEST", "REMOVED", "snapshot_name",
           "is_snapshot_name", "snapshot_step", "validate_manifest", "is_delta", "check_tables"]

FORMAT_VERSION = 1  # full snapshots
DELTA_FORMAT_VERSION = 2  # deltas
MANIFEST = "manifest.json"
LATEST = "LATEST"
REMOVED = "removed_keys"  # the delta file of keys gone since the parent, per shard

_NAME = re.compile(r"step-[0-9]{9,}")


def snapshot_name(step: int) -> str:
    return f"step-{step:09d}"


def is_snapshot_name(name: Any) -> bool:
    """A snapshot directory's name (``step-<9+ digits>``): never a path that leaves the root."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def snapshot_step(name: str) -> int:
    """The step of a snapshot name, the key snapshots sort by (as text, step-1000000000 would come first)."""
    return int(name[len("step-"):])


def is_delta(manifest: dict[str, Any]) -> bool:
    return manifest.get("kind", "full") == "delta"


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
    if version not in (FORMAT_VERSION, DELTA_FORMAT_VERSION):
        raise CheckpointError(f"{where}: snapshot format version {version!r}, this hugeembed reads {FORMAT_VERSION} "
                              f"(full snapshots) and {DELTA_FORMAT_VERSION} (deltas)")
    kind = m.get("kind", "full")
    delta = version == DELTA_FORMAT_VERSION
    need(kind == ("delta" if delta else "full"), "kind", f"{'delta' if delta else 'full'!r} in a format version "
         f"{version} manifest", kind)
    for key in ("step", "collection_step"):
        need(integer(get(m, key, key)), key, "a non-negative integer", m[key])
    for key in ("settled_step", "depth"):  # absent from manifests older than incremental snapshots
        if delta or key in m:
            need(integer(get(m, key, key), 1 if delta and key == "depth" else 0), key,
                 "a positive integer" if delta and key == "depth" else "a non-negative integer", m[key])
    if delta:
        _validate_delta_links(m, need, get, integer)
    need(integer(get(m, "world_size", "world_size"), 1), "world_size", "a positive integer", m["world_size"])
    need(isinstance(m.get("hugeembed_version", ""), str), "hugeembed_version", "a string", m.get("hugeembed_version"))
    need(m.get("plan") is None or isinstance(m["plan"], dict), "plan", "null or a mapping", m.get("plan"))
    need(m.get("run_id") is None or (isinstance(m["run_id"], str) and m["run_id"] != ""), "run_id",
         "a non-empty string", m.get("run_id"))
    files = get(m, "files", "files")
    need(isinstance(files, dict), "files", "a mapping of names to file records", files)
    for k, rec in files.items():
        record(rec, f"files.{k}", tensor=False)
    tables = get(m, "tables", "tables")
    need(isinstance(tables, list), "tables", "a list of table records", tables)
    shard_fields = EXPORT_FIELDS + ((REMOVED,) if delta else ())
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
            for key in ("rank", "rows", "pending") + (("removed",) if delta else ()):
                need(integer(get(sh, key, f"{sat}.{key}")), f"{sat}.{key}", "a non-negative integer", sh[key])
            fl = get(sh, "files", f"{sat}.files")
            need(isinstance(fl, dict), f"{sat}.files", "a mapping of fields to file records", fl)
            for f in shard_fields:
                record(get(fl, f, f"{sat}.files.{f}"), f"{sat}.files.{f}", tensor=True)


def _validate_delta_links(m: dict, need, get, integer) -> None:
    """A delta's parent record and base name (their existence is checked when the chain is resolved)."""
    parent = get(m, "parent", "parent")
    need(isinstance(parent, dict), "parent", "a mapping (name, step, manifest_sha256)", parent)
    need(is_snapshot_name(get(parent, "name", "parent.name")), "parent.name", "a snapshot name (step-NNNNNNNNN)",
         parent["name"])
    need(integer(get(parent, "step", "parent.step")), "parent.step", "a non-negative integer", parent["step"])
    sha = get(parent, "manifest_sha256", "parent.manifest_sha256")
    need(isinstance(sha, str) and len(sha) == 64, "parent.manifest_sha256", "a hex sha256", sha)
    need(is_snapshot_name(get(m, "base", "base")), "base", "a snapshot name (step-NNNNNNNNN)", m["base"])
    need(integer(get(m, "changed_after", "changed_after")), "changed_after", "a non-negative integer",
         m["changed_after"])


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
        rule = collection.rules[collection._table_index(cfg.name)]
        layout = cfg.row_layout(rule)  # the whole row's (a column-wise shard holds a block of it)
        if t["state_width"] != layout.state_width:
            saved_rule = t["optimizer"] and t["optimizer"]["name"]
            raise CheckpointError(f"table {cfg.name!r}: optimizer state width {t['state_width']} in {where}, "
                                  f"{layout.state_width} in the model (optimizer {saved_rule!r} was saved)")
        # Snapshots from before typed layouts kept the state in the weight dtype.
        saved_layout = (t.get("dtype", "float32"), t.get("state_dtype", t.get("dtype", "float32")))
        mine = layout.describe()
        if saved_layout != (mine["dtype"], mine["state_dtype"]):
            raise CheckpointError(f"table {cfg.name!r}: rows in {where} are stored as {saved_layout[0]} weights with "
                                  f"{saved_layout[1]} optimizer state, the model's as {mine['dtype']} weights with "
                                  f"{mine['state_dtype']} state: build the table with dtype/state_dtype of the "
                                  f"snapshot")
        if t.get("seed") is not None and int(t["seed"]) != int(store.seed):
            raise CheckpointError(f"table {cfg.name!r}: initializer seed {t['seed']} in {where}, {store.seed} in the "
                                  f"model: build the collection with the seed of the saved run")
        saved_rule = t["optimizer"]["name"] if t["optimizer"] else None
        if (rule.name if rule else None) != saved_rule:
            raise CheckpointError(f"table {cfg.name!r}: optimizer {saved_rule!r} in {where}, "
                                  f"{rule.name if rule else None!r} in the model")
    extra = sorted(set(saved) - {c.name for c in collection.tables})
    if extra:
        raise CheckpointError(f"{manifest.get('_path', 'the snapshot')} has tables {extra} the model does not")
