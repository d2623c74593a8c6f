"""RecordSpace (store/_tier_space.py): the tier file's record map and allocator.

Oracle: a plain-Python model of the file (record -> value) and of the rows (logical row ->
value), driven the way TieredStore drives the space (clean, plan, write, commit; release).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed.store._tier_space import MOVED, SLACK, RecordSpace

ROWS = 400


def write(space: RecordSpace, file: dict, rows: dict, logical: list[int], value: int) -> int:
    """Writes `logical` rows (new values) as TieredStore's write-back does; returns rows moved by cleaning."""
    own = list(logical)
    space.release(torch.tensor(own, dtype=torch.int64))  # dirty in the cache: their records are garbage
    move = space.to_clean(len(own))
    live_before = {int(space.rec[r]) for r in range(ROWS) if int(space.rec[r]) >= 0}
    if move.numel():  # first the moves (values unchanged), then the rows
        moved_vals = [file[int(space.rec[m])] for m in move.tolist()]
        plan = space.plan(move, MOVED)
        assert not live_before & set(plan.records.tolist()), "a move over a live record"
        for r, v in zip(plan.records.tolist(), moved_vals):
            file[r] = v
        space.commit(plan, move)
        live_before = {int(space.rec[r]) for r in range(ROWS) if int(space.rec[r]) >= 0}
    plan = space.plan(torch.tensor(own, dtype=torch.int64))
    assert not live_before & set(plan.records.tolist()), "a write over a live record"
    for i, r in enumerate(plan.records.tolist()):
        file[r] = value + i
    space.commit(plan, torch.tensor(own, dtype=torch.int64))
    for i, lg in enumerate(own):
        rows[lg] = value + i
    return move.numel()


def check(space: RecordSpace, file: dict, rows: dict) -> None:
    rec = space.rec.tolist()
    live = [r for r in rec if r >= 0]
    assert len(live) == len(set(live)) == space.n_live
    for lg, r in enumerate(rec):
        if r >= 0:
            assert file[r] == rows[lg], lg
    counts = [0] * space.nseg
    for r in live:
        counts[r // space.S] += 1
    assert space.live[: space.nseg].tolist() == counts
    empty = {s for s in range(space.nseg) if counts[s] == 0}
    assert set(space.free) <= empty and len(space.free) == len(set(space.free))
    assert empty - set(space.free) <= set(space.open_seg), "an empty segment is neither free nor open: leaked"


@settings(max_examples=40)
@given(ops=st.lists(st.tuples(st.sampled_from(["write", "release"]),
                              st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=60, unique=True)),
                    min_size=1, max_size=60),
       seg=st.sampled_from([16, 24, 64]))
def test_every_row_reads_its_last_write_and_the_file_stays_bounded(ops, seg):
    space = RecordSpace(1, "t", segment_bytes=seg)
    assert space.S == seg
    space.grow(ROWS)
    file: dict[int, int] = {}
    rows: dict[int, int] = {}
    for i, (op, logical) in enumerate(ops):
        if op == "write":
            write(space, file, rows, logical, 1000 * i)
        else:
            space.release(torch.tensor(logical, dtype=torch.int64))
            for lg in logical:
                rows.pop(lg, None)
        check(space, file, rows)
        # the disk bound: the live rows with SLACK beside, plus the segments a write may open
        assert space.records <= (space.n_live + 60) * (1 + SLACK) + 4 * space.S + 60 * 2


@pytest.mark.parametrize("seg", [16, 64])
@pytest.mark.slow
def test_a_steady_stream_of_write_backs_cleans_instead_of_growing(seg):
    """Rows written back over and over (a cache's traffic): cleaning moves rows, the file stops growing
    (within the bound, 1/8 past it and a few segments, even with segments this small next to the
    writes: at real sizes a segment is ~4 k rows and the bound is ~1.5x), and every row still reads
    its last value."""
    space = RecordSpace(1, "t", segment_bytes=seg)
    space.grow(ROWS)
    file, rows, moved = {}, {}, 0
    moved += write(space, file, rows, list(range(ROWS)), 0)  # every row on disk (a prefilled tier)
    g = torch.Generator().manual_seed(0)
    sizes = []
    for i in range(600):
        lg = torch.unique((torch.rand(30, generator=g) ** 2 * ROWS).long()).tolist()
        moved += write(space, file, rows, lg, 10_000 * (i + 1))
        check(space, file, rows)
        sizes.append(space.records)
    assert moved > 0
    # the bound, 1/8 past it, open segments and the room kept ahead (4 write-backs of <= 30 rows and
    # one more): 18 k records were written in all
    assert sizes[-1] <= (1 + SLACK) * 1.125 * ROWS + 4 * space.S + 5 * 30
    assert sizes[-1] - sizes[299] <= 2 * seg  # steady state: at most a segment or two more in 300 writes
