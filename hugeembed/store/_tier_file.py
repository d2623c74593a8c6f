"""The disk tier's files: a directory per table, owned by one run, holding one file of rows.

Layout (measured against a RocksDB tier in bench/tiered.py)::

    <storage_dir>/<table>/
        tier.json        which table, row layout and run own the directory
        LOCK             flock'ed while a process has the table open
        rows-<id>.bin    record r (one row: weights then optimizer state, the layout's
                         storage dtype) at byte r * record_bytes; which record holds
                         which row is RecordSpace's (store/_tier_space.py): rows written
                         back are appended as one run, in segments a cleaner reuses

The key index and the record map never go to disk: they stay in memory (reported
beside the budget).

The rows file is scratch: a snapshot holds the table, and a run that resumes rebuilds
its tier from it.  A cleanly closed table leaves its directory empty; one left behind by
a crash is reused only by the same run (its owner tag), and never for another layout.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import uuid
import weakref
from pathlib import Path

import torch

from .. import _native
from .._durable import fsync_write, open_no_follow
from ..errors import ConfigError, StoreError
from ._tier_map import FileMap

__all__ = ["RowFile", "TableDir", "IO_THREADS", "caller_threads", "outer_threads"]

# Reads in flight per batch of misses that wait for the device: an SSD serves ~0.1 ms reads in
# parallel, so the queue depth, not the cores, bounds the miss rate.  What the page cache holds is
# copied by the caller's own intra-op threads (caller_threads()), no more.
IO_THREADS = 16

_outer = threading.local()


def caller_threads() -> int:
    """The intra-op threads of the caller: torch.get_num_threads(), or inside the tier's one-thread
    sections (store/_tier_cache.py: one_thread) the count outside them."""
    return getattr(_outer, "threads", 0) or _native.nthreads()


class outer_threads:
    """Within it, caller_threads() on this thread is `n` (one_thread sets it around a tier call)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self):
        self.prev = getattr(_outer, "threads", 0)
        _outer.threads = self.n

    def __exit__(self, *exc):
        _outer.threads = self.prev
_FORMAT = 1


def _io_error(table: str, what: str, code: int, path: Path) -> StoreError:
    name = errno.errorcode.get(code, str(code))
    return StoreError(f"table '{table}': {what} of tier file {path} failed: [{name}] {os.strerror(code)}")


