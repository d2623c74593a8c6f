"""--data-queue: every row trained exactly once per epoch over the ranks, the same step count on every rank, uneven
shards without deadlock, and a snapshot's position resumed on another number of processes."""

from __future__ import annotations

import collections

import pytest

from hugeembed.training._queue import chunk_ranges, intersect_ranges, merge_ranges, subtract_ranges

from ._harness import run_ranks

pytestmark = pytest.mark.dist

# 1000 rows in shards of 7, 293, 1, 699 rows (uneven), rows 400..450 held out
ROWS = [(0, 400), (450, 1000)]
CUTS = [7, 300, 301, 1000]
ALL = [r for a, b in ROWS for r in range(a, b)]


def test_ranges_are_cut_at_shard_ends_and_into_chunks():
    assert chunk_ranges([(0, 10), (12, 20)], [3, 15], 4) == [(0, 3), (3, 7), (7, 10), (12, 15), (15, 19), (19, 20)]
    assert subtract_ranges([(0, 10), (20, 30)], [(5, 22)]) == [(0, 5), (22, 30)]
    assert intersect_ranges([(0, 10), (20, 30)], [(5, 22)]) == [(5, 10), (20, 22)]
    assert merge_ranges([(0, 3), (3, 7), (9, 10), (10, 12)]) == [(0, 7), (9, 12)]


def _check_epoch(results, epoch: int, want: list[int], batch: int) -> None:
    steps = [r["steps"][epoch] for r in results]
    assert len({len(s) for s in steps}) == 1, f"ranks ran {[len(s) for s in steps]} steps"  # the same collectives
    trained = collections.Counter(row - epoch * 100_000 for s in steps for rows, _ in s for row in rows)
    assert sorted(trained) == sorted(want) and set(trained.values()) == {1}, "a row trained twice or never"
    for t in range(len(steps[0])):  # each step's reported total is the rows of every rank's batch
        assert all(len(s[t][0]) <= batch for s in steps)
        assert {s[t][1] for s in steps} == {sum(len(s[t][0]) for s in steps)}
    assert all(sum(len(s[t][0]) for s in steps) > 0 for t in range(len(steps[0])))  # no step of empty batches only


@pytest.mark.slow
def test_every_row_is_trained_exactly_once_per_epoch_with_uneven_shards_and_a_slow_rank():
    results = run_ranks(3, "tests.dist.workers_queue:consume",
                        {"rows": ROWS, "cuts": CUTS, "chunk": 64, "batch": 16, "epochs": (0, 1), "slow_rank": 1})
    for epoch in (0, 1):
        _check_epoch(results, epoch, ALL, 16)


@pytest.mark.slow
def test_a_snapshot_position_of_two_processes_resumed_on_three_trains_the_rest_exactly_once():
    first = run_ranks(2, "tests.dist.workers_queue:consume",
                      {"rows": ROWS, "cuts": CUTS, "chunk": 64, "batch": 16, "epochs": (0, 1), "stop_after": 9,
                       "slow_rank": 0})
    _check_epoch(first, 0, ALL, 16)
    position = first[0]["position"]
    assert position == first[1]["position"] and position["epoch"] == 1
    done = [row - 100_000 for r in first for rows, _ in r["steps"][1] for row in rows]
    left = [row for a, b in position["ranges"] for row in range(a, b)]
    assert sorted(done + left) == ALL  # the position holds exactly the rows not trained
    rest = run_ranks(3, "tests.dist.workers_queue:consume",
                     {"rows": ROWS, "cuts": CUTS, "chunk": 64, "batch": 24, "epochs": (1, 2), "restore": position})
    _check_epoch(rest, 1, sorted(left), 24)
    _check_epoch(rest, 2, ALL, 24)  # the next epoch: every row again
