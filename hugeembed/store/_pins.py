"""Pinned rows: slots that eviction must leave where they are.

A training forward captures the row slot of every id it read; its backward applies the
gradient to those slots.  If a later forward (gradient accumulation, a pipelined next
batch) or a ttl check evicted one of those rows and gave its slot to a new key, the
gradient would land on the new key.  So the rows of every batch whose backward has not
run are pinned: eviction skips them, exactly as it skips the current batch's rows.

``epoch`` counts the evictions that freed at least one row.  A holder that released its
pins (its backward ran) and must touch the same slots again (a second backward through
a retained graph) compares epochs to tell whether a slot may have been reused since.
"""

from __future__ import annotations

import torch

from ..errors import StoreError

__all__ = ["PinnedRows", "Pinnable"]


class PinnedRows:
    """The pinned slots of one store, as a set of handles (one per in-flight batch)."""

    def __init__(self) -> None:
        # handle -> (slots, start, stop): the range is sliced only when an eviction needs it,
        # so pinning costs a dict entry per table per step, not a tensor op
        self._sets: dict[int, tuple[torch.Tensor, int, int]] = {}
        self._next = 0
        self.epoch = 0

    def __len__(self) -> int:
        """Handles held (in-flight batches), not slots."""
        return len(self._sets)

    def pin(self, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> int:
        """Pins ``slots[start:stop]`` (-1 entries ignored) until :meth:`unpin` of the returned handle."""
        handle = self._next
        self._next += 1
        self._sets[handle] = (slots, start, slots.numel() if stop is None else stop)
        return handle

    def unpin(self, handle: int) -> None:
        """Releases one handle; releasing twice (backward, then the graph freed) is a no-op."""
        self._sets.pop(handle, None)

    def slots(self) -> torch.Tensor | None:
        """Every pinned slot (may repeat), or None when nothing is pinned."""
        if not self._sets:
            return None
        return torch.cat([s.reshape(-1)[a:b].to(torch.int64) for s, a, b in self._sets.values()])

    def protect(self, protect: torch.Tensor | None) -> torch.Tensor | None:
        """`protect` extended by every pinned slot (what an eviction must spare)."""
        pinned = self.slots()
        if pinned is None:
            return protect
        if protect is None:
            return pinned
        return torch.cat([protect.reshape(-1).to(pinned.device, torch.int64), pinned])


class Pinnable:
    """Mixin of the stores that can evict: pin / unpin / eviction_epoch over ``self._pins``."""

    _pins: PinnedRows

    def pin(self, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> int:
        """Keeps rows ``slots[start:stop]`` (-1 entries ignored) from eviction until :meth:`unpin`."""
        return self._pins.pin(slots, start, stop)

    def unpin(self, handle: int) -> None:
        self._pins.unpin(handle)

    @property
    def eviction_epoch(self) -> int:
        """Evictions (and imports) so far that freed a row: a slot seen before a later epoch may
        hold another key."""
        return self._pins.epoch

    def _refuse_if_pinned(self, what: str) -> None:
        """StoreError when batches in flight hold rows (`what` would move their slots)."""
        if len(self._pins):
            raise StoreError(f"table '{getattr(self, 'name', '?')}': cannot {what} while {len(self._pins)} batches "
                             f"whose backward has not run hold rows of it; run their backward (or drop their "
                             f"outputs) first")
