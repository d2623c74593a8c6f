"""The RowStore protocol (what the nn layer calls) and the StoreExport record.

A store maps int64 keys to row slots of one storage tensor ``[R, W]`` whose row
holds the embedding weights (D columns) followed by the optimizer state (S columns)::

    keys  [17, -3, 2**62]   --find_or_insert-->   slots [0, 2, 1]
    storage()                                    W = D + S
      slot 0 | w w w w | s s |   <- key 17
      slot 1 | w w w w | s s |   <- key 2**62
      slot 2 | w w w w | s s |   <- key -3

How a row splits into typed weights and state is the store's ``layout`` (a RowLayout):
read rows through ``store.weights()`` / ``store.state()``, never by slicing columns.

Per row the store also keeps a hit count and the last step the key was seen, for
admission (a key gets a row after ``admit_min_count`` hits) and eviction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from .._tensors import row_independent
from ..errors import InputError
from ._layout import RowLayout

__all__ = ["RowStore", "StoreExport", "ExportIndex", "EvictionPolicy", "row_independent", "EXPORT_FIELDS"]

EvictionPolicy = Literal["lfu", "lru"]


@dataclass(frozen=True)
class StoreExport:
    """The contents of a store, keys ascending (deterministic).

    Args:
        keys: int64 [n] admitted keys, ascending.
        rows: [n, W] their rows (weights then optimizer state).
        counts: int64 [n] hit counts.
        last_step: int64 [n] last step each key was seen.
        pending_keys: int64 [p] keys seen but not admitted yet, ascending.
        pending_counts: int64 [p].
        pending_last_step: int64 [p].
    """

    keys: torch.Tensor
    rows: torch.Tensor
    counts: torch.Tensor
    last_step: torch.Tensor
    pending_keys: torch.Tensor
    pending_counts: torch.Tensor
    pending_last_step: torch.Tensor

    def __post_init__(self):
        n, p = self.keys.numel(), self.pending_keys.numel()
        for name, t, want in (("keys", self.keys, n), ("counts", self.counts, n), ("last_step", self.last_step, n),
                              ("pending_counts", self.pending_counts, p),
                              ("pending_last_step", self.pending_last_step, p)):
            if t.dtype != torch.int64 or t.dim() != 1 or t.numel() != want:
                raise InputError(f"StoreExport.{name}: expected int64 [{want}], got {t.dtype} {tuple(t.shape)}")
        if self.pending_keys.dtype != torch.int64 or self.pending_keys.dim() != 1:
            raise InputError(f"StoreExport.pending_keys: expected int64 [p], got {self.pending_keys.dtype}")
        if self.rows.dim() != 2 or self.rows.shape[0] != n:
            raise InputError(f"StoreExport.rows: expected [{n}, W], got {tuple(self.rows.shape)}")

    @property
    def width(self) -> int:
        return int(self.rows.shape[1])

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to(self, device: torch.device | str) -> "StoreExport":
        return StoreExport(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class ExportIndex:
    """A store's export without its rows copied: where each admitted key's row lives.

    ``gather(store.storage())`` is the StoreExport; a snapshot writer instead streams
    ``storage[slots]`` to disk in chunks, so saving a table needs no second copy of it.
    """

    keys: torch.Tensor
    slots: torch.Tensor  # int64 [n]: row slot of keys[i] in storage()
    counts: torch.Tensor
    last_step: torch.Tensor
    pending_keys: torch.Tensor
    pending_counts: torch.Tensor
    pending_last_step: torch.Tensor

    def gather(self, storage: torch.Tensor) -> StoreExport:
        """The StoreExport: these keys with their rows copied out of `storage`."""
        return StoreExport(self.keys, storage.index_select(0, self.slots), self.counts, self.last_step,
                           self.pending_keys, self.pending_counts, self.pending_last_step)


@runtime_checkable
class RowStore(Protocol):
    """Key -> row storage of one embedding table (see the module docstring for the layout).

    Implemented by ArrayStore (static, key = slot), HashStore (dynamic) and
    DictStore (the plain-dict oracle used by tests).
    """

    name: str
    dim: int
    state_width: int
    width: int
    dtype: torch.dtype  # of the weights (the raw storage's is layout.storage_dtype)
    device: torch.device
    layout: "RowLayout"

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        """Slots of unique `keys` (int64 [U]), creating rows for new keys; -1 for keys not admitted yet."""
        ...

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots of `keys`, -1 where absent or not admitted; changes nothing."""
        ...

    def hit_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """Hits of `keys` so far (int64 [n]; 0 for a key never seen); changes nothing."""
        ...

    def storage(self) -> torch.Tensor:
        """The live [R, W] row storage (re-read it after every find_or_insert: it may move)."""
        ...

    def weights(self) -> torch.Tensor:
        """``layout.weights(storage())``: the [R, D] weights in the weight dtype."""
        ...

    def state(self) -> torch.Tensor:
        """``layout.state(storage())``: the [R, S] optimizer state in the state dtype."""
        ...

    def lookup_rows(self) -> torch.Tensor:
        """``layout.lookup_rows(storage())``: rows whose first D columns are the weights."""
        ...

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows at `slots` -> [U, W]; a slot of -1 reads zeros."""
        ...

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes `rows` [U, W] at `slots`; slots of -1 are skipped."""
        ...

    def export(self) -> StoreExport:
        """Every key with its row, counts and last step (a copy), keys ascending."""
        ...

    def export_index(self) -> ExportIndex:
        """The export with slots instead of copied rows (``export() == export_index().gather(storage())``)."""
        ...

    def import_(self, export: StoreExport) -> None:
        ...

    def remove(self, keys: torch.Tensor) -> int:
        """Removes `keys` (admitted or pending, each present and given once), freeing their rows;
        returns rows freed.  Static stores refuse (they hold every key).  Applying a snapshot
        delta removes the keys the saved run evicted with it."""
        ...

    def __len__(self) -> int:
        ...

    def memory_bytes(self) -> int:
        ...

    def index_overhead_bytes(self) -> int:
        ...

    def evict(self, step: int, ttl: int | None = None, max_rows: int | None = None,
              policy: EvictionPolicy | None = None, protect: torch.Tensor | None = None,
              min_norm: float | None = None) -> int:
        """Removes rows by ttl, weight norm below `min_norm`, then by `policy` (default the store's)
        down to `max_rows`; never the slots in `protect` nor pinned ones.  Returns rows removed."""
        ...

    def to(self, device: torch.device | str) -> "RowStore":
        ...


# The files of a table in a snapshot and the keys of a table in a state_dict, in this order.
EXPORT_FIELDS = StoreExport.field_names()
