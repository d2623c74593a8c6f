"""Converted shards: a directory of .npy arrays plus manifest.json.

Layout written by :func:`hugeembed.data.convert`::

    out/
      manifest.json                 format, version, schema, row counts, checksums, sources, distinct ids
      part-00000.dense.npy          float32 [n0, n_dense]   (transformed as the schema says)
      part-00000.cats.npy           int64   [n0, n_single]  (single-valued features; missing -> 2**32 + j)
      part-00000.labels.npy         uint8   [n0]
      part-00000.bag0.values.npy    int64   [nnz]       bag feature 0's ids, row after row
      part-00000.bag0.offsets.npy   int64   [n0 + 1]    row i: values[offsets[i]:offsets[i + 1]]
      part-00001.dense.npy ...

Criteo data (the built-in schema) is written as format ``hugeembed.criteo-shards`` version 1, as
before schemas existed; any other schema as ``hugeembed.shards`` version 2, with the schema (and
its fitted statistics) in the manifest.

Every array is a plain .npy file, so ``np.load(path, mmap_mode="r")`` maps it without
reading it; the loader reads only the rows it needs.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._durable import sha256_file, start_writeback
from ..errors import InputError
from ._block import Bag, Block
from ._schema import CAT_NAMES, DENSE_NAMES, MISSING_IDS, N_CAT, N_DENSE, Schema, criteo_schema

__all__ = ["ShardSet", "ShardInfo", "FORMAT", "FORMAT_VERSION", "SCHEMA_FORMAT", "SCHEMA_FORMAT_VERSION", "ARRAYS",
           "NpyWriter", "schema_dict", "shard_arrays"]

FORMAT = "hugeembed.criteo-shards"
FORMAT_VERSION = 1
SCHEMA_FORMAT = "hugeembed.shards"  # any schema: the schema itself is in the manifest
SCHEMA_FORMAT_VERSION = 2
# array name -> (dtype, row shape) of Criteo shards
ARRAYS: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
    "dense": (np.dtype(np.float32), (N_DENSE,)),
    "cats": (np.dtype(np.int64), (N_CAT,)),
    "labels": (np.dtype(np.uint8), ()),
}


def shard_arrays(schema: Schema) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The arrays of a shard under `schema`: name -> (dtype, row shape); bag k adds ``bag<k>.values``
    ([nnz]) and ``bag<k>.offsets`` ([rows + 1])."""
    n_bags = sum(s.is_bag for s in schema.sparse)
    out = {"dense": (np.dtype(np.float32), (schema.num_dense,)),
           "cats": (np.dtype(np.int64), (len(schema.sparse) - n_bags,)),
           "labels": (np.dtype(np.uint8), ())}
    for k in range(n_bags):
        out[f"bag{k}.values"] = (np.dtype(np.int64), ())
        out[f"bag{k}.offsets"] = (np.dtype(np.int64), ())
    return out
_HEADER_BYTES = 128  # fixed .npy header size, so the shape can be patched in place at close


def schema_dict() -> dict:
    return {
        "dense": {"names": list(DENSE_NAMES), "dtype": "float32", "transform": "log1p(max(x, 0)); empty -> 0"},
        "sparse": {"names": list(CAT_NAMES), "dtype": "int64", "encoding": "hex value of the field",
                   "missing_ids": list(MISSING_IDS)},
        "labels": {"dtype": "uint8", "values": [0, 1]},
    }


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    body_len = _HEADER_BYTES - 10
    body = text.encode("latin1").ljust(body_len - 1) + b"\n"
    if len(body) != body_len:
        raise ValueError(f"npy header for shape {shape} does not fit in {_HEADER_BYTES} bytes")
    return b"\x93NUMPY\x01\x00" + body_len.to_bytes(2, "little") + body


