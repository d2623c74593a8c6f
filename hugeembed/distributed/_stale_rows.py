"""Staleness-aware row updates: under ``staleness=K`` an owner scales each row's step by 1 / (1 + n).

n is the number of updates the row took between the fetch that read it for batch t and the
apply of batch t's gradient: the in-flight batches (t-K .. t-1, fewer after a drain point) that
touched the same key.  The owner applies every step's gradients in order on its exchange thread,
so it knows n exactly (Zhang et al. 2016, "Staleness-aware async-SGD", per row): a hot row whose
gradient was computed on a value K updates old moves 1/(K+1) of a step, a row no other in-flight
batch touched moves the full step (its gradient is exact).  Deterministic, so a run stays
reproducible bit for bit; with K = 0 nothing is in flight and nothing is scaled.

The scale multiplies the row's weight change (as lr_count_scale does, ``nn/_rare.py``): exact as
an lr scale for rules linear in lr (sgd, momentum, adagrad, rowwise_adagrad, lazy adam) on
float32 / float64 rows without stochastic rounding, not tiered; other tables take the plain step.
"""

from __future__ import annotations

import collections

import torch

__all__ = ["ReadMarks", "RowStaleness", "staleness_counts", "scale_row_steps", "scalable"]


def staleness_counts(keys: torch.Tensor, since: list[torch.Tensor]) -> torch.Tensor:
    """Per key, how many of the key sets in `since` (each the keys of one applied step) hold it."""
    n = torch.zeros(keys.numel(), dtype=torch.int64, device=keys.device)
    for other in since:
        if other.numel():
            n += torch.isin(keys, other).to(torch.int64)
    return n


class ReadMarks:
    """Per pending training step, how many steps had been applied when its rows were read: at its fetch,
    or, for the tables in `replicated` of a step whose replicas are read later (``replicated_staleness``),
    at that read.  The exchange thread calls ``fetched(step)``, ``read_replicas(step)`` and
    ``applied(step)`` (once the step's updates are all in); RowStaleness and DelayCompensation count
    from :meth:`mark`."""

    def __init__(self, replicated: frozenset[int] = frozenset()) -> None:
        self.replicated = replicated
        self.done = 0  # steps applied so far
        self._marks: dict[int, int] = {}  # step -> steps applied when its rows were read
        self._replica_marks: dict[int, int] = {}  # step -> the same for its replicas read late

    def fetched(self, step: int) -> None:
        self._marks[step] = self.done

    def read_replicas(self, step: int) -> None:
        self._replica_marks[step] = self.done

    def mark(self, step: int, t: int) -> int:
        """Steps applied when table t's rows of `step` were read (all so far for a step not read here)."""
        marks = self._replica_marks if t in self.replicated and step in self._replica_marks else self._marks
        return marks.get(step, self.done)

    def applied(self, step: int) -> None:
        self._marks.pop(step, None)
        self._replica_marks.pop(step, None)
        self.done += 1


class RowStaleness(ReadMarks):
    """An owner's record of the steps it applied since each pending fetch (one per collection).

    The exchange thread calls ``fetched(step)`` when it reads the rows of a training step,
    ``read_replicas(step)`` when it copies the step's replicated rows later than its fetch
    (``replicated_staleness``: the tables in `replicated` count from there),
    ``applying(step, t, keys)`` for the keys of table t it is about to update (the scale), and
    ``applied(step)`` once the step's updates are all in."""

    def __init__(self, staleness: int, replicated: frozenset[int] = frozenset()) -> None:
        super().__init__(replicated)
        self.staleness = staleness
        self._history: collections.deque = collections.deque(maxlen=staleness + 1)  # (index, {t: keys})
        self._current: dict[int, torch.Tensor] = {}

    def counts(self, step: int, t: int, keys: torch.Tensor) -> torch.Tensor:
        """n per key of table t in step `step`'s update (0 for a step not fetched through here)."""
        mark = self.mark(step, t)
        since = [keys_of[t] for i, keys_of in self._history if i >= mark and t in keys_of]
        return staleness_counts(keys, since)

    def applying(self, step: int, t: int, keys: torch.Tensor) -> torch.Tensor:
        """float64 1 / (1 + n) per key; records the keys as updated by this step."""
        n = self.counts(step, t, keys)
        prev = self._current.get(t)
        self._current[t] = keys if prev is None else torch.cat([prev, keys])
        return 1.0 / (1.0 + n.to(torch.float64))

    def applied(self, step: int) -> None:
        self._history.append((self.done, self._current))
        self._current = {}
        super().applied(step)


def scale_row_steps(coll, t: int, slots: torch.Tensor, scale: torch.Tensor, shared_slot: int, update) -> None:
    """Runs `update()` (table t's rule on its rows at `slots`) with each row's weight change
    multiplied by `scale` (the shared row of rare ids, at `shared_slot`, keeps its full step)."""
    group = coll.groups[coll.group_index(t)]
    dim = group.layout.dim
    uniq, inv = torch.unique(slots, return_inverse=True)  # ids on the shared row share its slot
    before = group.storage().index_select(0, uniq)[:, :dim].clone()
    update()
    s = torch.ones(uniq.numel(), dtype=torch.float64, device=slots.device).scatter_(0, inv, scale)
    if shared_slot >= 0:
        s = torch.where(uniq == shared_slot, 1.0, s)
    part = s < 1.0  # rows at the full step keep the rule's result exactly
    uniq, before, s = uniq[part], before[part], s[part]
    storage = group.storage()
    after = storage.index_select(0, uniq)[:, :dim]
    storage[uniq, :dim] = before + s.to(after.dtype).unsqueeze(1) * (after - before)


def scalable(coll, t: int) -> bool:
    """Whether table t's step may be scaled per row (a rule linear in lr on plain float rows in memory)."""
    cfg, rule = coll.tables[t], coll.rules[t]
    return rule is not None and coll.groups[coll.group_index(t)].kind != "tiered" and rule.name != "ftrl" \
        and not rule.moves_untouched_rows and cfg.dtype in (torch.float32, torch.float64) and not cfg.stochastic_rounding
