"""Data files (Criteo TSV, or CSV / TSV / Parquet under a schema) -> memory-mappable binary shards, atomically.

The shards are written into a temporary directory beside the target
(``.<name>.tmp-<pid>-<token>``), every file is fsynced, the manifest is written
last, and the directory is renamed into place.  A crash leaves only the temporary
directory, which the next run removes (the dead process's pid is in its name) before
starting over from the first line: conversion never resumes a half-written output.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError, InputError
from ._criteo import PathLike, ReadSummary
from .._durable import fsync_dir, process_alive
from ._distinct import DistinctSketch
from ._reader import TableReader, fit_stats
from ._schema import Schema, criteo_schema
from ._shards import FORMAT, FORMAT_VERSION, SCHEMA_FORMAT, SCHEMA_FORMAT_VERSION, NpyWriter, schema_dict, shard_arrays

__all__ = ["convert", "ConvertProgress", "ConvertSummary"]

DEFAULT_ROWS_PER_SHARD = 1 << 20


@dataclass(frozen=True)
class ConvertProgress:
    """Passed to the progress callback after each chunk (bytes are on-disk, i.e. compressed for .gz)."""

    bytes_done: int
    bytes_total: int
    rows: int
    skipped: int


@dataclass(frozen=True)
class ConvertSummary:
    """What a conversion wrote."""

    out_dir: Path
    rows: int
    skipped: int
    shards: int
    bytes_in: int
    seconds: float
    skipped_examples: tuple[str, ...]

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / 1e6 / max(self.seconds, 1e-9)


class _ShardWriter:
    def __init__(self, root: Path, rows_per_shard: int, schema: Schema) -> None:
        self.root, self.rows_per_shard = root, rows_per_shard
        self.arrays = shard_arrays(schema)
        self.done: list[dict] = []
        self._writers: dict[str, NpyWriter] | None = None
        self._bag_base: list[int] = []

    def _name(self) -> str:
        return f"part-{len(self.done):05d}"

    def append(self, block) -> None:
        pos = 0
        while pos < len(block):
            if self._writers is None:
                name = self._name()
                self._writers = {k: NpyWriter(self.root / f"{name}.{k}.npy", dt, shape)
                                 for k, (dt, shape) in self.arrays.items()}
                self._bag_base = [0] * len(block.bags)
                for k in range(len(block.bags)):
                    self._writers[f"bag{k}.offsets"].append(np.zeros(1, np.int64))
            w = self._writers
            take = min(len(block) - pos, self.rows_per_shard - w["labels"].rows)
            part = block.slice(pos, pos + take)
            w["dense"].append(part.dense)
            w["cats"].append(part.cats)
            w["labels"].append(part.labels.astype("uint8"))
            for k, bag in enumerate(part.bags):
                w[f"bag{k}.values"].append(bag.values)
                w[f"bag{k}.offsets"].append(bag.offsets[1:] + self._bag_base[k])
                self._bag_base[k] += int(bag.offsets[-1])
            pos += take
            if w["labels"].rows == self.rows_per_shard:
                self._finish()

    def _finish(self) -> None:
        w = self._writers
        assert w is not None
        name = self._name()

        def seal(writer: NpyWriter) -> dict:  # fsync and sha256 release the GIL: the files seal side by side
            writer.write_header()
            digest = writer.sha256()  # while the disk finishes the writeback that fsync waits for
            writer.close()
            return {"file": writer.path.name, "bytes": writer.path.stat().st_size, "sha256": digest}

        with ThreadPoolExecutor(max_workers=min(len(w), 4)) as pool:
            sealed = dict(zip(w, pool.map(seal, w.values())))
        files = {}
        for k, writer in w.items():
            files[k] = sealed[k]
            if k.endswith(".values"):
                files[k]["rows"] = writer.rows
        self.done.append({"name": name, "rows": w["labels"].rows, "files": files})
        self._writers = None

    def close(self) -> None:
        if self._writers is not None:
            self._finish()

    def abort(self) -> None:
        for writer in (self._writers or {}).values():
            writer.abort()


@contextlib.contextmanager
def _old_objects_frozen():
    """The objects alive before the conversion kept out of the garbage collector's passes while it runs.

    Those passes visit every tracked object: with torch imported, a full one over its heap costs ~0.3 s, and
    the chunks' pyarrow and NumPy wrappers trigger one every few conversions.  Freezing changes what is
    scanned, never what is freed: the objects a conversion makes are still collected (cycles too), and the
    frozen ones go back to the oldest generation after it.  Left alone when someone else froze objects
    (gc.unfreeze would undo their freeze too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _remove_stale(out: Path) -> None:
    """Removes temporary directories of conversions to `out` whose process is gone."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            pid = int(tmp.name[len(f".{out.name}.tmp-"):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not process_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


@_old_objects_frozen()  # from the start: opening the files imports pyarrow's modules, which can set off a pass
def convert(inputs: PathLike | Sequence[PathLike], out_dir: PathLike, *, schema: Schema | None = None,
            rows_per_shard: int = DEFAULT_ROWS_PER_SHARD, on_error: str = "raise", overwrite: bool = False,
            progress: Callable[[ConvertProgress], None] | None = None, chunk_bytes: int = 8 << 20,
            native: bool | None = None) -> ConvertSummary:
    """Converts data files into binary shards under `out_dir`: Criteo TSV (plain or .gz) by default, or
    CSV / TSV / Parquet files under `schema`.

    Args:
        inputs: one file or a list, converted in order (row order is kept).
        schema: how the files' columns become model input (default: the built-in Criteo schema).  The
            mean and std of its standardize columns are fitted on `inputs` (a first pass over those
            columns) and stored with the schema in the manifest.
        out_dir: the directory to create; must not exist unless `overwrite`.
        rows_per_shard: rows per shard (the last shard may hold fewer).
        on_error: "raise" (InputError at the first malformed line, nothing written) or
            "skip" (malformed lines skipped and counted in the manifest and summary).
            Inputs without a single row (empty, or every line skipped) are an InputError:
            nothing is written.
        overwrite: replace an existing `out_dir` (the old one is removed only after the new
            one is complete).
        progress: called with a ConvertProgress after each chunk.
        chunk_bytes: bytes parsed per call.

    Returns:
        ConvertSummary (rows, skipped, shards, bytes read, seconds).

    Example::

        convert(["day_0.gz"], "shards/day_0", on_error="skip")
        ShardSet("shards/day_0").read(0, 10)   # the first 10 rows, exactly as the TSV reader gives them
    """
    if rows_per_shard < 1:
        raise ConfigError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    schema = schema or criteo_schema()
    reader = TableReader(inputs, schema, on_error=on_error, chunk_bytes=chunk_bytes, native=native)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(errno.EEXIST, "output exists (pass overwrite=True / --overwrite to replace it)", str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    t0 = time.perf_counter()
    writer = _ShardWriter(tmp, rows_per_shard, schema)
    distinct = DistinctSketch([s.name for s in schema.sparse], [s.is_bag for s in schema.sparse])
    try:
        if schema.needs_stats():
            schema = fit_stats(reader.paths, schema)
            reader = TableReader(reader.paths, schema, on_error=on_error, chunk_bytes=chunk_bytes, native=native)
        summary = reader.summary
        for block in reader:
            writer.append(block)
            distinct.add(block)
            summary = reader.summary
            if progress is not None:
                progress(ConvertProgress(summary.bytes_read, summary.bytes_total, summary.rows, summary.skipped))
        summary = reader.summary
        if summary.rows == 0:  # an empty set of shards would only fail later, when training finds no batch
            names = ", ".join(str(f.path) for f in summary.files)
            why = "no lines" if summary.lines == 0 else f"all {summary.skipped:,} line(s) malformed and skipped"
            raise InputError(f"{names}: no rows to convert ({why}); nothing written to {out}")
        writer.close()
        if progress is not None:
            progress(ConvertProgress(summary.bytes_total, summary.bytes_total, summary.rows, summary.skipped))
        _write_manifest(tmp, writer.done, summary, on_error, schema, distinct.estimates())
        fsync_dir(tmp)
        _publish(tmp, out, overwrite)
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertSummary(out, summary.rows, summary.skipped, len(writer.done), summary.bytes_total,
                          time.perf_counter() - t0, tuple(summary.skipped_examples))


def _write_manifest(root: Path, shards: list[dict], summary: ReadSummary, on_error: str, schema: Schema,
                    distinct_ids: dict[str, int]) -> None:
    criteo = schema.is_criteo()  # Criteo shards stay as they were before schemas existed
    manifest = {
        "format": FORMAT if criteo else SCHEMA_FORMAT,
        "version": FORMAT_VERSION if criteo else SCHEMA_FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "schema": schema_dict() if criteo else schema.to_dict(),
        "rows": sum(s["rows"] for s in shards),
        "shards": shards,
        "sources": [{"path": str(Path(f.path).resolve()), "bytes": f.bytes, "lines": f.lines, "rows": f.rows,
                     "skipped": f.skipped} for f in summary.files],
        "on_error": on_error,
        "skipped": summary.skipped,
        "skipped_examples": summary.skipped_examples,
        # estimated distinct ids per sparse feature (HyperLogLog, ~1.6% error): the planner's rows hint
        "distinct_ids": distinct_ids,
    }
    path = root / "manifest.json"
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Renames the finished temporary directory to `out` (replacing it if asked)."""
    old = None
    if out.exists():
        if not overwrite:  # appeared while we were converting
            raise FileExistsError(errno.EEXIST, "output appeared during conversion", str(out))
        old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
