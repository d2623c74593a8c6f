"""What every table group offers the collection (store/_static.py, store/_dynamic.py,
store/_tiered_group.py): its rows, one fetch and one find over all its tables, pins, and a view
of each table for the edges.

The collection calls a group, never a table: a fetch takes the keys of all the group's tables
with a table column beside them (the group's table index, -1 for an entry to skip), and its row
slots index ``storage()``, which the fused lookup reads and the optimizer rules update.
"""

from __future__ import annotations

import torch

from ._pins import PinnedRows

__all__ = ["GroupBase"]


class GroupBase:
    """Mixin of the groups: pins, rows, per-table views.  A group sets ``settings``, ``layout``,
    ``device``, ``rows`` (or overrides ``storage``) and ``_view_class``."""

    kind = "?"
    pins: PinnedRows

    def names(self) -> list[str]:
        return [t.name for t in self.settings]

    def storage(self) -> torch.Tensor:
        """The rows ``[R, W]`` the group's slots index (re-read after every fetch: it may move)."""
        return self.rows

    def lookup_rows(self) -> torch.Tensor:
        """``layout.lookup_rows(storage())``: rows whose first D columns are the weights."""
        return self.layout.lookup_rows(self.storage())

    def view(self, t: int):
        """Table `t` as a RowStore (made once: its direct writes are stamped on it)."""
        views = self.__dict__.setdefault("_views", {})
        v = views.get(t)
        if v is None:
            v = views[t] = self._view_class(self, t)
        return v

    def adopt_view(self, t: int, view) -> None:
        """`view` is table `t`'s view (a store that built its own group of one)."""
        self.__dict__.setdefault("_views", {})[t] = view

    def reserve(self, tids: torch.Tensor, keys: torch.Tensor) -> None:
        """Makes room for a coming fetch of these keys before any group changes (a tiered table writes
        victims back here, so a full disk fails the step before any table counted or inserted)."""

    # pins: the rows of batches whose backward has not run are never evicted
    def pin(self, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> int:
        return self.pins.pin(slots, start, stop)

    def unpin(self, handle: int) -> None:
        self.pins.unpin(handle)

    @property
    def eviction_epoch(self) -> int:
        """Evictions (and imports) so far that freed a row: a slot seen before a later epoch may
        hold another key."""
        return self.pins.epoch
