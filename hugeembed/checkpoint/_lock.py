"""One writer per checkpoint directory: an flock on ``<root>/.lock``, freed by the OS when the process dies.

Two runs saving into one directory would replace each other's snapshots (same step names,
one LATEST, pruning of the other's files).  The run holding the lock writes its pid into
the lock file so that a refused run can name it; the file is emptied on release, so a
finished run leaves the directory as it found it (the lock file stays: removing it would
let two processes lock two different files).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .._durable import open_no_follow
from ..errors import CheckpointError

__all__ = ["CheckpointLock", "LOCK_NAME"]

LOCK_NAME = ".lock"


class CheckpointLock:
    """An exclusive, non-blocking lock on a checkpoint directory (created if needed).

    Example::

        with CheckpointLock("runs/ck"):      # CheckpointError naming the holder's pid if taken
            ...save snapshots...
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "CheckpointLock":
        if self._fd is not None:
            return self
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(f"checkpoint directory {self.root} is a file, not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        try:  # never through a symbolic link planted at .lock (it would truncate the file it points to)
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise CheckpointError(f"cannot lock checkpoint directory {self.root}: {self.path}: {e.strerror}"
                                  f"{' (a symbolic link: refused)' if self.path.is_symlink() else ''}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise CheckpointError(f"checkpoint directory {self.root} is in use by another run (pid "
                                  f"{holder or 'unknown'} holds {self.path}): wait for it to end or use another "
                                  f"--checkpoint-dir") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)  # no stale pid left behind
            finally:
                os.close(fd)  # closing the last descriptor drops the flock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "CheckpointLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
