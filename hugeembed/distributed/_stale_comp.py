"""Delay-compensated row steps (DC-ASGD, Zheng et al. 2017) under ``staleness=K``.

Batch t's row gradient g was computed on the row as its fetch read it (w_read); the owner
applies it K steps later to the row as it is now (w_now).  A first-order correction of the
gradient to w_now, with the diagonal of g g^T standing in for the Hessian (the Fisher
approximation), is::

    g' = g + lambda * g * g * (w_now - w_read)

The owner needs no extra message for it: every row change it makes goes through its own
update stage, so it records the weight change of each step it applies (per table, per slot)
and sums, for the rows of batch t, the changes applied since batch t's fetch — exactly
w_now - w_read, for a row pinned (not evicted) from its fetch to its update.  Memory: the
weight changes of the last K+1 applied steps (their unique rows x dim, in the rows' dtype);
bytes sent: none.  Deterministic, so a run stays reproducible bit for bit; with K = 0 nothing
is in flight, w_now = w_read and nothing changes.
"""

from __future__ import annotations

import collections

import torch

from ._stale_rows import ReadMarks

__all__ = ["DelayCompensation", "compensable"]


class DelayCompensation(ReadMarks):
    """An owner's record of the weight changes it applied since each pending fetch (one per collection).

    The exchange thread calls ``fetched(step)`` when it reads the rows of a training step (and
    ``read_replicas(step)`` when it copies the step's replicated rows later: the tables in `replicated`
    drift from there, ``replicated_staleness``); the update stage ``compensate(step, t, slots, grad)``
    before table t's update of `step` and ``record(t, slots, change)`` after it; ``applied(step)`` once
    the step's updates are all in.

    Args:
        staleness: K >= 1.
        strength: lambda > 0.
        replicated: the data-parallel tables (indices), whose rows may be read after the fetch.
    """

    def __init__(self, staleness: int, strength: float, replicated: frozenset[int] = frozenset()) -> None:
        super().__init__(replicated)
        self.staleness, self.strength = staleness, float(strength)
        self._history: collections.deque = collections.deque(maxlen=staleness + 1)  # (index, {t: (slots, change)})
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def drift(self, step: int, t: int, slots: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """w_now - w_read of table t's rows at `slots` (one per entry) for `step`'s update: the changes
        the steps applied since its fetch made (zeros for a step not fetched through here)."""
        mark = self.mark(step, t)
        out = torch.zeros(slots.numel(), dim, dtype=dtype, device=slots.device)
        for i, changes in self._history:
            if i < mark or t not in changes:
                continue
            done_slots, change = changes[t]  # done_slots sorted, unique
            if not done_slots.numel():
                continue
            at = torch.searchsorted(done_slots, slots).clamp_(max=done_slots.numel() - 1)
            hit = done_slots[at] == slots
            out[hit] += change[at[hit]].to(dtype)
        return out

    def compensate(self, step: int, t: int, slots: torch.Tensor, grad: torch.Tensor,
                   drift: torch.Tensor) -> torch.Tensor:
        """g + lambda * g * g * drift (a new tensor; `grad` is left as it is)."""
        return grad + self.strength * grad * grad * drift.to(grad.dtype)

    def record(self, t: int, slots: torch.Tensor, change: torch.Tensor) -> None:
        """Table t's update of the current step changed the rows at `slots` (sorted, unique) by `change`."""
        prev = self._current.get(t)
        if prev is not None:  # a second update of the table in one step: one record, summed per slot
            both = torch.cat([prev[0], slots])
            slots, where = torch.unique(both, return_inverse=True)
            change = torch.zeros(slots.numel(), change.shape[1], dtype=change.dtype,
                                 device=change.device).index_add_(0, where, torch.cat([prev[1], change]))
        self._current[t] = (slots, change)

    def applied(self, step: int) -> None:
        self._history.append((self.done, self._current))
        self._current = {}
        super().applied(step)


def compensable(coll, t: int) -> bool:
    """Whether the owner can read table t's rows before and after its update (plain float rows in memory)."""
    cfg = coll.tables[t]
    return coll.rules[t] is not None and coll.groups[coll.group_index(t)].kind != "tiered" \
        and cfg.dtype in (torch.float32, torch.float64)
