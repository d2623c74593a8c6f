"""The native CPU backend of a dynamic group's key index: csrc/group_index.cpp through _native.call.

A group goes over as its four arrays (buckets, free rows, scalars, tables; store/_index.py) and
its rows' capacity; the kernels check that they fit together and that every buffer is as long as
they need, so a kernel never overruns a group.  The same calls as store/_index_torch.py.
"""

from __future__ import annotations

import torch

from .. import _native
from ..errors import InputError, StoreError
from ._index import PROBE_LIMIT, Need, Outcome, need_length

__all__ = ["NativeIndex"]


def _group(g, buckets: torch.Tensor | None = None) -> list:
    return [g.buckets if buckets is None else buckets, g.free_rows, g.scalars, g.tables]


def _call(g, kernel: str, bufs, ints, tids: torch.Tensor | None = None) -> int:
    """_native.call; a count below 1 raised as the InputError naming its table, a refusal of the
    group's arrays (corrupt) as a StoreError naming its tables."""
    try:
        return _native.call(kernel, bufs, ints)
    except _native.KernelError as e:
        if e.status != _native.Status.BAD_VALUE:
            raise
        if tids is not None and e.detail[2] == 1:
            raise InputError(f"table '{g.settings[int(tids[e.detail[0]])].name}': counts must be >= 1 (occurrences "
                             f"in the batch), got {e.detail[1]}") from None
        raise StoreError(f"tables {g.names()}: {e}") from None


class NativeIndex:
    """The kernels' backend (CPU tensors only); scratch buffers kept across calls (fresh pages cost a
    fault each: docs/architecture.md)."""

    name = "native"

    def __init__(self) -> None:
        self._scratch = torch.empty(0, dtype=torch.int64)
        self._set = torch.empty(0, dtype=torch.int64)

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scratch.numel() < 8 * n:
            self._scratch = torch.empty(8 * max(n, 1024), dtype=torch.int64)
        cap = 1 << max(4, (2 * n - 1).bit_length())
        if self._set.numel() < 3 * cap:
            self._set = torch.empty(3 * cap, dtype=torch.int64)
        return self._scratch, self._set

    def find(self, g, keys: torch.Tensor, tids: torch.Tensor, rows_only: bool,
             hits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        codes = torch.empty_like(keys)
        counts = torch.empty_like(keys) if hits else None
        _call(g, "he_group_find", _group(g) + [keys, tids, codes, counts], [g.rows_capacity(), int(rows_only)])
        return codes, counts

    def find_or_insert(self, g, keys, tids, counts, admit, step: int, out, hits, init) -> tuple[Outcome, Need, tuple]:
        """(outcome, need, the new rows' (slots, keys, tables)); `init`: (storage, kinds, params,
        state rows, W, dim, state width) when the kernel initialises rows, else None."""
        n, T = keys.numel(), g.tables.shape[0]
        scratch, dup_set = self._buffers(n)
        need = torch.zeros(need_length(T), dtype=torch.int64)
        storage, kinds, params, state, W, dim, sw = init if init is not None else (None, None, None, None, 0, 0, 0)
        rc = Outcome(_call(g, "he_group_find_or_insert",
                           _group(g) + [keys, tids, counts, admit, out, hits, scratch, dup_set, need, storage, kinds,
                                        params, state],
                           [g.rows_capacity(), step, g.max_entries(), PROBE_LIMIT, W, dim, sw], tids))
        need = Need(need.tolist(), T)  # the one read of the call
        made = need.made if rc == Outcome.DONE else 0
        return rc, need, (scratch[3 * n : 3 * n + made], scratch[4 * n : 4 * n + made],
                          scratch[5 * n : 5 * n + made])

    def insert(self, g, keys, tids, codes, counts, lasts) -> None:
        _call(g, "he_group_insert", _group(g) + [keys, tids, codes.to(torch.int32).contiguous(), counts.contiguous(),
                                                 lasts.contiguous()], [g.rows_capacity()])

    def erase(self, g, keys: torch.Tensor, tids: torch.Tensor) -> int:
        return _call(g, "he_group_erase", _group(g) + [keys.contiguous(), tids.contiguous()], [g.rows_capacity()])

    def rehash(self, g, new: torch.Tensor) -> int:
        """Fills `new` with every record of the group's buckets; returns the records moved."""
        return _call(g, "he_group_rehash", _group(g, new) + [g.buckets], [g.rows_capacity()])
