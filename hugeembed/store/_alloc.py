"""Host allocations for big store arrays: memory of their own, on 2 MiB pages where the kernel allows.

Random row and bucket accesses are TLB-bound on 4 KiB pages (docs/architecture.md:
a random gather runs 1.4-2x faster with ``madvise(MADV_HUGEPAGE)``).  THP is in
"madvise" mode on our machines, so a buffer only gets huge pages if we ask before
first touching it: map a little more than needed, align to 2 MiB, madvise, then hand
out a view.  The memory is an anonymous mapping of its own, not malloc's: when a
group grows, the arrays it leaves go back to the system at once (under
``_native.tune_malloc`` malloc keeps freed blocks, and a process whose tables grew
would hold every generation of them).  Everything else (CUDA, small arrays) is a plain
torch.empty.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys

import torch

__all__ = ["empty", "allocate_rows", "HUGE_PAGES"]

_HUGE = 2 << 20
_MIN_BYTES = 8 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h

# Module switch (bench/tables.py flips it to measure the difference).
HUGE_PAGES = True


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty(shape) whose memory (when large and on CPU) is asked to live on huge pages."""
    device = torch.device(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    advise = _madvise()
    if device.type != "cpu" or not HUGE_PAGES or nbytes < _MIN_BYTES or advise is None:
        return torch.empty(shape, dtype=dtype, device=device)
    # MAP_PRIVATE: mmap's default anonymous map is MAP_SHARED (shmem), which THP never backs
    region = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # freed with its last view
    offset = (-raw.data_ptr()) % _HUGE
    out = raw[offset : offset + nbytes].view(dtype).view(shape)
    # A refusal (no THP support) only costs speed: the memory is valid either way.
    advise(out.data_ptr(), nbytes - nbytes % _HUGE, _MADV_HUGEPAGE)
    return out


def allocate_rows(num_rows: int, dim: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised ``[num_rows, dim]`` table for the functional lookups, on 2 MiB pages
    when it is a big CPU table (1.4-2x faster random row access;
    docs/architecture.md).

    Example::

        W = allocate_rows(10_000_000, 16).uniform_(-0.05, 0.05)
    """
    return empty((int(num_rows), int(dim)), dtype, device)
