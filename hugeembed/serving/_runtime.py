"""The serving runtime's artifact reader, with torch and numpy alone: files, manifest, tables, the exported
program.  The lookup op it runs is in ``_lookup_ops.py``.

An export copies both files into the artifact (``runtime.py`` and ``lookup_ops.py``, which ``runtime.py``
loads from its own directory): they import nothing from hugeembed, so a process without hugeembed can load
the artifact and run its program (``hugeembed.serving`` plugs its compiled id -> row pass and private key
index in through the hooks: the same rows, faster)::

    import importlib.util
    spec = importlib.util.spec_from_file_location("he_runtime", "model.export/runtime.py")
    rt = importlib.util.module_from_spec(spec); spec.loader.exec_module(rt)
    art = rt.load("model.export")                 # verified, tables memory-mapped
    logits = art.logits(dense, values, offsets)   # feature-major jagged ids, as SparseFeatures

Artifacts exported before the split carry one self-contained ``runtime.py`` (the op and the reader);
they load as before, by ``hugeembed.serving`` and by their own copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:  # inside hugeembed.serving
    from . import _lookup_ops as ops
except ImportError:  # a copy in an artifact, loaded by path: lookup_ops.py beside it
    _spec = importlib.util.spec_from_file_location(f"{__name__}_lookup_ops", Path(__file__).with_name("lookup_ops.py"))
    ops = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = ops
    _spec.loader.exec_module(ops)

ArtifactError, pooled_lookup, table_meta, SHARED_ROW_KEY = ops.ArtifactError, ops.pooled_lookup, ops.table_meta, \
    ops.SHARED_ROW_KEY
ROW_BASE, NUM, KEY_BASE, MISS_ROW, MAX_PROBE = ops.ROW_BASE, ops.NUM, ops.KEY_BASE, ops.MISS_ROW, ops.MAX_PROBE

__all__ = ["ArtifactError", "pooled_lookup", "load", "Artifact", "Tables", "verify_file", "read_array",
           "table_meta", "group_tables", "relative_file", "parse_manifest", "DTYPES", "COMBINERS",
           "FORMAT", "FORMAT_VERSION", "MANIFEST", "OPS_FILE"]

FORMAT = "hugeembed-serving"
FORMAT_VERSION = 2  # 2: one key array and a hash index per dim group (1: sorted keys per table)
MANIFEST = "manifest.json"
OPS_FILE = "lookup_ops.py"  # the op's file in an artifact, beside runtime.py
DTYPES = ("fp32", "fp16", "int8", "int4")
COMBINERS = ("sum", "mean", "sqrtn")
_TORCH = {"float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8, "int64": torch.int64}

# The index the lookups of loaded tables read: fn(keys, index, meta) -> index (hugeembed.serving installs
# a builder of its private, salted index, which only its bags_accelerator reads).
index_builder: Any = None


# -- files ----------------------------------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(8 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)


def relative_file(rel: Any, directory: Path) -> Path:
    """A manifest's file name as a path inside `directory`: relative, no ``..``, no NUL (ArtifactError otherwise:
    a manifest naming /etc/passwd or ../../x would read files outside the artifact)."""
    p = Path(rel) if isinstance(rel, str) else None
    if p is None or "\0" in rel or "\\" in rel or p.is_absolute() or ".." in p.parts or not p.parts:
        raise ArtifactError(f"{directory / MANIFEST}: file name {rel!r} is not a relative path inside the artifact")
    return p


def artifact_file(directory: Path, rec: Any) -> Path:
    """The path of a manifest file record's file (checked by relative_file; a symbolic link is refused)."""
    if not isinstance(rec, dict):
        raise ArtifactError(f"{directory / MANIFEST}: a file record must be a mapping, got {rec!r}")
    path = directory / relative_file(rec.get("file"), directory)
    here = directory
    for part in path.relative_to(directory).parts:
        here = here / part
        if here.is_symlink():
            raise ArtifactError(f"{here} is a symbolic link: refused inside an artifact")
    return path


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
        data = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{path} is unreadable: {e}") from None
    return parse_manifest(data, path)


def parse_manifest(data: bytes, path: Path) -> dict[str, Any]:
    """A manifest from its bytes (`path`: where they were read, for messages), its format and keys checked."""
    try:
        m = json.loads(data)
    except ValueError as e:
        raise ArtifactError(f"{path} is unreadable: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a hugeembed serving manifest (format {m.get('format') if isinstance(m, dict) else None!r})")
    if m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: serving format version {m.get('format_version')!r}, this runtime reads "
                            f"{FORMAT_VERSION}")
    for key in ("kind", "dtype", "groups", "tables", "files", "features", "source"):
        if key not in m:
            raise ArtifactError(f"{path}: {key} is missing (a damaged manifest)")
    if not isinstance(m["files"], dict):
        raise ArtifactError(f"{path}: files must be a mapping of names to file records")
    if m["dtype"] not in DTYPES:
        raise ArtifactError(f"{path}: dtype {m['dtype']!r}, expected one of {DTYPES}")
    return m


