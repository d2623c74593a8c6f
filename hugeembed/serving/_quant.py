"""Rows as served: float32, float16, or row-wise int8 / int4 in PyTorch's prepacked layouts.

int8 and int4 rows are quantized per row, min-max (scale = (max - min) / 255 or / 15,
bias = min), by torch's own ``embedding_bag_byte_prepack`` / ``embedding_bag_4bit_prepack``,
so torch's ``*_rowwise_offsets`` kernels (and FBGEMM's, which share the layout) read them.
A row is quantized alone: the same weights give the same bytes in a full export and in a
delta, whichever rows surround them.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ._runtime import DTYPES

__all__ = ["quantize", "dequantize", "row_width", "storage_dtype"]

_CHUNK_ROWS = 1 << 18  # prepack makes float32 copies: bound them for big tables


def row_width(dtype: str, dim: int) -> int:
    """Columns of one stored row."""
    return {"fp32": dim, "fp16": dim, "int8": dim + 8, "int4": dim // 2 + 4}[_check(dtype)]


def storage_dtype(dtype: str) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.uint8, "int4": torch.uint8}[_check(dtype)]


def _check(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def quantize(weights: torch.Tensor, dtype: str) -> torch.Tensor:
    """``[N, D]`` float weights -> ``[N, row_width]`` stored rows (a new tensor)."""
    _check(dtype)
    w = weights.detach().to("cpu")
    if dtype == "fp32":
        return w.to(torch.float32).contiguous().clone()
    if dtype == "fp16":
        return w.to(torch.float16).contiguous()
    if dtype == "int4" and w.shape[1] % 2:
        raise ConfigError(f"int4 rows pack two values a byte (torch's 4-bit layout): dim {w.shape[1]} is odd")
    op = (torch.ops.quantized.embedding_bag_byte_prepack if dtype == "int8"
          else torch.ops.quantized.embedding_bag_4bit_prepack)
    out = torch.empty(w.shape[0], row_width(dtype, w.shape[1]), dtype=torch.uint8)
    for s in range(0, w.shape[0], _CHUNK_ROWS):
        out[s: s + _CHUNK_ROWS] = op(w[s: s + _CHUNK_ROWS].to(torch.float32).contiguous())
    return out


def dequantize(rows: torch.Tensor, dtype: str, dim: int) -> torch.Tensor:
    """Stored rows -> ``[N, D]`` float32 (what a lookup reads)."""
    _check(dtype)
    if dtype in ("fp32", "fp16"):
        return rows.to(torch.float32)
    if dtype == "int8":
        return torch.ops.quantized.embedding_bag_byte_unpack(rows.contiguous())[:, :dim]
    return torch.ops.quantized.embedding_bag_4bit_unpack(rows.contiguous())[:, :dim]
