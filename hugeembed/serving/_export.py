"""Export: a training snapshot -> a frozen serving artifact (no optimizer state).

::

    out/
      manifest.json       format, dtype, the run's config, features, data schema, dim groups, tables,
                          every file with its size and sha256, the snapshot it came from
      program.pt2         the dense part (torch.export), lookups as hugeembed_serve::pooled_lookup
      runtime.py          the op and a reader, torch + numpy only (a copy of _runtime.py)
      tables/g<k>.rows.npy   the rows of dim group k: its tables one after the other, then a zero row
      tables/g<k>.keys.npy   the keys of group k's dynamic tables, table after table, each ascending
                             (row i of a table holds its key i)
      tables/g<k>.index.npy  group k's hash index over those keys (_index.build_index)
      deltas/<snapshot>/  increments (export --delta), applied in order by the loader

Rows are the model's rows brought current (``catch_up_rows``: global Adam's lag), in the
export's dtype.  The artifact is written beside `out` and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint as ckpt
from .._durable import fsync_dir, sha256_file
from ..errors import ConfigError
from ..models import RecModel
from ..nn import EmbeddingCollection
from ..training import load_snapshot_model
from ..types import Combiner, OutOfRange
from . import _runtime
from ._index import group_tables
from ._quant import quantize

__all__ = ["export", "GroupSpec", "serving_groups", "table_weights", "export_program", "write_array", "publish_dir",
           "source_record", "write_group", "dense_state", "dense_spec"]

_COMBINERS = {Combiner.SUM: 0, Combiner.MEAN: 1, Combiner.SQRTN: 2}


@dataclass(frozen=True)
class GroupSpec:
    """One dim group as the lookup op takes it (see _runtime.pooled_lookup)."""

    dim: int
    tables: tuple[str, ...]
    table_keys: tuple[int, ...]  # index into the group's key list, -1: static
    table_rows: tuple[int, ...]  # static tables' num_rows (0 for dynamic ones)
    table_shared: tuple[int, ...]  # 1: unknown ids read the table's shared row (TableConfig.shared_row)
    feature_pos: tuple[int, ...]
    feature_table: tuple[int, ...]
    combiners: tuple[int, ...]
    outputs: tuple[str, ...]

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "GroupSpec":
        return GroupSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def check_servable(collection: EmbeddingCollection) -> None:
    """ConfigError / NotImplementedError naming the first table a frozen lookup cannot reproduce."""
    for t in collection.tables:
        if t.combiner not in _COMBINERS:
            raise ConfigError(f"table {t.name!r}: combiner {t.combiner.value!r} cannot be served (sum, mean, sqrtn)")
        missing = [what for what, bad in (("max_norm", t.max_norm is not None), ("default_id", t.default_id is not None),
                                          ("prune_negative=False", not t.prune_negative),
                                          ("out_of_range=" + t.out_of_range.value,
                                           t.num_rows is not None and t.out_of_range is not OutOfRange.ERROR))
                   if bad]
        if missing:
            raise NotImplementedError(f"table {t.name!r}: serving does not reproduce {', '.join(missing)} yet "
                                      f"(the frozen lookup drops ids < 0, reads zeros or the table's shared row "
                                      f"for unknown ids and pools empty bags to zeros)")


def serving_groups(collection: EmbeddingCollection) -> list[GroupSpec]:
    """The lookup plan's dim groups in the op's terms (group order = the plan's, so the model reads them)."""
    plan = collection.lookup.plan
    inputs = collection.feature_names()
    out = []
    for g in plan.groups:
        feats = [plan.features[f] for f in g.pooled]
        tables: list[str] = []
        for f in feats:
            if f.table not in tables:
                tables.append(f.table)
        cfgs = {t.name: t for t in collection.tables}
        dynamic = [n for n in tables if cfgs[n].num_rows is None]
        out.append(GroupSpec(
            dim=g.dim, tables=tuple(tables),
            table_keys=tuple(dynamic.index(n) if n in dynamic else -1 for n in tables),
            table_rows=tuple(cfgs[n].num_rows or 0 for n in tables),
            table_shared=tuple(int(cfgs[n].shared_row) for n in tables),
            feature_pos=tuple(inputs.index(f.source_name) for f in feats),
            feature_table=tuple(tables.index(f.table) for f in feats),
            combiners=tuple(_COMBINERS[Combiner.parse(f.combiner, f.name)] for f in feats),
            outputs=tuple(f.name for f in feats)))
    return out


def table_weights(collection: EmbeddingCollection, table: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(keys ascending or None for a static table, ``[N, D]`` weights in key order) of the admitted rows."""
    store = collection.store(table)
    ex = store.export()  # keys ascending, rows as stored (weights + optimizer state)
    weights = store.layout.weights(ex.rows)
    static = next(t for t in collection.tables if t.name == table).num_rows is not None
    return (None if static else ex.keys.cpu()), weights


class _Program(torch.nn.Module):
    """What torch.export traces: the lookup op per dim group, then the model's dense part."""

    def __init__(self, model: RecModel, groups: list[GroupSpec], dtype: str) -> None:
        super().__init__()
        self.model, self.groups, self.dtype = model, groups, dtype

    def forward(self, dense, values, offsets, rows: list[torch.Tensor], keys: list[torch.Tensor],
                index: list[torch.Tensor], meta: list[torch.Tensor]):
        B = dense.shape[0]
        blocks = [torch.ops.hugeembed_serve.pooled_lookup(
            values, offsets, rows[g], keys[g], index[g], meta[g], list(s.feature_pos), list(s.feature_table),
            list(s.combiners), B, s.dim, self.dtype) for g, s in enumerate(self.groups)]
        return self.model.forward_pooled(dense, self.model.embeddings.lookup.pooled_from_groups(blocks))


def dense_state(model: RecModel, groups: list[GroupSpec], dtype: str) -> dict[str, torch.Tensor]:
    """The weights of the exported program (its state_dict: the dense layers, not the tables), by name:
    what an artifact delta carries, as plain arrays, for the base's program."""
    with model.embeddings.tables_left_out_of_state_dict():
        return {k: v.detach() for k, v in _Program(model, groups, dtype).state_dict().items()}


def dense_spec(state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """name -> shape and dtype of each weight (the base manifest's ``dense`` record; a delta must match it)."""
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in state.items()}


def export_program(model: RecModel, groups: list[GroupSpec], dtype: str, width: list[int], path: Path
                   ) -> dict[str, Any]:
    """torch.export of the dense part with symbolic batch, ids, rows, keys and index slots; saved to `path`.
    (The index's dtype, int32 or int64, is not part of the traced graph: the op reads either.)"""
    from torch.export import Dim

    from ._quant import storage_dtype

    F, B = len(model.embeddings.feature_names()), 3  # >= 2 everywhere: export specializes sizes 0 and 1
    dyn = Dim.DYNAMIC
    example = (torch.zeros(B, model.num_dense), torch.zeros(2 * F * B, dtype=torch.int64),
               torch.arange(F * B + 1, dtype=torch.int64) * 2,
               [torch.zeros(5, w, dtype=storage_dtype(dtype)) for w in width],
               [torch.arange(4, dtype=torch.int64) for _ in groups], [torch.full((8,), -1, dtype=torch.int32) for _ in groups],
               [torch.zeros(len(g.tables), 5, dtype=torch.int64) for g in groups])
    shapes = {"dense": {0: dyn}, "values": {0: dyn}, "offsets": {0: dyn}, "rows": [{0: dyn} for _ in groups],
              "keys": [{0: dyn} for _ in groups], "index": [{0: dyn} for _ in groups], "meta": [None for _ in groups]}
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            program = torch.export.export(_Program(model, groups, dtype), example, dynamic_shapes=shapes, strict=False)
    finally:
        model.train(was)
    torch.export.save(program, str(path))
    return _record(path)


def _record(path: Path) -> dict[str, Any]:
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_array(directory: Path, rel: str, t: torch.Tensor) -> dict[str, Any]:
    rec = ckpt.write_tensor(directory / rel, t.contiguous())
    rec["file"] = rel
    return rec


def group_rows(parts: list[torch.Tensor], dtype: str, dim: int) -> torch.Tensor:
    """A group's row matrix: the tables' weights quantized, one after the other, then the zero row."""
    return quantize(torch.cat([*(p.to(torch.float32) for p in parts), torch.zeros(1, dim)]), dtype)


def write_group(directory: Path, g: int, spec: GroupSpec, sizes: list[int], rows: torch.Tensor,
                keys: torch.Tensor) -> dict[str, Any]:
    """Writes group g's rows, keys and hash index (built here) under directory/tables; their file records.
    The index record carries the max probe length of each table (the lookup's bound)."""
    _, _, index, meta = group_tables(asdict(spec), sizes, rows, keys)
    files = {f"rows.{g}": write_array(directory, f"tables/g{g}.rows.npy", rows),
             f"keys.{g}": write_array(directory, f"tables/g{g}.keys.npy", keys),
             f"index.{g}": write_array(directory, f"tables/g{g}.index.npy", index)}
    files[f"index.{g}"]["max_probe"] = meta[:, _runtime.MAX_PROBE].tolist()
    return files


def source_record(snap: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Which snapshot an artifact (or delta) holds: its name, step and the sha256 of its manifest."""
    return {"name": snap.name, "step": int(manifest["step"]), "manifest_sha256": sha256_file(snap / "manifest.json")}


def publish_dir(tmp: Path, final: Path) -> Path:
    """Fsyncs tmp and renames it to `final` (which must not exist): all or nothing.  Nothing in it is left
    writable by group or others (a server refuses such files, whatever the umask was)."""
    for path in (tmp, *tmp.rglob("*")):
        mode = path.lstat().st_mode
        if mode & 0o022:
            os.chmod(path, mode & 0o7755)
    fsync_dir(tmp)
    if final.exists():
        raise ConfigError(f"{final} exists: export to a new path (a served artifact is never overwritten)")
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def export(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "fp32") -> Path:
    """Writes the serving artifact of the model saved at `checkpoint` to the new directory `out`.

    Args:
        checkpoint: a snapshot, or a checkpoint root (its newest; a delta loads with its chain).
        out: the artifact directory to create (refused if it exists).
        dtype: ``fp32 | fp16 | int8 | int4`` rows (int8/int4: row-wise, torch's prepacked layouts).

    Example::

        export("runs/dlrm", "dlrm.int8", dtype="int8")
        model = ServingModel.load("dlrm.int8")
        probs = model.predict(batch.dense, batch.sparse)
    """
    from ._quant import row_width

    if dtype not in _runtime.DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(_runtime.DTYPES)}, got {dtype!r}")
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists: export to a new path (a served artifact is never overwritten)")
    started = time.perf_counter()
    model, cfg, info = load_snapshot_model(checkpoint, device="cpu")
    ec = model.embeddings
    check_servable(ec)
    if dtype == "int4":
        odd = [t.name for t in ec.tables if t.dim % 2]
        if odd:
            raise ConfigError(f"int4 rows pack two values a byte: tables {odd} have an odd dim; export them as int8")
    ec.catch_up_rows()  # global Adam: every row brought to the last step (a no-op for other rules)
    groups = serving_groups(ec)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    (tmp / "tables").mkdir(parents=True)
    try:
        files: dict[str, Any] = {}
        tables = []
        for g, spec in enumerate(groups):
            parts, keys_parts = [], []
            for name in spec.tables:
                keys, w = table_weights(ec, name)
                parts.append(w)
                if keys is not None:
                    keys_parts.append(keys.to(torch.int64))
                tables.append({"name": name, "group": g, "dim": spec.dim, "rows": int(w.shape[0]),
                               "dynamic": keys is not None})
            files.update(write_group(tmp, g, spec, [int(p.shape[0]) for p in parts], group_rows(parts, dtype, spec.dim),
                                     torch.cat(keys_parts) if keys_parts else torch.zeros(0, dtype=torch.int64)))
        files["program"] = export_program(model, groups, dtype, [row_width(dtype, s.dim) for s in groups],
                                          tmp / "program.pt2")
        # the reader and the op it loads from beside it: torch and numpy alone run the program
        shutil.copyfile(_runtime.__file__, tmp / "runtime.py")
        shutil.copyfile(_runtime.ops.__file__, tmp / _runtime.OPS_FILE)
        files["runtime"] = _record(tmp / "runtime.py")
        files["lookup_ops"] = _record(tmp / _runtime.OPS_FILE)
        from .. import __version__

        snap = Path(info.path)
        manifest = {
            "format": _runtime.FORMAT, "format_version": _runtime.FORMAT_VERSION, "kind": "full", "dtype": dtype,
            "hugeembed_version": __version__, "torch_version": torch.__version__, "created_unix": time.time(),
            "model": cfg.model, "config": cfg.to_dict(),
            "features": {"dense": model.num_dense, "sparse": ec.feature_names()},
            # the data schema (with its fitted statistics): how a request's columns become model input
            **({} if model.schema.is_criteo() else {"schema": model.schema.to_dict()}),
            "groups": [asdict(s) for s in groups], "tables": tables, "files": files,
            "dense": dense_spec(dense_state(model, groups, dtype)),
            "source": source_record(snap, info.manifest), "export_seconds": round(time.perf_counter() - started, 3),
        }
        ckpt.write_bytes(tmp / _runtime.MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        return publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
