"""The optimizer kernels of csrc/optim.cpp, called through hugeembed._native.call.

Callers have already checked shapes; the kernel checks every buffer's length and every
slot itself before writing (a kernel must never overrun), and a bad slot comes back as
an IndexError naming it.
"""

from __future__ import annotations

import torch

from .. import _native

__all__ = ["run"]


def run(kernel: str, storage: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor | None, dim: int,
        ints: tuple = (), reals: tuple = ()) -> None:
    """Calls `kernel` on rows `slots` of `storage` [rows, width] with the rule's own integer and
    real arguments (csrc/optim.cpp and csrc/optim_adam.cpp list them per kernel).

    `grad` may be None only for a kernel call that reads no gradient (Adam's catch-up).
    """
    try:
        _native.call(kernel, (storage, slots, grad), (storage.shape[1], dim, *ints), reals)
    except _native.KernelError as e:
        if e.status == _native.Status.BAD_VALUE:
            pos, slot = e.detail[:2]
            raise IndexError(f"slot {slot} at position {pos} is out of range for a table of {storage.shape[0]} "
                             "rows") from None
        raise
