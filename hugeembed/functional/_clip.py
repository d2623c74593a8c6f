"""TF's max_norm rule for looked-up rows (``clip_by_norm`` per row) and its backward: shared by the
torch reference's stages and the other backends' fallbacks."""

from __future__ import annotations

import functools

import torch

__all__ = ["clip_rows", "clip_rows_backward"]


def clip_rows(rows: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """TF's clip_by_norm per row: ``rows * c / max(||row||, c)``."""
    if not max_norm:
        return rows
    norm = torch.sqrt((rows * rows).sum(dim=1, keepdim=True))
    c = _rounded(float(max_norm), rows.dtype)  # a Python scalar: a tensor of it would be a copy to the device
    return (rows * c) / norm.clamp(min=c)


@functools.lru_cache(maxsize=None)
def _rounded(x: float, dtype: torch.dtype) -> float:
    """`x` rounded to `dtype` (what a tensor of it would hold), as a Python float: computed once
    per pair, so a step makes no op for it."""
    return torch.tensor(x, dtype=dtype).item()


def clip_rows_backward(rows: torch.Tensor, grad: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """Transpose Jacobian of clip_rows at `rows` applied to `grad` (row-wise)."""
    if not max_norm:
        return grad
    norm = torch.sqrt((rows * rows).sum(dim=1, keepdim=True))
    clipped = (norm >= max_norm) & (norm > 0)
    safe = torch.where(clipped, norm, torch.ones_like(norm))
    xg = (rows * grad).sum(dim=1, keepdim=True)
    projected = (max_norm / safe) * (grad - rows * (xg / (safe * safe)))
    return torch.where(clipped, projected, grad)
