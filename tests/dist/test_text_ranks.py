"""Several processes reading one text file: rank r takes lines i % N == r in whole batches, so at the
end of an epoch one rank may hold a batch more than another.  Every step is collective, so each
rank must stop when the first runs out (before the fix rank 0 waited for a peer that had finished,
until the timeout)."""

from __future__ import annotations

import random

import pytest

from ._harness import run_ranks


def _write(path, rows: int) -> None:
    rng = random.Random(rows)
    with open(path, "w") as f:
        for i in range(rows):
            dense = [str(i)] + [str(rng.randint(0, 9)) for _ in range(12)]
            cats = [f"{rng.randint(0, 300):08x}" for _ in range(26)]
            f.write("\t".join([str(rng.randint(0, 1)), *dense, *cats]) + "\n")


@pytest.mark.parametrize("rows", [383, 384, 200])
def test_every_rank_takes_as_many_training_batches_as_the_shortest(tmp_path, rows):
    batch, world = 64, 2
    data, held = tmp_path / "train.txt", tmp_path / "eval.txt"
    _write(data, rows)
    _write(held, 64)
    got = run_ranks(world, "tests.dist.workers_text:train_rows",
                    {"data": str(data), "eval_data": str(held), "batch": batch})
    # oracle: rank r's lines, in whole batches; the epoch is as long as the shortest rank's
    mine = [[i for i in range(rows) if i % world == r] for r in range(world)]
    steps = min(len(m) // batch for m in mine)
    assert [len(g) for g in got] == [steps] * world
    for r in range(world):
        trained = sorted(i for b in got[r] for i in b)
        assert all(len(b) == batch for b in got[r])
        assert set(trained) <= set(mine[r]) and len(trained) == steps * batch
    if rows == 383:  # the case that hung: rank 0 holds 3 whole batches, rank 1 only 2
        assert [len(m) // batch for m in mine] == [3, 2]
