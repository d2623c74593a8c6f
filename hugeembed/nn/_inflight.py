"""InFlight: the rows one training forward read, kept in place until its backward used them.

A forward captures a row slot per id; the backward applies each id's gradient at that
slot.  Between the two, other forwards (gradient accumulation, a pipelined next batch)
and ttl checks may evict rows and hand their slots to new ids.  So the forward pins its
slots in every store that can evict (``store.pin``); each table's pin is released when
the backward has applied that table's gradient, and every pin still held when the
autograd graph is freed (an output dropped without backward), by a finalizer.

A second backward through a retained graph applies again after the pins were released:
it is refused if the store evicted anything since, because a slot may hold another id.
A store replaced in between (``load_state_dict``, ``.to(device)``) is refused too.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import StoreError
from ..store._pins import Pinnable

__all__ = ["InFlight"]


def _unpin_all(stores, handles: dict[int, int]) -> None:
    # Runs when the InFlight dies (its graph was freed) or on release_all(); must not hold it.
    for t, h in list(handles.items()):
        stores[t].unpin(h)
    handles.clear()


class InFlight:
    """Pins of one training forward at `step` over `stores` (one per table, as at forward)."""

    def __init__(self, step: int, stores) -> None:
        self.step = step
        self.stores = list(stores)
        self.applied = False  # some table's gradient was applied (its step is no longer pending)
        self._handles: dict[int, int] = {}
        self._released: dict[int, int] = {}  # table -> store eviction epoch when its pin was released
        self.lr_scales: dict[int, torch.Tensor] = {}  # table -> per-row lr scale of its rows (lr_count_scale)
        self._finalizer = weakref.finalize(self, _unpin_all, self.stores, self._handles)

    def pin(self, t: int, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """Pins ``slots[start:stop]`` of table `t` (a table is fetched once per step; stores that
        never evict are skipped)."""
        store = self.stores[t]
        if isinstance(store, Pinnable) and (slots.numel() if stop is None else stop > start):
            self._handles[t] = store.pin(slots, start, stop)

    def check(self, t: int, store, table: str) -> None:
        """Raises if applying table `t`'s gradient now could land on rows of other ids."""
        if store is not self.stores[t]:
            raise StoreError(f"table {table!r} was replaced (load_state_dict, .to()) between this batch's forward "
                             f"(step {self.step}) and its backward: its gradient would land on other rows")
        epoch = self._released.get(t)
        if epoch is not None and getattr(store, "eviction_epoch", epoch) != epoch:
            raise StoreError(f"table {table!r}: a second backward of step {self.step} after rows were evicted "
                             f"(its rows were released by the first backward; their slots may hold other ids "
                             f"now): run each batch's backward once, or keep retain_graph runs before later forwards")

    def release(self, t: int) -> None:
        """Table `t`'s gradient was applied: its rows may go."""
        self.applied = True
        h = self._handles.pop(t, None)
        if h is not None:
            self.stores[t].unpin(h)
            self._released[t] = getattr(self.stores[t], "eviction_epoch", 0)

    def release_all(self) -> None:
        """The whole step was applied (the sharded backward): every pin goes."""
        self.applied = True
        self._finalizer()