class NpyWriter:
    """Appends rows to a .npy file whose row count is written when it is closed.

    The header has a fixed size (128 bytes), so it is written with a row count of 0 and
    rewritten in place by :meth:`write_header` or :meth:`close`, which also fsyncs.  Memory use is one chunk.
    """

    def __init__(self, path: Path, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), tuple(row_shape)
        self.rows = 0
        self._header_rows = -1  # the row count the header on file holds (-1: none yet)
        self._f = open(path, "wb")
        self._f.write(_npy_header(self.dtype, (0, *self.row_shape)))

    def append(self, array: np.ndarray) -> None:
        if array.dtype != self.dtype or array.shape[1:] != self.row_shape:
            raise ValueError(f"{self.path}: expected {self.dtype} rows of shape {self.row_shape}, got {array.dtype} {array.shape}")
        self._f.write(np.ascontiguousarray(array).data)
        self._f.flush()
        start_writeback(self._f.fileno())  # the disk works while the next chunk parses
        self.rows += array.shape[0]

    def write_header(self) -> None:
        """Rewrites the header with the row count, flushed: the file is whole (:meth:`close` makes it durable)."""
        self._f.seek(0)
        self._f.write(_npy_header(self.dtype, (self.rows, *self.row_shape)))
        self._f.flush()
        self._f.seek(0, os.SEEK_END)  # rows appended later go after the others
        self._header_rows = self.rows

    def sha256(self) -> str:
        """Hex sha256 of the file as written (call :meth:`write_header` first), hashed through a read-only
        map of its pages: no copy of the file into the process, as reading it back would make."""
        self._f.flush()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as pages:  # the header makes the file non-empty
                return hashlib.sha256(pages).hexdigest()
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._header_rows != self.rows:
            self.write_header()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its name, its rows, and where its rows start in the whole set."""

    name: str
    rows: int
    start: int


class ShardSet:
    """A converted directory, opened lazily (arrays are memory-mapped on first use).

    Args:
        path: the directory written by ``convert`` (or its manifest.json).
        verify: ``"open"`` (default): each shard's files are checked against the manifest's
            sha256 when the shard is first mapped, so corrupted bytes are never read as rows
            (each file is read once more, on first use); ``"all"`` (or True): every file
            now; ``"none"`` (or False): never (trusted data, fastest start).

    Every row read is also checked: a label other than 0 or 1, or a negative category id
    (``convert`` never writes one: ids are hex values or the MISSING_IDS), is an InputError
    naming the file and the row.  Such rows are refused rather than dropped, because they
    can only come from a damaged or foreign file, whose other values cannot be trusted either.

    Example::

        shards = ShardSet("criteo_shards/")
        shards.rows, len(shards.shards)          # (45840617, 44)
        block = shards.read(1000, 2000)          # Block of rows 1000..1999
        shards.schema                            # the schema the data was converted under
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool | str = "open") -> None:
        modes = {True: "all", False: "none", "open": "open", "all": "all", "none": "none"}
        if not isinstance(verify, (bool, str)) or verify not in modes:
            raise ValueError(f"verify must be 'open', 'all' or 'none', got {verify!r}")
        self.verify_mode = modes[verify]
        path = Path(path)
        self.root = path.parent if path.name == "manifest.json" else path
        mpath = self.root / "manifest.json"
        if not mpath.is_file():
            raise InputError(f"{self.root}: not a converted shard directory (no manifest.json); "
                             f"create one with `hugeembed convert`")
        try:
            self.manifest = json.loads(mpath.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"{mpath}: unreadable manifest ({e})") from None
        m = self.manifest
        self.schema = _validate_manifest(m, mpath)
        self.array_specs = shard_arrays(self.schema)
        infos, start = [], 0
        for s in m["shards"]:
            infos.append(ShardInfo(s["name"], s["rows"], start))
            start += s["rows"]
        if start != m["rows"]:
            raise InputError(f"{mpath}: shard rows add up to {start}, manifest says {m['rows']}")
        self.shards: tuple[ShardInfo, ...] = tuple(infos)
        self.rows = start
        self._starts = np.array([s.start for s in infos] + [start], np.int64)
        self._open: dict[int, dict[str, np.ndarray]] = {}
        if self.verify_mode == "all":
            self.verify()

    def __len__(self) -> int:
        return self.rows

    def ids_per_bag(self) -> dict[str, float]:
        """Mean ids per bag of each sparse feature over every row, from the manifest (no array is read):
        1 for a column of one value per cell, a bag column's values over its rows (an empty cell holds its
        missing id).
        The distributed planner's input (column-wise sharding pays off for long bags)."""
        values = [0] * sum(s.is_bag for s in self.schema.sparse)
        for entry in self.manifest["shards"]:
            for k in range(len(values)):
                values[k] += int(entry["files"][f"bag{k}.values"].get("rows", 0))
        bags = iter(values)
        return {s.name: next(bags) / max(self.rows, 1) if s.is_bag else 1.0 for s in self.schema.sparse}

    def distinct_ids(self) -> dict[str, int] | None:
        """Estimated distinct ids of each sparse feature over every row, from the manifest (``convert``
        writes a HyperLogLog estimate, ~1.6% relative error: data/_distinct.py); None for a manifest
        written before it.  The distributed planner's rows hint for dynamic tables."""
        distinct = self.manifest.get("distinct_ids")
        return None if distinct is None else dict(distinct)

    def arrays(self, shard: int) -> dict[str, np.ndarray]:
        """The memory-mapped arrays of shard number `shard` (checked against the manifest)."""
        got = self._open.get(shard)
        if got is None:
            info, entry = self.shards[shard], self.manifest["shards"][shard]
            if self.verify_mode == "open":
                self._verify_shard(entry)
            got = {}
            for name, (dtype, row_shape) in self.array_specs.items():
                fpath = self.root / entry["files"][name]["file"]
                try:
                    arr = np.load(fpath, mmap_mode="r", allow_pickle=False)
                except FileNotFoundError:
                    raise InputError(f"{fpath}: missing shard file listed in the manifest") from None
                except (ValueError, OSError, EOFError) as e:  # EOFError: an empty file
                    raise InputError(f"{fpath}: not a readable .npy file ({type(e).__name__}: {e})") from None
                rows = info.rows + 1 if name.endswith(".offsets") else \
                    entry["files"][name].get("rows", -1) if name.endswith(".values") else info.rows
                if arr.dtype != dtype or arr.shape != (rows, *row_shape):
                    raise InputError(f"{fpath}: holds {arr.dtype} {arr.shape}, manifest says {dtype} {(rows, *row_shape)}")
                got[name] = arr
            self._open[shard] = got
        return got

    def read_shard_rows(self, shard: int, start: int, stop: int) -> Block:
        """Rows ``start:stop`` of one shard, copied into memory (labels, ids and bag offsets checked)."""
        a = self.arrays(shard)
        cats, labels = np.array(a["cats"][start:stop]), a["labels"][start:stop]
        if labels.size and labels.max() > 1:
            row = start + int(np.argmax(labels > 1))
            raise InputError(f"{self._file(shard, 'labels')}: row {row} has label {int(labels[row - start])}; "
                             f"labels must be 0 or 1 (damaged or foreign shard)")
        if cats.size and cats.min() < 0:
            row, col = divmod(int(np.argmax(cats.reshape(-1) < 0)), cats.shape[1])
            names = [s.name for s in self.schema.sparse if not s.is_bag]
            raise InputError(f"{self._file(shard, 'cats')}: row {start + row} has {names[col]} id "
                             f"{int(cats[row, col])}; category ids must be >= 0 (damaged or foreign shard)")
        bags = []
        for k in range(sum(s.is_bag for s in self.schema.sparse)):
            offsets, values = a[f"bag{k}.offsets"], a[f"bag{k}.values"]
            o = np.array(offsets[start: stop + 1])
            if o.size and (np.any(np.diff(o) < 0) or o[0] < 0 or o[-1] > values.shape[0]):
                raise InputError(f"{self._file(shard, f'bag{k}.offsets')}: offsets of rows {start}..{stop} are not "
                                 f"increasing within the {values.shape[0]} values (damaged or foreign shard)")
            ids = np.array(values[o[0]: o[-1]])
            if ids.size and ids.min() < 0:
                raise InputError(f"{self._file(shard, f'bag{k}.values')}: an id {int(ids.min())} < 0 in rows "
                                 f"{start}..{stop} (damaged or foreign shard)")
            bags.append(Bag(ids, o - o[0]))
        return Block(np.array(a["dense"][start:stop]), cats, labels.astype(np.float32), tuple(bags))

    def _file(self, shard: int, array: str) -> Path:
        return self.root / self.manifest["shards"][shard]["files"][array]["file"]

    def read(self, start: int, stop: int) -> Block:
        """Global rows ``start:stop`` (may span shards)."""
        if not 0 <= start <= stop <= self.rows:
            raise IndexError(f"rows {start}:{stop} out of range 0:{self.rows}")
        parts = []
        s = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            info = self.shards[s]
            end = min(stop, info.start + info.rows)
            parts.append(self.read_shard_rows(s, start - info.start, end - info.start))
            start, s = end, s + 1
        return Block.concat(parts) if parts else self.empty_block()

    def empty_block(self) -> Block:
        """A block of no rows with this schema's arrays."""
        bags = sum(s.is_bag for s in self.schema.sparse)
        return Block.empty(self.schema.num_dense, len(self.schema.sparse) - bags, bags)

    def read_all(self) -> Block:
        return self.read(0, self.rows)

    def verify(self) -> None:
        """Recomputes every file's sha256; InputError naming the first file that differs."""
        for entry in self.manifest["shards"]:
            self._verify_shard(entry)

    def _verify_shard(self, entry: dict) -> None:
        for name in self.array_specs:
            f = entry["files"][name]
            fpath = self.root / f["file"]
            if not fpath.is_file():
                raise InputError(f"{fpath}: missing shard file listed in the manifest")
            size = fpath.stat().st_size
            if "bytes" in f and size != f["bytes"]:
                raise InputError(f"{fpath}: {size} bytes, the manifest says {f['bytes']} (truncated or changed "
                                 f"since conversion)")
            if sha256_file(fpath) != f["sha256"]:
                raise InputError(f"{fpath}: checksum mismatch (file changed or corrupted since conversion)")


