"""Triton kernels for CUDA tables (issue 32): the `triton` backend beside the torch reference.

Every kernel module in this package is imported only when triton imports; each declares
``COMPILE_CASES``: ``(name, jit_fn, signature, constexprs[, options])`` tuples that `compile_check`
compiles for a GPU this machine may not have (``bash bench/gpu_check.sh compile``).

On a machine without CUDA the kernels run under triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported; the tests do so), on CPU tensors, one program after another.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

__all__ = ["available", "interpreting", "kernel_modules"]


def available() -> bool:
    """True when triton imports (the backend is chosen for CUDA tables only then)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_modules() -> list:
    """Every kernel module of this package (those not starting with ``_`` besides ``compile_check``)."""
    mods = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "compile_check":
            continue
        mods.append(importlib.import_module(f"{__name__}.{info.name}"))
    return mods
