"""Durable writes: fsync a directory, replace a file atomically (used by snapshots and shards)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["fsync_dir", "fsync_write", "atomic_write_text", "sha256_file"]


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_write(path: Path, data: bytes) -> None:
    """Writes `data` to `path` and fsyncs the file."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Replaces `path` with `text` atomically (write beside, fsync, rename, fsync dir)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fsync_write(tmp, text.encode())
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
