"""Loads hugeembed's native CPU kernels (csrc/*.cpp, built by ``pip install``) and calls them.

Every kernel is called one way, ``call(name, bufs, ints, reals)`` (csrc/call.h): the
tensors go over as (pointer, element count, element type), so the kernel itself checks
that each buffer is as long and of the type it needs; a kernel that fails reports a
status, a message and the position of the bad value, and ``call`` raises
``KernelError`` with them.  ctypes releases the GIL for the duration of each call.
Here each tensor is checked to be a CPU tensor laid out as the kernel reads it.

The library is loaded on first use, not at import, so that ``import hugeembed``
works (and the torch code paths run) even where it was not built; a CPU fast path
that needs it then raises an ``ImportError`` saying how to build it.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import importlib.machinery
import os
import threading
from pathlib import Path

import numpy as np
import torch

__all__ = ["lib", "available", "call", "rows", "KernelError", "Status", "nthreads", "tune_malloc"]

I64 = ctypes.c_int64
F64 = ctypes.c_double

_DISABLE_ENV = "HUGEEMBED_DISABLE_NATIVE"
# Must equal he_abi_version() in csrc/abi.cpp.
ABI_VERSION = 6


_KERNELS_ENV = "HUGEEMBED_KERNELS"  # "portable" or "avx2" forces a build; default: the best this CPU runs


def _cpu_has_avx2() -> bool:
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except Exception:  # an old torch or an unknown platform: the portable build is always safe
        return False


def _library_path() -> Path | None:
    here = Path(__file__).resolve().parent
    wanted = os.environ.get(_KERNELS_ENV, "")
    if wanted not in ("", "portable", "avx2"):
        raise ImportError(f"{_KERNELS_ENV}={wanted!r}: expected 'portable' or 'avx2'")
    names = {"portable": ["_kernels"], "avx2": ["_kernels_avx2"]}.get(wanted) or (
        ["_kernels_avx2", "_kernels"] if _cpu_has_avx2() else ["_kernels"])
    for name in names:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = here / f"{name}{suffix}"
            if candidate.exists():
                return candidate
    if wanted == "avx2":
        raise ImportError(f"{_KERNELS_ENV}=avx2 but the AVX2 build of the kernels is not there (x86-64 only)")
    return None


@functools.cache
def _load() -> ctypes.CDLL | None:
    if os.environ.get(_DISABLE_ENV, "") not in ("", "0"):
        return None
    path = _library_path()
    if path is None:
        return None
    loaded = ctypes.CDLL(str(path))
    version = loaded.he_abi_version
    version.restype = I64
    if version() != ABI_VERSION:
        raise ImportError(
            f"hugeembed's native kernels at {path} are stale (ABI {version()}, expected "
            f"{ABI_VERSION}); rebuild them with `pip install -e .`"
        )
    return loaded


def available() -> bool:
    """True when the native kernels are built and not disabled by HUGEEMBED_DISABLE_NATIVE=1."""
    return _load() is not None


def lib() -> ctypes.CDLL:
    """The loaded kernel library; raises ImportError naming the fix when it is missing."""
    loaded = _load()
    if loaded is None:
        if os.environ.get(_DISABLE_ENV, "") not in ("", "0"):
            raise ImportError(f"hugeembed native kernels are disabled by {_DISABLE_ENV}")
        raise ImportError(
            "hugeembed's native CPU kernels (hugeembed/_kernels*.so) are not built. "
            "Install the package with `pip install -e .` (needs a C++17 compiler), "
            "or set HUGEEMBED_DISABLE_NATIVE=1 to run the plain-PyTorch code paths."
        )
    return loaded


class Status(enum.IntEnum):
    """How a kernel call ended (csrc/call.h::he_status)."""

    OK = 0
    BAD_CALL = 1  # the caller broke the convention: a bug of ours, never the user's
    BAD_VALUE = 2  # a value in the input is invalid; detail says which
    NO_MEMORY = 3
    IO_ERROR = 4  # detail[0] = errno


class KernelError(RuntimeError):
    """A kernel refused its input (it changed nothing): `status`, `detail` (kernel-specific
    positions and values, see its comment in csrc/) and the kernel's own message."""

    def __init__(self, kernel: str, status: int, detail: tuple[int, ...], message: str):
        self.kernel, self.detail = kernel, detail
        self.status = Status(status) if status in Status._value2member_map_ else status
        super().__init__(message or f"{kernel} failed with status {status}")


