"""The native CPU backend of HashStore: csrc/hash_store.cpp's kernels through _native.call.

A table goes over as its three arrays (buckets, free rows, scalars; layout in
csrc/store_table.h) and its row capacity; the kernel checks that they fit together and
that every buffer is as long as it needs, so a kernel never overruns a store.
"""

from __future__ import annotations

import torch

from .. import _native
from ..errors import StoreError
from ._hash_torch import Outcome

__all__ = ["NativeOps", "available", "run_batch"]


def available() -> bool:
    return _native.available()


def _table(s, buckets: torch.Tensor | None = None) -> list:
    return [s._buckets if buckets is None else buckets, s._free, s._st]


def _call(names, kernel: str, bufs, ints) -> int:
    """_native.call, a store's refusal (corrupt arrays) raised as its StoreError; `names`: the
    table's name, or the names of a many-table call's tables (the kernel's detail[0] says which)."""
    try:
        return _native.call(kernel, bufs, ints)
    except _native.KernelError as e:
        if e.status != _native.Status.BAD_VALUE:
            raise
        name = names if isinstance(names, str) else names[e.detail[0]]
        raise StoreError(f"table '{name}': {e}") from None


def run_batch(parts: list[tuple[str, list, list]], step: int) -> list[Outcome]:
    """Runs he_hs_find_or_insert_many over the tables' parts (NativeOps.batch_row); the Outcome
    of each (the codes are in each part's `out`)."""
    outcomes = torch.zeros(len(parts), 5, dtype=torch.int64)
    bufs, ints = [], [int(step)]
    for _, b, i in parts:
        bufs += b
        ints += i
    bufs.append(outcomes)
    _call([name for name, _, _ in parts], "he_hs_find_or_insert_many", bufs, ints)
    return [Outcome(rc) for rc in outcomes[:, 0].tolist()]


class NativeOps:
    """Backend of HashStore running the C++ kernels (CPU tensors only)."""

    name = "native"

    def __init__(self):
        self._scratch = torch.empty(0, dtype=torch.int64)
        self._set = torch.empty(0, dtype=torch.int64)
        self._params: tuple | None = None  # the initializer's parameters as the kernel reads them

    def _buf(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Scratch reused across calls (fresh pages cost a fault each, see docs/architecture.md):
        # [6 * n] for the kernel, then [2, n] new slots / keys; and the duplicate
        # check's set of 2 * cap int64, cap a power of two >= 2n.
        if self._scratch.numel() < 8 * n:
            self._scratch = torch.empty(8 * max(n, 1024), dtype=torch.int64)
        cap = 1 << max(4, (2 * n - 1).bit_length())
        if self._set.numel() < 2 * cap:
            self._set = torch.empty(2 * cap, dtype=torch.int64)
        return self._scratch, self._set

    def find(self, s, keys: torch.Tensor, rows_only: bool = False) -> torch.Tensor:
        out = torch.empty_like(keys)
        _call(s.name, "he_hs_find", _table(s) + [keys, out], [s._storage.shape[0], int(rows_only)])
        return out

    def find_or_insert(self, s, keys, counts, step, row_limit):
        n = keys.numel()
        out = torch.empty_like(keys)
        buf, dup_set = self._buf(n)
        need = torch.zeros(4, dtype=torch.int64)
        rc = Outcome(_call(s.name, "he_hs_find_or_insert", _table(s) + [keys, counts, out, buf, dup_set, need],
                           [s._storage.shape[0], step, s.admit_min_count, row_limit, s._max_entries()]))
        need = need.tolist()
        made = need[3]
        new = buf[6 * n : 8 * n].view(2, n)  # the kernel's new rows: slots, then keys
        return rc, out, new[0, :made], new[1, :made], need

    def batch_row(self, s, keys, counts, row_limit, init_kind: int, init_params, seed: int, state_row,
                  out: torch.Tensor | None = None) -> tuple[tuple[str, list, list], torch.Tensor]:
        """One table's part of a find_or_insert_many call (name, buffers, ints: the kernel's
        per-table arguments) and the tensor its codes land in.

        `keys` / `counts` are contiguous int64 CPU tensors (as_keys / as_counts), `out` one like
        `keys` or None (a new one); the kernel checks the store's arrays and the counts itself.
        The tensors the part holds stay alive with it.
        """
        n = keys.numel()
        buf, dup_set = self._buf(n)  # this store's own scratch: tables run in parallel, stores never share
        out = torch.empty_like(keys) if out is None else out
        if self._params is None or self._params[0] != tuple(init_params):
            padded = list(init_params) + [0.0] * (6 - len(init_params))
            self._params = (tuple(init_params), torch.tensor(padded, dtype=torch.float64))
        storage = s._storage
        # the scratch whole (>= 8n): a slice would be one more op per table and step
        bufs = _table(s) + [keys, counts, out, buf, dup_set, storage, state_row, self._params[1]]
        ints = [s.admit_min_count, row_limit, s._max_entries(), init_kind, seed, storage.shape[1], s.dim,
                0 if state_row is None else s.state_width]
        return (s.name, bufs, ints), out

    def insert(self, s, keys, codes, counts, lasts) -> None:
        _call(s.name, "he_hs_insert", _table(s) + [keys, codes.to(torch.int32).contiguous(), counts.contiguous(),
                                                   lasts.contiguous()], [s._storage.shape[0]])

    def erase(self, s, keys: torch.Tensor) -> None:
        missing = _call(s.name, "he_hs_erase", _table(s) + [keys], [s._storage.shape[0]])
        if missing:
            raise StoreError(f"table '{s.name}': {missing} keys to erase were not present (internal error)")

    def rehash(self, s, new: torch.Tensor) -> None:
        expected = s._st_get("entries")
        moved = _call(s.name, "he_hs_rehash", _table(s, new) + [s._buckets], [s._storage.shape[0]])
        if moved != expected:
            raise StoreError(f"table '{s.name}': rehash moved {moved} keys, expected {expected}")
