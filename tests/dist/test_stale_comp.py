"""The delay compensation's drift (distributed/_stale_comp.py) against a replay of the exchange order.

Oracle: rows kept here in float64 as Python dicts, updated by the apply events of the thread's
order (fetch(t) .. apply(t), the order of test_stale_rows.py, drains included); batch t's drift
is the row now minus the row its fetch read, and its compensated gradient g + lambda g g drift.
(The compensated rows of a whole run are checked on 2 ranks in test_staleness.py.)
"""

from __future__ import annotations

import random

import pytest
import torch

from hugeembed.distributed._stale_comp import DelayCompensation

from .test_stale_rows import _events

DIM = 3


@pytest.mark.parametrize("k,drains,twice", [(1, set(), False), (3, set(), True), (4, {6}, False), (2, {3, 4}, True)])
def test_drift_is_the_row_now_minus_the_row_its_fetch_read(k, drains, twice):
    rng = random.Random(f"{k}:{sorted(drains)}")
    steps, lam = 12, 0.7
    slots = {t: {tab: sorted(rng.sample(range(30), rng.randint(0, 10))) for tab in (0, 1)} for t in range(1, steps + 1)}
    rows = {tab: {s: [rng.uniform(-1, 1) for _ in range(DIM)] for s in range(30)} for tab in (0, 1)}
    read: dict[int, dict[int, dict[int, list[float]]]] = {}
    comp, moved = DelayCompensation(k, lam), False
    for what, t in _events(steps, k, drains):
        if what == "fetch":
            comp.fetched(t)
            read[t] = {tab: {s: list(rows[tab][s]) for s in slots[t][tab]} for tab in (0, 1)}
            continue
        for tab in (0, 1):
            at = torch.tensor(slots[t][tab], dtype=torch.int64)
            want = [[rows[tab][s][c] - read[t][tab][s][c] for c in range(DIM)] for s in slots[t][tab]]
            got = comp.drift(t, tab, at, DIM, torch.float64)
            torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64).reshape(-1, DIM))
            moved |= bool(got.abs().sum() > 0)
            g = torch.tensor([[rng.uniform(-1, 1) for _ in range(DIM)] for _ in slots[t][tab]],
                             dtype=torch.float64).reshape(-1, DIM)
            fixed = comp.compensate(t, tab, at, g, got)
            want_g = [[g[i, c].item() + lam * g[i, c].item() ** 2 * want[i][c] for c in range(DIM)]
                      for i in range(len(slots[t][tab]))]
            torch.testing.assert_close(fixed, torch.tensor(want_g, dtype=torch.float64).reshape(-1, DIM))
            # the owner's update: a step of its own per row (in two records when `twice`: one per half)
            change = {s: [rng.uniform(-0.1, 0.1) for _ in range(DIM)] for s in slots[t][tab]}
            for s in slots[t][tab]:
                rows[tab][s] = [a + b for a, b in zip(rows[tab][s], change[s])]
            parts = [slots[t][tab][::2], slots[t][tab][1::2]] if twice else [slots[t][tab]]
            for part in parts:
                comp.record(tab, torch.tensor(part, dtype=torch.int64),
                            torch.tensor([change[s] for s in part], dtype=torch.float64).reshape(-1, DIM))
        comp.applied(t)
    assert moved  # some batch had rows updated while in flight
