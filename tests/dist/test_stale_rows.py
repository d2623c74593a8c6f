"""The staleness-aware row step's counts (distributed/_stale_rows.py) against a replay of the exchange order.

Oracle: the exchange thread's order written out as events (fetch(t), apply(t)) for K and a drain
point, and per key of each applied step the number of apply events between its fetch and its
apply that hold the same key, counted here with Python sets.  (The scaled rows themselves are
checked on 2 ranks in test_staleness.py.)
"""

from __future__ import annotations

import random

import pytest
import torch

from hugeembed.distributed._stale_rows import RowStaleness


def _events(steps: int, k: int, drain_after: set[int]) -> list[tuple[str, int]]:
    """The thread's order: fetches handed over K ahead, never past a drain point (StaleRun.batches)."""
    out, fetched = [], 0
    for t in range(1, steps + 1):
        limit = t + k
        for s in range(t, t + k):
            if s in drain_after:
                limit = s
                break
        while fetched < min(limit, steps):
            fetched += 1
            out.append(("fetch", fetched))
        out.append(("apply", t))
    return out


@pytest.mark.parametrize("k,drains", [(0, set()), (1, set()), (3, set()), (4, {6}), (2, {3, 4})])
def test_counts_are_the_in_flight_steps_holding_each_key(k, drains):
    rng = random.Random(f"{k}:{sorted(drains)}")
    steps = 12
    keys = {t: {tab: sorted(rng.sample(range(30), rng.randint(0, 10))) for tab in (0, 1)} for t in range(1, steps + 1)}
    events = _events(steps, k, drains)
    rows, most = RowStaleness(k), 0
    for i, (what, t) in enumerate(events):
        if what == "fetch":
            rows.fetched(t)
            continue
        start = events.index(("fetch", t))
        between = [s for w, s in events[start:i] if w == "apply"]
        for tab in (0, 1):
            want = [sum(key in keys[s][tab] for s in between) for key in keys[t][tab]]
            got = rows.applying(t, tab, torch.tensor(keys[t][tab], dtype=torch.int64))
            assert got.tolist() == [1.0 / (1 + n) for n in want], (t, tab)
            most = max([most, *want])
        rows.applied(t)
    assert (most > 0) == (k > 0)  # K >= 1 had keys in flight to count; K = 0 never does