class RowFile:
    """Fixed-size records in one file: record r at byte ``r * record_bytes``.

    Reads and writes move whole rows between the file and contiguous CPU tensors whose
    rows are records; the native kernels (csrc/tier_io.cpp) copy what the page cache holds on
    the caller's threads and issue the rest from `io_threads` threads, the plain twin (no
    kernels built) one ``os.preadv`` / ``os.pwritev`` per record.
    """

    def __init__(self, path: Path, record_bytes: int, table: str, io_threads: int = IO_THREADS) -> None:
        self.path, self.record_bytes, self.table, self.io_threads = path, int(record_bytes), table, io_threads
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._closer = weakref.finalize(self, _close_fd, self.fd, path)
        self._map = FileMap(self.fd, self.record_bytes)  # read_rows' page-cache hits (store/_tier_map.py)

    def _check(self, records: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.device.type != "cpu" or not rows.is_contiguous() or records.dtype != torch.int64 \
                or rows.shape[0] != records.numel() or rows[0].numel() * rows.element_size() != self.record_bytes:
            raise StoreError(f"table '{self.table}': tier I/O needs contiguous CPU rows of {self.record_bytes} "
                             f"bytes, one per record (internal error)")

    def _native(self, kernel: str, records: torch.Tensor, rows: torch.Tensor, what: str) -> bool:
        """Runs he_tier_read / he_tier_write over all records; False when the kernels are not built."""
        if not _native.available():
            return False
        try:
            _native.call(kernel, [records, rows.view(torch.uint8)],
                         [self.fd, self.record_bytes, self.io_threads, caller_threads()])
        except _native.KernelError as e:
            if e.status != _native.Status.IO_ERROR:
                raise
            raise _io_error(self.table, f"{what} {records.numel()} rows", e.detail[0], self.path) from None
        return True

    def read(self, records: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] = record records[i]`` (out: contiguous [n, W] CPU rows)."""
        if records.numel() == 0:
            return
        self._check(records, out)
        records = records.contiguous()
        if self._native("he_tier_read", records, out, "reading"):
            return
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        b = self.record_bytes
        for i, r in enumerate(records.tolist()):
            if os.preadv(self.fd, [view[i * b : (i + 1) * b]], r * b) != b:
                raise _io_error(self.table, f"reading row {r}", errno.EIO, self.path)

    def read_rows(self, records: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """``rows[slots[i]] = record records[i]`` (rows: contiguous [C, W] CPU rows, a cache; slots
        distinct): through the file's mapping while it holds them (store/_tier_map.py), else a read
        straight into its cache slots (he_tier_read_rows), no buffer between."""
        if self._slots_checked(records, rows, slots, "reads") and not self._map.read_rows(records, rows, slots):
            if not _native.available():
                buf = torch.empty((records.numel(), *rows.shape[1:]), dtype=rows.dtype)
                self.read(records, buf)
                rows.index_copy_(0, slots, buf)
            else:
                self._slots_call("he_tier_read_rows", records, rows, slots, "reading")

    def write_rows(self, records: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """``record records[i] = rows[slots[i]]`` (rows: contiguous [C, W] CPU rows, a cache): written
        from the cache slots (he_tier_write_rows: each run gathered into a buffer of at most 256 KiB per writing
        thread, then one pwritev2); raises as ``write``."""
        if self._slots_checked(records, rows, slots, "writes"):
            if not _native.available():
                self.write(records, rows.index_select(0, slots))
            else:
                self._slots_call("he_tier_write_rows", records, rows, slots, "writing")

    def _slots_checked(self, records: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, what: str) -> bool:
        """Whether there are records to move between the file and cache `slots` of `rows` (checked)."""
        if records.numel() == 0:
            return False
        if rows.device.type != "cpu" or not rows.is_contiguous() or records.dtype != torch.int64 \
                or slots.numel() != records.numel() or rows[0].numel() * rows.element_size() != self.record_bytes:
            raise StoreError(f"table '{self.table}': tier {what} need contiguous CPU rows of {self.record_bytes} "
                             f"bytes and a slot per record (internal error)")
        return True

    def _slots_call(self, kernel: str, records: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                    doing: str) -> None:
        """he_tier_read_rows / he_tier_write_rows; an I/O error raised as StoreError naming the file."""
        try:
            _native.call(kernel, [records.contiguous(), rows.view(torch.uint8), slots.contiguous()],
                         [self.fd, self.record_bytes, self.io_threads, caller_threads()])
        except _native.KernelError as e:
            if e.status != _native.Status.IO_ERROR:
                raise
            raise _io_error(self.table, f"{doing} {records.numel()} rows", e.detail[0], self.path) from None

    def write(self, records: torch.Tensor, rows: torch.Tensor) -> None:
        """``record records[i] = rows[i]``; raises StoreError (the disk full, ...) naming the file."""
        if records.numel() == 0:
            return
        self._check(records, rows)
        records = records.contiguous()
        if self._native("he_tier_write", records, rows, "writing"):
            return
        view = memoryview(rows.view(torch.uint8).numpy()).cast("B")
        b = self.record_bytes
        for i, r in enumerate(records.tolist()):
            try:
                os.pwritev(self.fd, [view[i * b : (i + 1) * b]], r * b)
            except OSError as e:
                raise _io_error(self.table, f"writing row {r}", e.errno or errno.EIO, self.path) from None

    def disk_bytes(self) -> int:
        """Bytes the file occupies on disk (rows never written take none: the file is sparse)."""
        try:
            return os.fstat(self.fd).st_blocks * 512
        except OSError:
            return 0

    def close(self) -> None:
        self._map.close()
        self._closer()


def _close_fd(fd: int, path: Path) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        path.unlink()
    except OSError:
        pass


# Directories this process holds: path -> [lock fd, open tables, layout].  A process may
# open a table's directory twice (load_state_dict builds the new store before dropping
# the old one); each store then has its own rows file.
_held: dict[str, list] = {}
# Reentrant: a TableDir's finalizer (_release) may run from the garbage collector while this thread
# holds the lock (any allocation under it can collect a dead TableDir); a plain Lock deadlocked there.
_held_lock = threading.RLock()


class TableDir:
    """A table's directory under a storage dir: locked for this process, checked, released on close.

    Refused (ConfigError): a directory another process holds open, one left by another run
    (a different `owner` tag, or none given), one holding another table layout.
    """

    def __init__(self, storage_dir: str | os.PathLike, table: str, layout: dict, owner: str | None) -> None:
        self.table, self.owner = table, owner
        self.path = Path(storage_dir) / table
        key = str(self.path.resolve()) if self.path.exists() else str(self.path.absolute())
        meta = {"format": _FORMAT, "table": table, "layout": layout, "owner": owner}
        with _held_lock:
            held = _held.get(key)
            if held is not None:
                if held[2] != layout:
                    raise ConfigError(f"table '{table}': storage directory {self.path} is open in this process for "
                                      f"the layout {held[2]}, not {layout}; give this table another storage_dir")
                held[1] += 1
            else:
                self._open_fresh(meta)
                _held[key] = [self._lock_fd, 1, layout]
            self._key = key
        self._closer = weakref.finalize(self, _release, key, self.path)

    def _open_fresh(self, meta: dict) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = open_no_follow(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)  # never through a planted link
        except OSError as e:
            raise ConfigError(f"table '{self.table}': cannot use storage directory {self.path}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(f"table '{self.table}': storage directory {self.path} is in use by another process; "
                              "give each run its own --storage-dir") from None
        info = self.path / "tier.json"
        try:
            if info.exists():
                try:
                    old = json.loads(info.read_text())
                except (OSError, ValueError):
                    old = {"layout": "unreadable", "owner": None}
                if old.get("layout") != meta["layout"] or old.get("table") != meta["table"]:
                    raise ConfigError(
                        f"table '{self.table}': storage directory {self.path} holds rows of another table layout "
                        f"({old.get('table')!r}: {old.get('layout')}); this table is {meta['layout']}. "
                        "Give it another --storage-dir (or delete that directory)")
                if meta["owner"] is None or old.get("owner") != meta["owner"]:
                    raise ConfigError(
                        f"table '{self.table}': storage directory {self.path} holds rows left by another run "
                        f"(owner {old.get('owner')!r}); it is never reused silently. Delete it, give another "
                        "--storage-dir, or resume that run (same --checkpoint-dir)")
            for stale in self.path.glob("rows-*.bin"):  # our own run's leftovers: the snapshot has the rows
                stale.unlink()
            tmp = self.path / f".tier.json.{os.getpid()}"
            tmp.unlink(missing_ok=True)  # a crashed process's of the same pid (a link itself, never its target)
            fsync_write(tmp, json.dumps(meta, sort_keys=True).encode(), exclusive=True)  # a new file, no link
            os.replace(tmp, info)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def new_rows_path(self) -> Path:
        return self.path / f"rows-{uuid.uuid4().hex[:12]}.bin"

    def close(self) -> None:
        self._closer()


def _release(key: str, path: Path) -> None:
    with _held_lock:
        held = _held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _held[key]
    # the last table of this directory in this process closed cleanly: leave it empty
    for name in ("tier.json",):
        try:
            (path / name).unlink()
        except OSError:
            pass
    try:
        os.close(held[0])
    except OSError:
        pass
