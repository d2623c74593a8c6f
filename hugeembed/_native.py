"""Loads hugeembed's native CPU kernels (csrc/*.cpp, built by ``pip install``).

The kernels are plain C functions over raw pointers called through ctypes, which
releases the GIL for the duration of each call.  Every wrapper checks dtype,
device, contiguity and length before handing a pointer over: a kernel never sees
a buffer it could overrun.

The library is loaded on first use, not at import, so that ``import hugeembed``
works (and the torch code paths run) even where it was not built; a CPU fast path
that needs it then raises an ``ImportError`` saying how to build it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from pathlib import Path

import torch

__all__ = ["lib", "available", "fn", "ptr", "check", "nthreads", "tune_malloc", "I64", "I32", "F32", "F64", "PTR"]

I64 = ctypes.c_int64
I32 = ctypes.c_int32
F32 = ctypes.c_float
F64 = ctypes.c_double
PTR = ctypes.c_void_p

_DISABLE_ENV = "HUGEEMBED_DISABLE_NATIVE"
# Must equal he_abi_version() in csrc/abi.cpp.
ABI_VERSION = 3


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


_declared: dict[str, ctypes._CFuncPtr] = {}


def fn(name: str, *argtypes, restype=I64):
    """The kernel `name` with its ctypes signature declared (cached)."""
    f = _declared.get(name)
    if f is None:
        f = getattr(lib(), name)
        f.argtypes = list(argtypes)
        f.restype = restype
        _declared[name] = f
    return f


def check(t: torch.Tensor, dtype: torch.dtype, what: str, numel: int | None = None) -> torch.Tensor:
    """Returns `t` if it is a contiguous CPU tensor of `dtype` (and `numel` elements)."""
    if t.device.type != "cpu":
        raise ValueError(f"{what}: native kernel needs a CPU tensor, got device {t.device}")
    if t.dtype != dtype:
        raise ValueError(f"{what}: expected dtype {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: expected a contiguous tensor")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{what}: expected {numel} elements, got {t.numel()}")
    return t


def ptr(t: torch.Tensor | None) -> int | None:
    """Raw data pointer of a tensor (None for None or an empty tensor)."""
    if t is None or t.numel() == 0:
        return None
    return t.data_ptr()


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
