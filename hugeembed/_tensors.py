"""Tensor helpers every layer may use (the bottom of the layers, beside _hashing and _device).

Host-known sizes turned into device index arrays without reading the device, per-part views of
one array joined without a copy, and the marker of row-independent state initialisers.
"""

from __future__ import annotations

import numpy as np
import torch

from ._device import host_to_device

__all__ = ["repeat_each", "concat_ranges", "joined_view", "joined", "kept_positions", "row_independent"]


def row_independent(init_state):
    """Marks an ``init_state(state)`` that writes the same values into every row it is given
    (constants, as every optimizer's initial state is): a store may then compute one row of
    it and copy that row into new rows inside its kernels."""
    init_state.row_independent = True
    return init_state


def repeat_each(values, sizes, device: torch.device) -> torch.Tensor:
    """int64 ``[sum(sizes)]``: ``values[i]`` repeated ``sizes[i]`` times, both given on the host (lists
    or numpy arrays).

    The output size is given, so a GPU's repeat_interleave does not read the sizes back.  On the
    CPU numpy repeats them: torch's CPU repeat_interleave splits even a few sizes over its OpenMP
    workers, and waking them costs more than the work (milliseconds on a loaded machine)."""
    if torch.device(device).type == "cpu":
        return torch.from_numpy(np.repeat(np.asarray(values, dtype=np.int64), sizes))
    vals = host_to_device(values, torch.int64, device)
    return torch.repeat_interleave(vals, host_to_device(sizes, torch.int64, device), output_size=int(np.sum(sizes)))


def concat_ranges(starts: torch.Tensor, sizes: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenation of ``arange(starts[i], starts[i] + sizes[i])`` (sizes >= 0), and the i
    of each of its elements.  `total`: ``sizes.sum()`` when the caller has it (else read from
    the device); the owners are found by a search, not a repeat_interleave, which would read
    the sizes back too."""
    dev = starts.device
    if total is None:
        total = int(sizes.sum()) if sizes.numel() else 0
    if total == 0:
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return none, none
    cum = torch.cumsum(sizes, 0)
    at = torch.arange(total, device=dev)
    owner = torch.searchsorted(cum, at, right=True)  # the segment whose end is past the element
    return at - (cum - sizes)[owner] + starts[owner], owner


def joined_view(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One view over `parts` when they lie end to end in one storage (each contiguous, of one
    dtype and row shape, starting where the one before ends), else None: per-table views of
    one array read or written with one op, without a copy."""
    if not parts or parts[0] is None:
        return None
    first = parts[0]
    dtype, tail, size = first.dtype, first.shape[1:], first.element_size()
    at = first.data_ptr()
    rows = 0
    for p in parts:
        if p is None or p.dtype != dtype or p.dim() == 0 or p.shape[1:] != tail or p.data_ptr() != at or \
                not p.is_contiguous():
            return None
        at += p.numel() * size
        rows += p.shape[0]
    # The parts lie end to end; all in first's storage when the joined bytes lie inside it (two live
    # storages never overlap): one storage read, not one per part.
    store = first.untyped_storage()
    if at > store.data_ptr() + store.nbytes() or store.device != first.device:
        return None
    return first.as_strided((rows, *tail), first.stride(), first.storage_offset())


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """`parts` as one tensor: their joined_view when they lie end to end (no copy), else
    torch.cat.  For reading: a write to it may land in the parts."""
    view = joined_view(parts)
    return torch.cat(parts) if view is None else view


def kept_positions(mask: torch.Tensor, n_true: int) -> torch.Tensor:
    """The positions where 1-D `mask` holds, ascending, given their count `n_true` (known on
    the host): ``mask.nonzero()`` without reading the device (each kept element finds its place
    by a running count; the others go to a spare slot past the end)."""
    dest = torch.where(mask, torch.cumsum(mask.to(torch.int64), 0) - 1, n_true)
    out = torch.empty(n_true + 1, dtype=torch.int64, device=mask.device)
    out.index_put_((dest,), torch.arange(mask.numel(), device=mask.device))
    return out[:n_true]