# Element types (csrc/call.h::he_type); uint8 buffers are raw bytes
_TYPES = {torch.uint8: 0, torch.int8: 1, torch.int32: 2, torch.int64: 3, torch.float32: 4, torch.float64: 5}
_NP_TYPES = {np.dtype(np.uint8): 0, np.dtype(np.int8): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3,
             np.dtype(np.float32): 4, np.dtype(np.float64): 5}
_DETAIL = 6
_I64_MAX = 2**63 - 1
_MESSAGE = 232


class _Call(ctypes.Structure):  # csrc/call.h::he_call, field for field (bufs: he_buf = 3 int64 each)
    _fields_ = [("bufs", ctypes.c_void_p), ("nbufs", I64), ("ints", ctypes.c_void_p), ("nints", I64),
                ("reals", ctypes.c_void_p), ("nreals", I64), ("nthreads", I64), ("status", I64),
                ("detail", I64 * _DETAIL), ("message", ctypes.c_char * _MESSAGE)]


class rows:  # noqa: N801 (reads as a marker at the call site: call(k, [rows(storage), ...]))
    """A 2-D tensor whose rows may be spaced wider than they are long (a view of some
    columns of a wider table): handed over as its span from the first element to the
    last, with the row stride passed as an argument of its own."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


_kernels: dict[str, ctypes._CFuncPtr] = {}


def _kernel(name: str):
    f = _kernels.get(name)
    if f is None:
        try:
            f = getattr(lib(), name)
        except AttributeError:
            raise ImportError(f"hugeembed's native kernels lack {name} (an older build); rebuild them with "
                              "`pip install -e .`") from None
        f.argtypes = [ctypes.POINTER(_Call)]
        f.restype = I64
        _kernels[name] = f
    return f


def _entry(name: str, k: int, b) -> tuple:
    """(address or 0, element count, element type) of buffer k, or ValueError saying why not."""
    if b is None:
        return (0, 0, 0)
    if isinstance(b, torch.Tensor):
        t, spanned = b, False
    elif isinstance(b, rows):
        t, spanned = b.t, True
    elif isinstance(b, np.ndarray):
        if not b.flags.c_contiguous or b.dtype not in _NP_TYPES:
            raise ValueError(f"{name}: buffer {k} must be a C-contiguous array of a kernel type, got {b.dtype}")
        return (b.ctypes.data if b.size else 0, b.size, _NP_TYPES[b.dtype])
    else:
        raise ValueError(f"{name}: buffer {k} is a {type(b).__name__}, not a tensor")
    if not t.is_cpu:
        raise ValueError(f"{name}: buffer {k} must be a CPU tensor, got device {t.device}")
    code = _TYPES.get(t.dtype)
    if code is None:
        raise ValueError(f"{name}: buffer {k} has dtype {t.dtype}, which no kernel reads")
    n = t.numel()
    if spanned:
        if t.dim() != 2 or (t.stride(1) != 1 and t.size(1) > 1) or t.stride(0) < 0:
            raise ValueError(f"{name}: buffer {k} must be 2-D with unit column stride")
        n = 0 if n == 0 else (t.size(0) - 1) * t.stride(0) + t.size(1)
    elif not t.is_contiguous():
        raise ValueError(f"{name}: buffer {k} must be contiguous")
    return (t.data_ptr() if n else 0, n, code)


class _Frame(threading.local):
    """One thread's argument arrays and call record, reused by every call on that thread.

    A fresh ~1 KiB argument array per call would come from malloc, which carves it out of
    the freed block a big per-step tensor (a pooled output) left behind: the next such
    tensor no longer fits there and is faulted in afresh (a d64 P20 forward ran 2-10x
    slower for its first calls so)."""

    BUFS, INTS, REALS = 3 * 256, 512, 64

    def __init__(self):
        self.bufs, self.ints, self.reals = (I64 * self.BUFS)(), (I64 * self.INTS)(), (F64 * self.REALS)()
        self.record = _Call(ctypes.addressof(self.bufs), 0, ctypes.addressof(self.ints), 0,
                            ctypes.addressof(self.reals), 0, 0)
        self.ref = ctypes.byref(self.record)
        self.busy = False


_frame = _Frame()


def call(name: str, bufs=(), ints=(), reals=()) -> int:
    """Runs kernel `name` (csrc/call.h); returns its result, raises KernelError when it fails.

    `bufs`: tensors (contiguous, CPU), ``rows(t)`` for a row-strided 2-D tensor, numpy arrays,
    or None for an absent optional buffer.  The caller keeps them alive for the call.
    """
    f = _kernels.get(name) or _kernel(name)
    if ints and (max(ints) > _I64_MAX or min(ints) < -_I64_MAX - 1):  # a ctypes array would wrap it silently
        raise OverflowError(f"{name}: an integer argument is outside int64: {list(ints)}")
    fr = _frame
    # Into this thread's frame (no allocation: see _Frame), unless it is in use (a finalizer
    # freeing a kernel's context, run by the garbage collector inside a call) or too short.
    if fr.busy or 3 * len(bufs) > fr.BUFS or len(ints) > fr.INTS or len(reals) > fr.REALS:
        flat: list[int] = []
        for k, b in enumerate(bufs):
            flat += _entry(name, k, b)
        bf, it, rl = (I64 * len(flat))(*flat), (I64 * len(ints))(*ints), (F64 * len(reals))(*reals)
        c = _Call(ctypes.addressof(bf), len(bufs), ctypes.addressof(it), len(ints), ctypes.addressof(rl), len(reals),
                  nthreads())
        result = f(ctypes.byref(c))
    else:
        fr.busy = True
        try:
            # One plain pass over the buffers: the kernels take each row storage once (of_table
            # says which a table reads), so no caller repeats a buffer per table, and a dict of
            # distinct buffers cost 2x this loop for the optimizer's 3 (bench/ab_lookup.py).
            fb, types, j = fr.bufs, _TYPES, 0
            for k, b in enumerate(bufs):
                # the common case inline (~0.3 us a buffer)
                if type(b) is torch.Tensor and b.is_cpu and b.is_contiguous() and b.dtype in types:
                    n = b.numel()
                    fb[j], fb[j + 1], fb[j + 2] = b.data_ptr() if n else 0, n, types[b.dtype]
                else:
                    fb[j], fb[j + 1], fb[j + 2] = _entry(name, k, b)
                j += 3
            c = fr.record
            fr.ints[: len(ints)] = ints
            fr.reals[: len(reals)] = reals
            c.nbufs, c.nints, c.nreals, c.nthreads = len(bufs), len(ints), len(reals), nthreads()
            result = f(fr.ref)
            # read while the frame is still ours: a finalizer may call a kernel right after
            failed = (c.status, tuple(c.detail), c.message) if c.status else None
        finally:
            fr.busy = False
        if failed is None:
            return result
        raise KernelError(name, failed[0], failed[1], failed[2].decode(errors="replace"))
    if c.status:
        raise KernelError(name, c.status, tuple(c.detail), c.message.decode(errors="replace"))
    return result


def nthreads() -> int:
    return max(1, torch.get_num_threads())


_malloc_tuned: bool | None = None


def tune_malloc(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keeps freed memory in glibc's heap so per-step buffers are not page-faulted afresh.

    By default glibc serves large blocks with mmap and returns freed heap tops to the
    OS, so every training step faults its batch-sized buffers in again (first touch
    runs at ~2 GB/s here, 10x slower than writing reused memory:
    docs/architecture.md, measured facts).
    Raising the mmap and trim thresholds keeps those pages for reuse.  Process-wide,
    so opt-in: the CLI and the benchmarks call it; a library import never does.
    Returns True when applied (glibc only), False elsewhere.
    """
    global _malloc_tuned
    if _malloc_tuned is not None:
        return _malloc_tuned
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = bool(libc.mallopt(m_mmap_threshold, int(mmap_threshold))) and bool(
            libc.mallopt(m_trim_threshold, int(trim_threshold)))
    except (OSError, AttributeError):
        ok = False
    _malloc_tuned = ok
    return ok
