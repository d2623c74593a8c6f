"""The read-ahead of a TieredStore's cache: rows of the next batch read from the file in the background
(``prefetch``), taken by the fetch that needs them unless they were rewritten, moved or freed meanwhile."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import StoreError
from ._common import as_keys
from ._tier_cache import one_thread

__all__ = ["TierPrefetch"]


class TierPrefetch:
    """Mixin of TieredStore: staged reads (state set by TieredStore.__init__: ``_pool``, ``_staged``)."""

    @one_thread
    def prefetch(self, keys: torch.Tensor) -> int:
        """Starts reading the rows of `keys` (e.g. the next batch's ids) that are on disk and not
        resident, in the background; the next fetches take them from there (the reads of the
        prefetch before stay too: prefetch(batch t+1) is called before step t, whose rows the
        previous call read).  Changes nothing a caller can see (no count, no row, no residency).
        Returns rows being read."""
        keys = as_keys(self.name, keys, self.device)
        self._join_staged(keep=1)
        if keys.numel() == 0:
            return 0
        logical = self.index.find(torch.unique(keys))
        self._fit_map()
        logical = logical[logical >= 0]
        logical = logical[(self._where[logical] < 0) & self._space.on_disk(logical)]
        if logical.numel() == 0:
            return 0
        logical = logical.sort().values
        buf = self.layout.empty(logical.numel())
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"tier-{self.name}")
        # A record read here is never overwritten while it is some row's current one (writes go to
        # fresh records); a row rewritten, moved or freed before its fetch is marked stale.
        rec = self._space.records_of(logical)
        self._staged.append((self._pool.submit(self.file.read, rec, buf), logical, buf, []))
        return logical.numel()

    def _join_staged(self, keep: int = 0) -> None:
        """Waits for and drops the staged reads but the newest `keep`."""
        while len(self._staged) > keep:
            try:
                self._staged.pop(0)[0].result()
            except StoreError:
                pass  # a failed prefetch is only a lost hint: the fetch reads the file itself

    def _mark_stale(self, logical: torch.Tensor) -> None:
        if self._staged and logical.numel():
            logical = logical.clone()
            for s in self._staged:
                s[3].append(logical)

    def _take_staged(self, logical: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Copies staged rows of `logical` into `slots`; a mask of those served."""
        got = torch.zeros(logical.numel(), dtype=torch.bool)
        for fut, staged, buf, stale in self._staged:
            try:
                fut.result()
            except StoreError:
                continue
            if stale:  # rewritten or freed since they were read: the file is newer
                ok = ~torch.isin(staged, torch.cat(stale))
            else:
                ok = torch.ones(staged.numel(), dtype=torch.bool)
            pos = torch.searchsorted(staged, logical).clamp_(max=max(staged.numel() - 1, 0))
            hit = ~got & (staged[pos] == logical) & ok[pos]
            if bool(hit.any()):
                self._rows.index_copy_(0, slots[hit], buf.index_select(0, pos[hit]))
                self.stats["rows_prefetched"] += int(hit.sum())
                got |= hit
        return got
