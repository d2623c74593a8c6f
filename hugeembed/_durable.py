"""Durable writes: fsync a directory, replace a file atomically (used by snapshots and shards).

Files are opened with ``O_NOFOLLOW``: a symbolic link planted where we write (a temp file's
name is predictable) is refused, never written through.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["fsync_dir", "fsync_write", "atomic_write_text", "sha256_file", "open_no_follow", "process_alive",
           "start_writeback"]


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open with O_NOFOLLOW | O_CLOEXEC: OSError (ELOOP) when `path` is a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _sync_file_range():
    try:
        import ctypes

        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: fsync alone does the work
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return f


_SYNC_FILE_RANGE = _sync_file_range()


def start_writeback(fd: int) -> None:
    """Starts writing a file's dirty pages to disk without waiting (Linux's sync_file_range), so that
    the fsync that makes it durable later has less to wait for; a no-op where that call is missing.
    Durability still comes from that fsync alone."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE: from offset 0 to the end of the file


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_write(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Writes `data` to `path` (never through a symbolic link; `exclusive`: a new file only) and fsyncs it."""
    fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC))
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Replaces `path` with `text` atomically (write beside, fsync, rename, fsync dir).

    The file beside is created exclusively: one left by a crashed process of the same pid is
    removed first (unlink removes a link itself, never its target)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fsync_write(tmp, text.encode(), exclusive=True)
    except FileExistsError:
        tmp.unlink()
        fsync_write(tmp, text.encode(), exclusive=True)  # another one planted meanwhile: FileExistsError
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks (works on Python 3.10, unlike hashlib.file_digest)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (EPERM: it does, under another user): a temp file named
    with a live writer's pid is that writer's, not a crash's leftover."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