def _validate_manifest(m, where: Path) -> Schema:
    """Checks the shape of a shard manifest (InputError naming the file and the first bad field); its schema."""
    def need(ok: bool, name: str, what: str, value) -> None:
        if not ok:
            text = repr(value)
            raise InputError(f"{where}: {name} must be {what}, got {text if len(text) <= 60 else text[:57] + '...'}")

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    need(isinstance(m, dict), "the manifest", "a JSON object", m)
    known = {FORMAT: FORMAT_VERSION, SCHEMA_FORMAT: SCHEMA_FORMAT_VERSION}
    if m.get("format") not in known:
        raise InputError(f"{where}: format {m.get('format')!r} is not {FORMAT!r} or {SCHEMA_FORMAT!r}")
    if m.get("version") != known[m["format"]]:
        raise InputError(f"{where}: format version {m.get('version')} is not supported (this hugeembed reads "
                         f"{known[m['format']]} for {m['format']})")
    if m["format"] == FORMAT:
        schema = criteo_schema()
    else:
        from ..errors import ConfigError

        try:
            schema = Schema.from_dict(m.get("schema"), source=f"{where}: schema")
        except ConfigError as e:
            raise InputError(str(e)) from None
    arrays = shard_arrays(schema)
    need(count(m.get("rows")), "rows", "a non-negative integer", m.get("rows"))
    shards = m.get("shards")
    need(isinstance(shards, list), "shards", "a list of shard records", shards)
    for i, sh in enumerate(shards):
        need(isinstance(sh, dict), f"shards[{i}]", "a shard record (a mapping)", sh)
        need(isinstance(sh.get("name"), str), f"shards[{i}].name", "a string", sh.get("name"))
        need(count(sh.get("rows")), f"shards[{i}].rows", "a non-negative integer", sh.get("rows"))
        files = sh.get("files")
        need(isinstance(files, dict), f"shards[{i}].files", f"a mapping with {list(arrays)}", files)
        for name in arrays:
            rec = files.get(name)
            at = f"shards[{i}].files.{name}"
            need(isinstance(rec, dict), at, "a file record (a mapping)", rec)
            f = rec.get("file")
            need(isinstance(f, str) and f != "" and "/" not in f and f not in (".", ".."), f"{at}.file",
                 "a file name in the shard directory", f)
            sha = rec.get("sha256")
            need(isinstance(sha, str) and len(sha) == 64, f"{at}.sha256", "a hex sha256", sha)
            need("bytes" not in rec or count(rec["bytes"]), f"{at}.bytes", "a non-negative integer", rec.get("bytes"))
            if name.endswith(".values"):
                need(count(rec.get("rows")), f"{at}.rows", "a non-negative integer", rec.get("rows"))
    distinct = m.get("distinct_ids")  # optional: manifests written before it have none
    if distinct is not None:
        need(isinstance(distinct, dict), "distinct_ids", "a mapping of sparse feature -> distinct ids", distinct)
        names = [s.name for s in schema.sparse]
        for name, v in distinct.items():
            need(name in names, "distinct_ids", f"keyed by the schema's sparse features {names}", name)
            need(count(v), f"distinct_ids.{name}", "a non-negative integer", v)
    return schema

