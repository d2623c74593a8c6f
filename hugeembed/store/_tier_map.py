"""A tier file's misses read through a shared read-only mapping of it (RowFile.read_rows).

A miss the page cache holds costs ~1 us through ``preadv`` (the call and the page cache's lookup,
for 260 B); through a mapping it is a plain load once the page is mapped.  The mapping is kept
while the file is at most `MAP_LIMIT` bytes: its mapped pages are page-cache pages the file has
anyway, but they show in the process's RSS, and a page the page cache does not hold is read by
the faulting thread alone (no queue depth): a file larger than that (a table larger than memory)
is read through ``preadv`` and its I/O threads as before.  The file only grows (records are
appended, never truncated), so a mapping of its first records stays valid; a record past it maps
the file again at its current size.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings

import torch

from .. import _native

__all__ = ["FileMap", "MAP_LIMIT"]

MAP_LIMIT = 4 << 30  # bytes of file read through the mapping (see above)


class FileMap:
    """The records of the file `fd` (`record_bytes` each) as a [n, record_bytes] uint8 tensor over a
    read-only shared mapping, mapped on first use and again when a read reaches past it."""

    def __init__(self, fd: int, record_bytes: int, limit: int = MAP_LIMIT) -> None:
        self.fd, self.record_bytes, self.limit = fd, int(record_bytes), int(limit)
        self._mm: mmap.mmap | None = None
        self._rows: torch.Tensor | None = None
        self._n = 0  # records mapped
        self._lock = threading.Lock()  # a mapping is never replaced while a copy reads it

    def read_rows(self, records: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> bool:
        """``rows[slots[i]] = record records[i]`` through the mapping (rows: contiguous [C, W] CPU
        rows of record_bytes each).  Returns False, having read nothing, when a record or slot is out
        of range, a record lies past the file's end, or the file is over the limit: the caller reads
        them through ``preadv`` (which says what is wrong)."""
        cache = rows.view(torch.uint8).view(-1, self.record_bytes)
        if int(records.min()) < 0 or int(slots.min()) < 0 or int(slots.max()) >= cache.shape[0]:
            return False
        hi = int(records.max())
        with self._lock:
            if hi >= self._n and not self._remap(hi):
                return False
            if _native.available():  # one memcpy a row, prefetched (torch's two index ops: ~4x the time)
                _native.call("he_copy_rows", [self._rows, records.contiguous(), cache, slots.contiguous()],
                             [self.record_bytes])
            else:
                cache.index_copy_(0, slots, self._rows.index_select(0, records))
        return True

    def _remap(self, hi: int) -> bool:
        """Maps the file at its current size; False (nothing mapped) if record `hi` is past its end or
        the file is over the limit."""
        self._unmap()
        n = os.fstat(self.fd).st_size // self.record_bytes
        if hi >= n or n * self.record_bytes > self.limit:
            return False
        self._mm = mmap.mmap(self.fd, n * self.record_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # torch warns of a read-only buffer: nothing writes through it
            warnings.simplefilter("ignore", UserWarning)
            self._rows = torch.frombuffer(self._mm, dtype=torch.uint8).view(n, self.record_bytes)
        self._n = n
        return True

    def _unmap(self) -> None:
        self._rows, self._n = None, 0
        if self._mm is not None:
            mm, self._mm = self._mm, None
            mm.close()

    def close(self) -> None:
        with self._lock:
            self._unmap()
