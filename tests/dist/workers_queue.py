"""What each rank runs in the data-queue tests (tests/dist/test_data_queue.py): a QueueSource over rows whose
dense value is their row number, so the test can tell which rows every rank trained."""

from __future__ import annotations

import time

import numpy as np

from hugeembed.data import Block
from hugeembed.training._queue import QueueSource, check_queue_state
from hugeembed.training._sources import DataSource


class _Rows(DataSource):
    description = "numbered rows"

    def train_batches(self, epoch, skip=0):
        raise AssertionError("the queue reads the rows itself")

    def eval_batches(self):
        return iter(())


def numbered(epoch: int, a: int, b: int) -> Block:
    n = b - a
    return Block(np.arange(a, b, dtype=np.float32)[:, None] + np.float32(epoch * 100_000), np.zeros((n, 1), np.int64),
                 np.zeros(n, np.float32))


def consume(rank: int, world: int, workdir: str, rows: list, cuts: list, chunk: int, batch: int,
            epochs: tuple = (0,), stop_after: int | None = None, restore: dict | None = None,
            slow_rank: int | None = None) -> dict:
    """Trains nothing: takes batches as a training run would, records their rows per step; `stop_after` steps
    into the last epoch: returns the queue position (a snapshot's) there; `slow_rank` reads 20 ms per chunk."""

    def read(epoch, a, b):
        if rank == slow_rank and b > a:
            time.sleep(0.02)
        return numbered(epoch, a, b)

    src = QueueSource(_Rows(), read, [tuple(r) for r in rows], cuts, ["f"], chunk, batch, rank, world, 30.0)
    if restore is not None:
        src.restore(check_queue_state(restore, "test"))
    out: dict = {"steps": {}, "position": None}
    for epoch in epochs:
        steps = []
        for b in src.train_batches(epoch):
            total = src.trained(b, world)
            steps.append((b.dense[:, 0].long().tolist(), total))
            if stop_after is not None and epoch == epochs[-1] and len(steps) == stop_after:
                out["position"] = src.position()
                out["steps"][epoch] = steps
                return out
        out["steps"][epoch] = steps
    return out
