"""The trainer's side of bounded staleness (training/_stale.py): look-ahead, drain points, jitter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hugeembed.training._stale import StaleRun


class _Batch:
    def __init__(self, i: int) -> None:
        self.i, self.sparse = i, ("sparse", i)

    def to(self, device, non_blocking=False):
        return self


class _Recorder:
    """Stands for the collection: records what was handed over, when."""

    def __init__(self) -> None:
        self.enqueued: list = []

    def enqueue(self, sparse) -> None:
        self.enqueued.append(sparse[1])

    def drain(self) -> None:
        pass


@given(k=st.integers(1, 5), n=st.integers(0, 30), done=st.integers(0, 7), every=st.integers(1, 9))
def test_batches_are_handed_over_k_ahead_never_past_a_drain_point(k, n, done, every):
    coll = _Recorder()
    run = StaleRun(coll, [], 0, 0, None, 0, 0, 60.0)
    run.staleness = k  # the look-ahead alone (no dense all-reduce without a process group)
    drains = lambda s: s % every == 0  # noqa: E731
    got = []
    for b in run.batches((_Batch(done + 1 + i) for i in range(n)), done, "cpu", drains):
        step = b.i
        got.append(step)
        handed = coll.enqueued
        # the oracle: every step up to step + k is handed over, unless a drain point lies in between
        want = step
        while want < done + n and want < step + k and not drains(want):
            want += 1
        assert max(handed) == want, (step, handed)
        assert handed == list(range(done + 1, want + 1))
    assert got == list(range(done + 1, done + n + 1))


def test_jitter_sleeps_with_probability_p_the_same_draws_in_every_run(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("hugeembed.training._stale.time.sleep", slept.append)

    def draws(seed, rank):
        slept.clear()
        run = StaleRun(_Recorder(), [], 0, 0, (0.3, 3.0), seed, rank, 60.0)
        for _ in range(400):
            run.straggle(0.01)
        return list(slept)

    a, b, other = draws(1, 0), draws(1, 0), draws(1, 1)
    assert a == b and a != other
    assert 80 <= len(a) <= 160  # 400 x 0.3 = 120 expected
    assert all(s == pytest.approx(0.02) for s in a)  # (F - 1) x the step's compute
    assert draws(1, 0) == a and StaleRun(_Recorder(), [], 0, 0, None, 1, 0, 60.0).straggle(5.0) is None


def test_waits_count_the_jitter_sleeps_and_the_row_waits_under_staleness(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("hugeembed.training._stale.time.perf_counter", lambda: clock[0])
    monkeypatch.setattr("hugeembed.training._stale.time.sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    run = StaleRun(_Recorder(), [], 0, 0, (0.5, 4.0), 3, 0, 60.0)
    want = 0.0
    for i in range(50):
        before = clock[0]
        run.straggle(0.01 * (i + 1))
        want += clock[0] - before  # the oracle: what the fake clock moved
    assert want > 0 and run.waits() == {"jitter_sleep_s": pytest.approx(want)}  # synchronous: only the sleep
    coll = _Recorder()
    coll.fetch_wait_seconds = 1.25
    stale = StaleRun(coll, [], 0, 0, None, 0, 0, 60.0)
    stale.staleness = 2
    assert stale.waits() == {"jitter_sleep_s": 0.0, "wait_rows_s": 1.25}
