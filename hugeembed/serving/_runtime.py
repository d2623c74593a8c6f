"""The serving runtime: the lookup custom op and the artifact reader, with torch and numpy alone.

This file imports nothing from hugeembed: an export copies it into the artifact
(``runtime.py``), so a process without hugeembed's training code (or without hugeembed)
can load the artifact and run its program::

    import importlib.util
    spec = importlib.util.spec_from_file_location("he_runtime", "model.export/runtime.py")
    rt = importlib.util.module_from_spec(spec); spec.loader.exec_module(rt)
    art = rt.load("model.export")                 # verified, tables memory-mapped
    logits = art.logits(dense, values, offsets)   # feature-major jagged ids, as SparseFeatures

The lookup of all tables of one dim is one custom op, ``hugeembed_serve::pooled_lookup``
(a ``torch.library`` op with a fake impl, so ``torch.export`` keeps the graph whole), and
one kernel call: the tables of a dim group are stored as one row matrix (tables one after
the other, then one zero row that unknown ids read), indexed per table by its sorted keys.
A table trained with a shared row (``TableConfig.shared_row``) keeps it under the key
``SHARED_ROW_KEY`` (-1, first in its sorted keys); ids it does not hold read that row
instead of zeros, as the training model's eval does.

Row formats (``dtype`` of the artifact):

    fp32  float32 [R, D]
    fp16  float16 [R, D]
    int8  uint8 [R, D + 8]:       torch.ops.quantized.embedding_bag_byte_prepack (per row
                                  float32 scale and bias after the D bytes)
    int4  uint8 [R, D/2 + 4]:     torch.ops.quantized.embedding_bag_4bit_prepack (two values
                                  a byte, then float16 scale and bias)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["ArtifactError", "pooled_lookup", "load", "Artifact", "Tables", "verify_file", "read_array",
           "DTYPES", "COMBINERS", "FORMAT", "FORMAT_VERSION", "MANIFEST"]

FORMAT = "hugeembed-serving"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = ("fp32", "fp16", "int8", "int4")
COMBINERS = ("sum", "mean", "sqrtn")
# hugeembed.nn._rare.SHARED_ROW_KEY (this file imports nothing from hugeembed; a test checks they agree)
SHARED_ROW_KEY = -1
_TORCH = {"float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8, "int64": torch.int64}


class ArtifactError(ValueError):
    """A missing, damaged or foreign artifact, or a delta that does not follow the served version."""


# -- the lookup op -------------------------------------------------------------------------------------------------


@torch.library.custom_op("hugeembed_serve::pooled_lookup", mutates_args=())
def pooled_lookup(values: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, keys: list[torch.Tensor],
                  table_keys: list[int], table_rows: list[int], table_shared: list[int], feature_pos: list[int],
                  feature_table: list[int], combiners: list[int], batch_size: int, dim: int,
                  dtype: str) -> torch.Tensor:
    """Pooled embeddings ``[B, F_g, D]`` (float32) of the features of one dim group.

    Args:
        values, offsets: the batch's ids, feature-major jagged (``SparseFeatures`` layout:
            bag ``f * B + b`` is ``values[offsets[f*B+b] : offsets[f*B+b+1]]``).
        rows: the group's row matrix (tables in order, then one zero row).
        keys: sorted int64 keys of the group's dynamic tables.
        table_keys: per table of the group, its index into `keys`, or -1 for a static table.
        table_rows: per table, its rows (static tables: num_rows; dynamic: ignored, len of its keys).
        table_shared: per table, 1 if ids it does not hold read its shared row (the key
            SHARED_ROW_KEY, when it holds one), 0 if they read zeros.
        feature_pos: per output feature, the index of its input feature in the batch.
        feature_table: per output feature, the table it reads (index into the group's tables).
        combiners: per output feature, 0 sum, 1 mean, 2 sqrtn.
        batch_size: B.  dim: D.  dtype: ``fp32 | fp16 | int8 | int4`` (the format of `rows`).

    Ids < 0 are dropped (not counted by mean/sqrtn); ids a table does not hold read its
    shared row or the zero row (and are counted, as a training model's eval reads them);
    empty bags pool to 0.
    """
    B = batch_size
    sizes = [int(keys[k].numel()) if k >= 0 else n for k, n in zip(table_keys, table_rows)]
    bases = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    zero_row = rows.shape[0] - 1
    idx_parts, len_parts, w_parts = [], [], []
    any_weight = any(c != 0 for c in combiners)
    for pos, t, comb in zip(feature_pos, feature_table, combiners):
        bags = offsets[pos * B: (pos + 1) * B + 1]
        ids = values[int(bags[0]): int(bags[-1])]
        lengths = bags[1:] - bags[:-1]
        slot = _slots(ids, keys[table_keys[t]] if table_keys[t] >= 0 else None, sizes[t], bool(table_shared[t]))
        kept = ids >= 0
        idx_parts.append(torch.where(slot >= 0, slot + bases[t], zero_row))
        len_parts.append(lengths)
        if any_weight:
            w = kept.to(torch.float32)
            if comb != 0:
                bag_of = torch.repeat_interleave(torch.arange(B), lengths, output_size=ids.numel())
                n = torch.zeros(B, dtype=torch.float32).index_add_(0, bag_of, w)
                scale = 1.0 / n.clamp(min=1.0) if comb == 1 else torch.rsqrt(n.clamp(min=1.0))
                w = w * scale[bag_of]
            w_parts.append(w)
        elif not bool(kept.all()):  # sum: a dropped id adds nothing, as the zero row does
            idx_parts[-1] = torch.where(kept, idx_parts[-1], zero_row)
    idx = torch.cat(idx_parts) if idx_parts else torch.zeros(0, dtype=torch.int64)
    lens = torch.cat(len_parts) if len_parts else torch.zeros(0, dtype=torch.int64)
    starts = torch.zeros(lens.numel(), dtype=torch.int64)
    if lens.numel() > 1:
        torch.cumsum(lens[:-1], 0, out=starts[1:])
    weights = torch.cat(w_parts) if any_weight and w_parts else None
    F = len(feature_pos)
    out = _embedding_bags(rows, idx, starts, weights, dtype, dim)
    return out.view(F, B, dim).transpose(0, 1).contiguous()


@pooled_lookup.register_fake
def _(values, offsets, rows, keys, table_keys, table_rows, table_shared, feature_pos, feature_table, combiners,
      batch_size, dim, dtype):
    return values.new_empty((batch_size, len(feature_pos), dim), dtype=torch.float32)


def _slots(ids: torch.Tensor, keys: torch.Tensor | None, num_rows: int, shared: bool) -> torch.Tensor:
    """Row of each id in its table; where the table does not hold it, its shared row (`shared`
    and the table has one: key SHARED_ROW_KEY, first of the sorted keys) or -1.  (Ids < 0 are
    dropped by the caller whatever their row.)"""
    if keys is None:  # static table: the id is the row
        return torch.where((ids >= 0) & (ids < num_rows), ids, -1)
    if keys.numel() == 0:
        return torch.full_like(ids, -1)
    pos = torch.searchsorted(keys, ids).clamp_(max=keys.numel() - 1)
    miss = 0 if shared and int(keys[0]) == SHARED_ROW_KEY else -1
    return torch.where(keys[pos] == ids, pos, miss)


def _embedding_bags(rows: torch.Tensor, idx: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor | None,
                    dtype: str, dim: int) -> torch.Tensor:
    """One kernel over every bag: ``[bags, D]`` float32 sums of (weighted) rows."""
    if dtype in ("fp32", "fp16"):
        out = torch.nn.functional.embedding_bag(idx, rows, starts, mode="sum", per_sample_weights=weights
                                                if weights is None else weights.to(rows.dtype))
        return out.float()
    op = (torch.ops.quantized.embedding_bag_byte_rowwise_offsets if dtype == "int8"
          else torch.ops.quantized.embedding_bag_4bit_rowwise_offsets)
    out = op(rows, idx, starts, False, 0, False, weights, None, False)
    return out[:, :dim]


# -- files ----------------------------------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def verify_file(path: Path, rec: dict[str, Any]) -> None:
    """ArtifactError if the file is missing, of another size or altered (its sha256)."""
    if not path.is_file():
        raise ArtifactError(f"artifact file {path} is missing")
    size = path.stat().st_size
    if size != rec.get("bytes"):
        raise ArtifactError(f"artifact file {path} has {size} bytes, the manifest says {rec.get('bytes')}: truncated "
                            f"or replaced")
    if sha256_of(path) != rec.get("sha256"):
        raise ArtifactError(f"artifact file {path} is damaged: its sha256 differs from the manifest's")


def read_array(path: Path, rec: dict[str, Any]) -> torch.Tensor:
    """A verified .npy file, memory-mapped read-only (pages are read as lookups touch them)."""
    verify_file(path, rec)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False) if rec["shape"][0] > 0 else np.load(path)
    except (ValueError, OSError, EOFError) as e:
        raise ArtifactError(f"artifact file {path} is unreadable: {e}") from None
    if list(arr.shape) != list(rec["shape"]) or str(arr.dtype) != rec["dtype"]:
        raise ArtifactError(f"artifact file {path} holds {arr.dtype} {list(arr.shape)}, the manifest says "
                            f"{rec['dtype']} {rec['shape']}")
    # the map is read-only: torch warns about non-writable arrays, but nothing ever writes to them
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a hugeembed serving artifact (no {MANIFEST})")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path} is unreadable: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a hugeembed serving manifest (format {m.get('format') if isinstance(m, dict) else None!r})")
    if m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: serving format version {m.get('format_version')!r}, this runtime reads "
                            f"{FORMAT_VERSION}")
    for key in ("kind", "dtype", "groups", "tables", "files", "features", "source"):
        if key not in m:
            raise ArtifactError(f"{path}: {key} is missing (a damaged manifest)")
    if m["dtype"] not in DTYPES:
        raise ArtifactError(f"{path}: dtype {m['dtype']!r}, expected one of {DTYPES}")
    return m


# -- the loaded artifact --------------------------------------------------------------------------------------------


class Tables:
    """The rows and key indexes of every dim group, as the program takes them (immutable once built)."""

    def __init__(self, rows: list[torch.Tensor], keys: list[list[torch.Tensor]]) -> None:
        self.rows, self.keys = rows, keys


class Artifact:
    """A loaded artifact: manifest, tables (memory-mapped) and the exported dense program."""

    def __init__(self, directory: Path, manifest: dict[str, Any], tables: Tables, program) -> None:
        self.directory, self.manifest, self.tables, self.program = directory, manifest, tables, program
        self.features: list[str] = list(manifest["features"]["sparse"])
        self.num_dense: int = int(manifest["features"]["dense"])

    def logits(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
               tables: Tables | None = None) -> torch.Tensor:
        """Logits ``[B]``; ids feature-major in the order of ``features`` (``offsets``: F*B + 1)."""
        t = self.tables if tables is None else tables
        return self.program(dense, values, offsets, t.rows, t.keys)


def load_program(path: Path, rec: dict[str, Any]):
    """The exported dense program (a torch.export .pt2 file), verified, as a callable module."""
    verify_file(path, rec)
    try:
        return torch.export.load(str(path)).module()
    except Exception as e:  # torch raises many types for a bad archive
        raise ArtifactError(f"artifact file {path}: the exported program does not load: {e}") from None


def load_tables(directory: Path, manifest: dict[str, Any]) -> Tables:
    """Every group's rows and sorted keys from the artifact's files (verified, memory-mapped)."""
    files = manifest["files"]
    rows, keys = [], []
    for g, group in enumerate(manifest["groups"]):
        rows.append(read_array(directory / files[f"rows.{g}"]["file"], files[f"rows.{g}"]))
        keys.append([read_array(directory / files[f"keys.{name}"]["file"], files[f"keys.{name}"])
                     for name in group["tables"] if f"keys.{name}" in files])
    return Tables(rows, keys)


def load(directory: str | os.PathLike) -> Artifact:
    """Loads a full artifact (every file's checksum verified first); deltas are applied by hugeembed."""
    directory = Path(directory)
    m = read_manifest(directory)
    if m["kind"] != "full":
        raise ArtifactError(f"{directory} is an artifact delta: load the full artifact it follows")
    tables = load_tables(directory, m)
    program = load_program(directory / m["files"]["program"]["file"], m["files"]["program"])
    return Artifact(directory, m, tables, program)
