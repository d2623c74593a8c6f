"""COO helpers of the converters: parse indices and shapes, sort ids into bags, check bounds.

A COO input gives one (row[, column]) per id; these helpers turn it into jagged bags
with vectorised sorts (no loop per id) and raise InputError naming the offending value.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from ..errors import InputError
from ._inputs import INT_DTYPES, as_index, first_true, refuse_meta

__all__ = ["parse_shape", "coo_indices", "check_below", "sort_into_bags", "sample_words", "check_width",
           "sparse_parts"]


def parse_shape(dense_shape: Any, what: str) -> tuple[int, ...] | None:
    if dense_shape is None:
        return None
    t = as_index(dense_shape, what, "dense_shape")  # refuses 1.5, "x", True: int() would truncate or crash
    refuse_meta(t, what)
    shape = tuple(t.reshape(-1).tolist())
    if t.dim() > 1 or len(shape) not in (1, 2) or any(s < 0 for s in shape):
        raise InputError(f"{what}: dense_shape must be [B] or [B, max_nnz] with sizes >= 0, got {list(shape)}")
    return shape


def coo_indices(indices: Any, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row indices ``[n]`` or TF-style ``[n, 2]`` (row, column) as int64 rows and columns."""
    idx = as_index(indices, what, "row indices")
    if idx.dim() == 1:
        return idx, None
    if idx.dim() == 2 and idx.shape[1] == 2:
        return idx[:, 0], idx[:, 1]
    raise InputError(
        f"{what}: row indices must be [n] or TF-style [n, 2] (row, column), got shape {tuple(idx.shape)}"
        + ("; transpose a [2, n] tensor with .t()" if idx.dim() == 2 and idx.shape[0] == 2 else "")
    )


def check_below(t: torch.Tensor, hi: int | None, what: str, label: str) -> None:
    bad = first_true((t < 0) | (t >= hi) if hi is not None else t < 0)
    if bad is not None:
        bound = f"[0, {hi})" if hi is not None else ">= 0"
        raise InputError(f"{what}: {label} {int(t[bad])} (id number {bad}) is outside {bound}")


def sort_into_bags(bags: torch.Tensor, cols: torch.Tensor | None, values: torch.Tensor,
                    weights: torch.Tensor | None, num_bags: int, what: str, where: Callable[[int], str]):
    """Sorts ids by bag (and column); returns (values, weights, lengths [num_bags]).

    Without columns the sort is stable, so ids in one bag keep their input order. With
    columns, ids are ordered by column inside a bag, and a repeated (bag, column) is an error
    (`where` turns a bag number into words for that message).
    """
    if cols is None:
        order = torch.sort(bags, stable=True).indices
    else:
        by_col = torch.sort(cols, stable=True).indices
        order = by_col[torch.sort(bags[by_col], stable=True).indices]
        b, c = bags[order], cols[order]
        dup = first_true((b[1:] == b[:-1]) & (c[1:] == c[:-1]))
        if dup is not None:
            raise InputError(
                f"{what}: two ids at the same position ({where(int(b[dup]))}, column {int(c[dup])}); "
                "one id per position"
            )
    sorted_bags = bags[order]
    # A row index of 2**40 without a dense_shape asks for that many samples.  Checked against
    # the device's memory first: where the OS overcommits, the allocation itself succeeds and
    # writing it gets the process killed.
    too_many = f"{what}: {num_bags} bags (the batch size times the features) do not fit in memory; " \
               "check the row indices and dense_shape"
    if 3 * 8 * (num_bags + 1) > _device_memory(bags.device):  # edges, bounds and lengths, int64
        raise InputError(too_many)
    try:
        edges = torch.arange(num_bags + 1, dtype=torch.int64, device=bags.device)
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        raise InputError(f"{too_many} ({type(e).__name__})") from None
    bounds = torch.searchsorted(sorted_bags, edges)
    return values[order], None if weights is None else weights[order], bounds[1:] - bounds[:-1]


def sample_words(bag: int) -> str:
    return f"sample {bag}"


def check_width(lengths: torch.Tensor, width: int | None, what: str, where: Callable[[int], str]) -> None:
    """Every bag fits in `width` ids (the second dim of a dense_shape)."""
    bad = first_true(lengths > width) if width is not None else None
    if bad is not None:
        raise InputError(f"{what}: {where(bad)} has {int(lengths[bad])} ids, more than dense_shape[1]={width}")


def sparse_parts(t: Any, what: str, ids: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``[2, nnz]`` and values of a 2-D sparse COO tensor (coalesced or not)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.sparse_coo:
        kind = t.layout if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{what}: expected a torch.sparse_coo_tensor, got {kind}")
    if t.sparse_dim() != 2 or t.dense_dim() != 0:
        raise InputError(f"{what}: expected a 2-D sparse tensor [B, max_len], got shape {tuple(t.shape)}")
    refuse_meta(t, what)
    vals = t._values()  # _values/_indices also work on uncoalesced tensors
    if ids and vals.dtype not in INT_DTYPES:
        raise InputError(f"{what}: ids must be integers (int32 or int64), got {vals.dtype}")
    if not ids and not vals.dtype.is_floating_point:
        raise InputError(f"{what}: must be floating point, got {vals.dtype}")
    return t._indices(), vals


def _device_memory(device: torch.device) -> float:
    """Bytes of memory on `device` (physical memory for the CPU; unbounded where unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):  # a platform without these names
            pass
    return math.inf
