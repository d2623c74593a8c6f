"""A tiered table as a group of one: its rows are a memory cache over its file (store/_tiered.py).

Each tiered table has a file and a memory budget of its own, so it is a group of its own; this
adapter gives its TieredStore the group interface the collection calls (store/_group.py), with the
cache as the rows its slots index.
"""

from __future__ import annotations

import torch

from ._group import GroupBase
from ._tier_cache import one_thread
from ._tiered import TieredStore

__all__ = ["TieredGroup"]


class TieredGroup(GroupBase):
    """The group of one tiered table (`store`); its table index is 0."""

    kind = "tiered"

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.settings = (store.index.settings,)
        self.layout, self.device, self.has_rows = store.layout, store.device, True
        self.adopt_view(0, store)

    def storage(self) -> torch.Tensor:
        return self.store.storage()

    def _mine(self, tids: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sel = tids >= 0
        return sel, keys[sel]

    @one_thread
    def reserve(self, tids: torch.Tensor, keys: torch.Tensor) -> None:
        self.store.reserve(self._mine(tids, keys)[1])

    @one_thread
    def fetch(self, tids, keys, step: int, counts=None, out=None, hits=None, within=None) -> torch.Tensor:
        sel, k = self._mine(tids, keys)
        out = torch.empty_like(keys) if out is None else out
        out.fill_(-1)
        out[sel] = self.store.find_or_insert(k, step, counts=None if counts is None else counts[sel])
        if hits is not None:
            hits.zero_()
            hits[sel] = self.store.hit_counts(k)
        return out

    @one_thread
    def find(self, tids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        sel, k = self._mine(tids, keys)
        out = torch.full_like(keys, -1)
        out[sel] = self.store.find(k)
        return out

    def expire(self, step: int, ttl: list, min_norm: list, protect: torch.Tensor | None = None) -> list[int]:
        if ttl[0] is None and min_norm[0] is None:
            return [0]
        return [self.store.evict(step, ttl=ttl[0], min_norm=min_norm[0], protect=protect)]

    def pin(self, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> int:
        return self.store.pin(slots, start, stop)

    def unpin(self, handle: int) -> None:
        self.store.unpin(handle)

    @property
    def eviction_epoch(self) -> int:
        return self.store.eviction_epoch

    def table_rows(self, t: int) -> int:
        return len(self.store)

    def table_memory_bytes(self, t: int) -> int:
        return self.store.memory_bytes()

    def memory_bytes(self) -> int:
        return self.store.memory_bytes()
