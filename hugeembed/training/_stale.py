"""The trainer's side of bounded staleness (``--staleness K``) and of simulated stragglers (``--jitter``).

With K >= 1 (several processes) the sharded collection runs its exchanges K steps ahead
(distributed/_pipeline.py): this module hands each batch over K steps before its forward, never
past a drain point (an evaluation, a snapshot, the last step: the pipeline empties there, so a
snapshot is a consistent state and ``--resume`` continues exactly), and applies the dense
gradients K steps late (:class:`~hugeembed.distributed.DelayedDenseGrads`, instead of DDP).

With ``stale_scale`` (the default) a delayed dense step (D >= 1) runs at 1 / (1 + D) of the
dense learning rate, as a row is stepped by 1 / (1 + its updates in flight) (the owners:
distributed/_stale_rows.py): with Adam at the full rate, tables and dense part stale together
diverge early (K = D = 4: held-out AUC 0.70 vs 0.81 synchronous after 300 steps).
"""

from __future__ import annotations

import collections
import random
import time
from typing import Callable, Iterable, Iterator

from ..distributed import DelayedDenseGrads

__all__ = ["StaleRun"]


class StaleRun:
    """Look-ahead, delayed dense steps and jitter of one training run.

    Args:
        collection: the model's collection (a ShardedEmbeddingCollection built with staleness K when K >= 1).
        dense_params: the dense parameters.
        staleness: K (0: synchronous; nothing is handed over ahead).
        dense_staleness: D (the dense gradients of step t are applied at step t+D); with K = D = 0
            DDP runs the dense part and this object leaves it alone.
        jitter: (P, F) or None.
        seed, rank: seed the jitter's draws (each rank its own sequence, the same in every run).
        timeout: seconds a dense all-reduce may wait.
        dense_group: the group the dense gradients are all-reduced over (None: every rank; --servers: the workers').
        dense: False on a server rank: it trains no dense part (no all-reduce of its own).
        stale_scale: delayed dense steps at 1 / (1 + D) of the learning rate (False: the full rate).
    """

    def __init__(self, collection, dense_params, staleness: int, dense_staleness: int,
                 jitter: tuple[float, float] | None, seed: int, rank: int, timeout: float, dense_group=None,
                 dense: bool = True, stale_scale: bool = True) -> None:
        self.collection, self.staleness = collection, staleness
        self.dense_lr_scale = 1.0 / (1 + dense_staleness) if stale_scale else 1.0
        self.dense = DelayedDenseGrads(dense_params, dense_staleness, process_group=dense_group, timeout=timeout) \
            if (staleness or dense_staleness) and dense else None
        self.jitter = jitter
        self._rng = random.Random(f"jitter:{seed}:{rank}")
        self.slept = 0.0  # seconds of simulated straggling

    def batches(self, batches: Iterable, done: int, device, drains_after: Callable[[int], bool]) -> Iterator:
        """`batches` (steps done+1, done+2, ...), each handed over to the collection K steps ahead of
        its forward but never past a step after which the pipeline drains."""
        if not self.staleness:
            yield from batches
            return
        it, ahead, step = iter(batches), collections.deque(), done
        exhausted = False
        while True:
            limit = step + 1 + self.staleness  # the newest step that may be handed over now
            for s in range(step + 1, limit):
                if drains_after(s):
                    limit = s
                    break
            while not exhausted and step + len(ahead) < limit:
                b = next(it, None)
                if b is None:
                    exhausted = True
                    break
                b = b.to(device, non_blocking=True)
                self.collection.enqueue(b.sparse)
                ahead.append(b)
            if not ahead:
                return
            yield ahead.popleft()
            step += 1

    def dense_step(self, step: int, optimizer) -> None:
        """After the backward of `step`: start its dense all-reduce; step the optimizer with the gradients
        of step - K when they are due (synchronous: DDP reduced them, step now)."""
        if self.dense is None:
            optimizer.step()
            return
        self.dense.push(step)
        if self.dense.pop():
            self._step_dense(optimizer)

    def _step_dense(self, optimizer) -> None:
        if self.dense_lr_scale == 1.0:
            optimizer.step()
            return
        lrs = [g["lr"] for g in optimizer.param_groups]  # (the trainer sets them again before each step)
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * self.dense_lr_scale
        optimizer.step()
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr

    def drain(self, optimizer) -> None:
        """Every exchange handed over has run and every dense gradient pushed has been applied."""
        if self.staleness:
            self.collection.drain()
        while self.dense is not None and self.dense.pop(force=True):
            self._step_dense(optimizer)

    def straggle(self, compute_seconds: float) -> None:
        """With probability P, sleep (F - 1) x this step's compute (a simulated straggler)."""
        if self.jitter is None:
            return
        p, f = self.jitter
        if self._rng.random() < p:
            t0 = time.perf_counter()
            time.sleep((f - 1.0) * compute_seconds)
            self.slept += time.perf_counter() - t0

    def waits(self) -> dict[str, float]:
        """Where this rank's training time went besides compute: seconds its forwards waited for rows
        fetched ahead, its dense steps for an all-reduce, and it slept (--jitter).  Synchronous runs
        wait inside DDP and the exchanges: only the sleep is counted."""
        out = {"jitter_sleep_s": self.slept}
        if self.staleness:
            out["wait_rows_s"] = self.collection.fetch_wait_seconds
        if self.dense is not None:
            out["wait_dense_s"] = self.dense.waited
        return out