# -- the loaded artifact --------------------------------------------------------------------------------------------


class Tables:
    """The rows, keys, hash index and table records of every dim group, as the program takes them
    (immutable once built: a delta builds new ones)."""

    def __init__(self, rows: list[torch.Tensor], keys: list[torch.Tensor], index: list[torch.Tensor],
                 meta: list[torch.Tensor]) -> None:
        self.rows, self.keys, self.index, self.meta = rows, keys, index, meta
        self.lookup_index = index if index_builder is None else [index_builder(*a) for a in zip(keys, index, meta)]

    def args(self) -> tuple[list[torch.Tensor], ...]:
        """The program's table arguments, after dense, values and offsets."""
        return self.rows, self.keys, self.lookup_index, self.meta


def group_tables(group: dict[str, Any], sizes: list[int], rows: torch.Tensor, keys: torch.Tensor,
                 index: torch.Tensor, max_probe: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, keys, index, meta) of one dim group (`group`: its manifest record) whose tables hold `sizes` rows,
    checked (``hugeembed.serving._index.group_tables`` builds the index of new keys)."""
    cap = int(index.numel())
    if cap < 2 or cap & (cap - 1) or index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
        raise ArtifactError(f"a key index of {index.dtype} {list(index.shape)}: expected int32 or int64 slots, "
                            f"a power of two of them")
    if rows.shape[0] != sum(sizes) + 1:
        raise ArtifactError(f"a group's tables hold {sum(sizes)} rows, its row matrix {rows.shape[0]} (+1: the zero row)")
    meta = table_meta(group["table_keys"], group["table_rows"], group["table_shared"], sizes, keys, max_probe)
    return rows, keys, index, meta


class Artifact:
    """A loaded artifact: manifest, tables (memory-mapped) and the exported dense program."""

    def __init__(self, directory: Path, manifest: dict[str, Any], tables: Tables, exported) -> None:
        self.directory, self.manifest, self.tables = directory, manifest, tables
        self.exported = exported  # the torch.export ExportedProgram (its weights: a delta's are applied to it)
        self.program = exported.module()
        self.features: list[str] = list(manifest["features"]["sparse"])
        self.num_dense: int = int(manifest["features"]["dense"])

    def logits(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
               tables: Tables | None = None) -> torch.Tensor:
        """Logits ``[B]``; ids feature-major in the order of ``features`` (``offsets``: F*B + 1)."""
        t = self.tables if tables is None else tables
        return self.program(dense, values, offsets, *t.args())


def load_program(path: Path, rec: dict[str, Any]):
    """The exported dense program (a torch.export .pt2 file, the base artifact's only: it is code, unpickled
    by torch.export.load), verified, as an ExportedProgram."""
    verify_file(path, rec)
    try:
        return torch.export.load(str(path))
    except Exception as e:  # torch raises many types for a bad archive
        raise ArtifactError(f"artifact file {path}: the exported program does not load: {e}") from None


def load_tables(directory: Path, manifest: dict[str, Any]) -> Tables:
    """Every group's rows, keys and hash index from the artifact's files (verified, memory-mapped)."""
    files = manifest["files"]
    sizes = {t["name"]: int(t["rows"]) for t in manifest["tables"]}
    out: list[list[torch.Tensor]] = [[], [], [], []]
    for g, group in enumerate(manifest["groups"]):
        arrays = []
        for what in ("rows", "keys", "index"):
            rec = files.get(f"{what}.{g}")
            if rec is None:
                raise ArtifactError(f"{directory / MANIFEST}: file {what}.{g} is missing (a damaged manifest)")
            arrays.append(read_array(artifact_file(directory, rec), rec))
        probe = files[f"index.{g}"].get("max_probe")
        if not isinstance(probe, list) or len(probe) != len(group["tables"]):
            raise ArtifactError(f"{directory / MANIFEST}: index.{g} has no max probe per table (a damaged manifest)")
        for part, t in zip(out, group_tables(group, [sizes[n] for n in group["tables"]], *arrays, max_probe=probe)):
            part.append(t)
    return Tables(*out)


def load(directory: str | os.PathLike) -> Artifact:
    """Loads a full artifact (every file's checksum verified first); deltas are applied by hugeembed."""
    directory = Path(directory)
    m = read_manifest(directory)
    if m["kind"] != "full":
        raise ArtifactError(f"{directory} is an artifact delta: load the full artifact it follows")
    tables = load_tables(directory, m)
    program = load_program(artifact_file(directory, m["files"].get("program")), m["files"]["program"])
    return Artifact(directory, m, tables, program)

