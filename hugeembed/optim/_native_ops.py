"""ctypes wrappers of the optimizer kernels in csrc/optim.cpp.

Callers have already checked shapes; these wrappers check dtype, device and
contiguity again right before handing pointers over (a kernel must never
overrun), and turn a kernel's bad-slot report into an IndexError.
"""

from __future__ import annotations

import ctypes

import torch

from .. import _native
from .._native import F32, F64, I32, I64, PTR

__all__ = ["run"]

_SIGNATURES: dict[str, tuple] = {
    # (storage, R, W, D, slots, U, grad, <hyperparameters>, nthreads, err)
    "he_optim_sgd": (F32, F32),
    "he_optim_momentum": (F32, F32, F32, I32),
    "he_optim_adagrad": (F32, F32, F32),
    "he_optim_rowwise_adagrad": (F32, F32, F32),
    "he_optim_adam": (F64, F64, F64, F64, F64, I32, I32, I32, I32, I64, F32),
    "he_optim_ftrl": (F32, F64, F32, F32, F32),
}


def run(kernel: str, storage: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor | None, dim: int,
        *hyper) -> None:
    """Calls `kernel` on rows `slots` of `storage` with the per-rule hyperparameters `hyper`.

    `grad` may be None only for a kernel call that reads no gradient (Adam's catch-up).
    """
    rows, width = storage.shape
    _native.check(storage, torch.float32, "optimizer storage", rows * width)
    _native.check(slots, torch.int64, "optimizer slots", slots.numel())
    n = slots.numel()
    if grad is not None:
        _native.check(grad, torch.float32, "optimizer grad", n * dim)
    try:
        f = _native.fn(kernel, PTR, I64, I64, I64, PTR, I64, PTR, *_SIGNATURES[kernel], I32, PTR)
    except AttributeError:
        raise ImportError(
            f"hugeembed's native kernels lack {kernel} (a build older than csrc/optim.cpp); "
            "rebuild them with `pip install -e .`"
        ) from None
    err = (ctypes.c_int64 * 2)()  # not a tensor: no torch op per table and step
    rc = f(_native.ptr(storage), rows, width, dim, _native.ptr(slots), n, _native.ptr(grad), *hyper,
           _native.nthreads(), err)
    if rc == 1:
        pos, slot = err[0], err[1]
        raise IndexError(f"slot {slot} at position {pos} is out of range for a table of {rows} rows")
    if rc != 0:
        raise RuntimeError(f"{kernel} returned unexpected code {rc}")
