"""InFlight: the rows one training forward read, kept in place until its backward used them.

A forward captures a row slot per id; the backward applies each id's gradient at that slot.
Between the two, other forwards (gradient accumulation, a pipelined next batch) and ttl checks
may evict rows and hand their slots to new ids.  So the forward pins its slots in every group
that can evict (``group.pin``); a group's pins are released when the backward has applied its
gradients, and every pin still held when the autograd graph is freed (an output dropped without
backward), by a finalizer.

A second backward through a retained graph applies again after the pins were released: it is
refused if the group evicted anything since, because a slot may hold another id.  A group
replaced in between (``load_state_dict``, ``.to(device)``) is refused too.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import StoreError

__all__ = ["InFlight"]


def _unpin_all(groups, handles: dict[int, list[int]]) -> None:
    # Runs when the InFlight dies (its graph was freed) or on release_all(); must not hold it.
    for g, hs in list(handles.items()):
        for h in hs:
            groups[g].unpin(h)
    handles.clear()


class InFlight:
    """Pins of one training forward at `step` over `groups` (the collection's, as at forward).

    Besides the pins it carries what the backward's updates need of the forward: the batch's
    unique keys (`keys`, stochastic rounding draws by key) and, per group, the hit counts of its
    keys after the fetch (`hits`, for lr_count_scale)."""

    def __init__(self, step: int, groups, keys: torch.Tensor | None = None) -> None:
        self.step = step
        self.groups = list(groups)
        self.keys = keys
        self.hits: dict[int, torch.Tensor] = {}
        self.shared: dict[int, torch.Tensor] = {}  # group -> per table of it, its shared row's slot (-1: none)
        self.applied = False  # some gradient was applied (its step is no longer pending)
        self.lrs: dict[int, float] | None = None  # table -> lr of its step, when applied later (staleness)
        self._handles: dict[int, list[int]] = {}
        self._released: dict[int, int] = {}  # group -> its eviction epoch when its pins were released
        self._finalizer = weakref.finalize(self, _unpin_all, self.groups, self._handles)

    def pin(self, g: int, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """Pins ``slots[start:stop]`` of group `g` (static groups never evict: skipped)."""
        group = self.groups[g]
        if group.kind != "static" and (slots.numel() if stop is None else stop > start):
            self._handles.setdefault(g, []).append(group.pin(slots, start, stop))

    def check(self, g: int, current, names) -> None:
        """Raises if applying group `g`'s gradients now could land on rows of other ids (`names`: the
        group's table names, or a callable giving them: made only for the error)."""
        if current is not self.groups[g]:
            names = names() if callable(names) else names
            raise StoreError(f"tables {names} were replaced (load_state_dict, .to()) between this batch's forward "
                             f"(step {self.step}) and its backward: their gradients would land on other rows")
        epoch = self._released.get(g)
        if epoch is not None and current.eviction_epoch != epoch:
            names = names() if callable(names) else names
            raise StoreError(f"tables {names}: a second backward of step {self.step} after rows were evicted "
                             f"(its rows were released by the first backward; their slots may hold other ids "
                             f"now): run each batch's backward once, or keep retain_graph runs before later forwards")

    def release(self, g: int) -> None:
        """Group `g`'s gradients were applied: its rows may go."""
        self.applied = True
        for h in self._handles.pop(g, []):
            self.groups[g].unpin(h)
        self._released[g] = self.groups[g].eviction_epoch

    def release_all(self) -> None:
        """The whole step was applied (the sharded backward): every pin goes."""
        self.applied = True
        self._finalizer()
