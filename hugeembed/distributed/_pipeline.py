"""Bounded staleness: a sharded collection's exchanges run K steps ahead on one thread per rank.

With ``staleness=K`` every rank hands its exchanges to an :class:`ExchangeThread`, which runs
them one after another, in the order they were handed over — the same order on every rank, so
the collectives match::

    fetch(1) .. fetch(K+1), grads(1), fetch(K+2), grads(2), fetch(K+3), ...

``fetch(b)`` is batch b's input_dist + owners' find-or-insert + output_dist (rows and pooled
vectors back); ``grads(t)`` is step t's grad_dist + the owners' updates.  So the rows batch b
reads hold the updates of batches up to b-K-1 and none later (exactly, not "at most"), and a
rank waits for its peers only when it needs the rows of a batch or has K exchanges queued: a
rank stalled for a few steps is caught up with instead of gating every step.  K = 0 is the
synchronous order (fetch(t), grads(t), fetch(t+1), ...).

Data-parallel (replicated) tables may be read less stale: with ``replicated_staleness=R < K``
a batch's fetch still registers its keys (admission, slots) K steps ahead, but the replica's
rows are copied on the thread right after ``grads(b-R-1)`` -- ``read(b)`` -- so batch b reads
the replicas with the updates of batches up to b-R-1 exactly (the trainer passes the dense
delay D: replicas, hot rows every batch updates, follow the dense part's schedule).

``drain()`` waits until every exchange handed over has run (snapshots, evaluation and the end
of training need a state no exchange is changing).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future

import torch

from ..errors import ShardingError
from ..features import SparseFeatures
from ._stale_comp import DelayCompensation, compensable
from ._stale_rows import RowStaleness, scalable, scale_row_steps

__all__ = ["ExchangeThread", "PendingFetch", "StalePipeline", "PipelinedExchanges"]


class ExchangeThread:
    """Runs callables one at a time, in submission order, on a daemon thread; each gives a Future.

    After a failure the thread runs nothing more: every later submit fails with the first error
    (a collective that failed leaves the ranks out of step: nothing after it can be trusted)."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fn, fut = item
            if self._failed is not None:
                fut.set_exception(self._failed)
            else:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to whoever waits on it, and to every later task
                    self._failed = e
                    fut.set_exception(e)
            with self._lock:
                self._pending -= 1

    def submit(self, fn) -> Future:
        if self._failed is not None:
            raise self._failed
        fut: Future = Future()
        with self._lock:
            self._pending += 1
        self._tasks.put((fn, fut))
        return fut

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def close(self) -> None:
        self._tasks.put(None)


class PendingFetch:
    """A training batch handed over ahead of its forward: its step, the batch and the fetch's Future;
    `late`: its replicas are read after a later step's grads (`read`: that read's Future once handed over)."""

    __slots__ = ("step", "features", "future", "late", "read")

    def __init__(self, step: int, features, future: Future, late: bool = False) -> None:
        self.step, self.features, self.future = step, features, future
        self.late, self.read = late, None


class StalePipeline:
    """The queue of a collection's fetches ahead and its exchange thread (see the module docstring).

    Args:
        coll: the ShardedEmbeddingCollection (``_fetch_step(features, step)`` and
            ``_grad_exchange(st)`` run on the thread).
        staleness: K >= 0.
        row_scale: K >= 1: each row's step scaled by 1 / (1 + its updates in flight) (_stale_rows.py).
        compensation: lambda of the delay-compensated row gradients (_stale_comp.py); 0: off.
        replicated_staleness: R in [0, K]: data-parallel tables read after grads(b-R-1) (None: K).
    """

    def __init__(self, coll, staleness: int, row_scale: bool = True, compensation: float = 0.0,
                 replicated_staleness: int | None = None) -> None:
        self.coll, self.staleness = coll, staleness
        self.replicated = staleness if replicated_staleness is None else replicated_staleness
        self.rows = RowStaleness(staleness, coll._replicated_tables()) if staleness and row_scale else None
        self.compensation = DelayCompensation(staleness, compensation, coll._replicated_tables()) \
            if staleness and compensation else None
        self.thread = ExchangeThread(f"hugeembed-exchange-rank{coll.rank}")
        self.ahead: collections.deque[PendingFetch] = collections.deque()
        self.grads: collections.deque[Future] = collections.deque()
        self.late: dict[int, PendingFetch] = {}  # step s -> the fetch whose replica read follows grads(s)
        self.grads_through: int | None = None  # the last step whose grads were handed over
        self.waited = 0.0  # seconds the training forwards blocked on their rows (the fetch not done yet)

    def enqueue(self, features) -> None:
        """Hands the next training batch over (it runs after the grads of every step before it minus K)."""
        step = self.coll.step + len(self.ahead) + 1  # (the collection's step: training forwards taken, or loaded)
        done = self.coll.step if self.grads_through is None else self.grads_through
        # replicas read at the fetch hold the updates of every step up to `done`: later when that is too fresh
        late = self.replicated < self.staleness and step - self.replicated - 1 > done and self.coll._has_replicas
        fut = self.thread.submit(lambda: self._fetch(features, step, late))
        pending = PendingFetch(step, features, fut, late)
        self.ahead.append(pending)
        if late:
            self.late[step - self.replicated - 1] = pending

    def take(self, features, step: int):
        """The StepState of the training forward of `step` (its fetch handed over before)."""
        if not self.ahead:
            if self.staleness == 0:  # the synchronous order needs no look-ahead: hand it over now
                self.enqueue(features)
            else:
                raise ShardingError(
                    f"step {step}: with staleness {self.staleness} every training batch must be handed over "
                    f"{self.staleness} steps ahead (collection.enqueue(batch.sparse)) before its forward")
        head = self.ahead[0]
        if head.step != step or head.features is not features:
            raise ShardingError(f"step {step}: the forward's batch is not the one handed over for step {head.step} "
                                f"(collection.enqueue): forwards must take the enqueued batches, in order")
        self.ahead.popleft()
        if head.late and head.read is None:  # no backward handed the read over (a step without grads): now
            self._submit_read(self.late.pop(head.step - self.replicated - 1))
        t0 = time.perf_counter()
        try:
            st = self._result(head.future)
            if head.read is not None:
                self._result(head.read)
            return st
        finally:
            self.waited += time.perf_counter() - t0

    def _fetch(self, features, step: int, late: bool):
        for record in (self.rows, self.compensation):
            if record is not None:
                record.fetched(step)
        return self.coll._fetch_step(features, step, replicas_late=late)

    def _submit_read(self, pending: PendingFetch) -> None:
        fetch = pending.future

        def read() -> None:
            for record in (self.rows, self.compensation):
                if record is not None:
                    record.read_replicas(pending.step)
            self.coll._read_replicas(fetch.result())

        pending.read = self.thread.submit(read)

    def _grads(self, st) -> None:
        self.coll._grad_exchange(st)
        for record in (self.rows, self.compensation):
            if record is not None:
                record.applied(st.step)

    def submit_grads(self, st) -> None:
        self.grads.append(self.thread.submit(lambda: self._grads(st)))
        self.grads_through = st.step
        if st.step in self.late:  # the replicas of batch step + R + 1 are read right after this step's update
            self._submit_read(self.late.pop(st.step))
        while self.grads and self.grads[0].done():
            self._result(self.grads.popleft())

    def drain(self) -> None:
        """Waits for every exchange handed over; fetches ahead stay (their batches still come)."""
        while self.grads:
            self._result(self.grads.popleft())
        for p in self.ahead:
            self._result(p.future)
            if p.read is not None:
                self._result(p.read)

    @staticmethod
    def _result(fut: Future):
        return fut.result()  # re-raises the thread's error (a ShardingError naming step and stage)

    def close(self) -> None:
        self.thread.close()


class PipelinedExchanges:
    """The staleness API of ShardedEmbeddingCollection (which sets ``_pipeline``: a StalePipeline or None)."""

    _pipeline: StalePipeline | None

    @property
    def staleness(self) -> int | None:
        """K of the exchange pipeline, or None (synchronous, no exchange thread)."""
        return None if self._pipeline is None else self._pipeline.staleness

    def enqueue(self, features: SparseFeatures) -> None:
        """Hands a future training batch (this rank's local batch) over to the exchange thread: its
        rows are fetched once the updates of every step K or more before it have been applied.
        Batches are taken by the training forwards in the order they were enqueued."""
        if self._pipeline is None:
            raise ShardingError("enqueue needs a collection built with staleness=K")
        if not isinstance(features, SparseFeatures):
            raise ShardingError(f"enqueue takes a SparseFeatures batch, got {type(features).__name__}")
        if features.device != self.device:
            raise ShardingError(f"batch {list(features.keys())} is on {features.device} but the tables are on "
                                f"{self.device}: move it with batch.to(device) before enqueue")
        self._pipeline.enqueue(features)

    def update_rows(self, t: int, slots, grad, flight, keys=None, hits=None, shared_slot: int = -1) -> None:
        """The owners' update; under staleness K >= 1 each row's gradient delay-compensated
        (_stale_comp.py) and its step scaled by 1 / (1 + n), n its updates since the fetch that read
        it (_stale_rows.py), as the collection was built."""
        pipe = self._pipeline
        rows = None if pipe is None else pipe.rows
        comp = None if pipe is None or not slots.numel() or not compensable(self, t) else pipe.compensation
        if comp is not None:
            storage, dim = self.groups[self.group_index(t)].storage(), self.tables[t].dim
            grad = comp.compensate(flight.step, t, slots, grad, comp.drift(flight.step, t, slots, dim, storage.dtype))
            done = torch.unique(slots)
            before = storage.index_select(0, done)[:, :dim].clone()
        plain = lambda: super(PipelinedExchanges, self).update_rows(  # noqa: E731
            t, slots, grad, flight, keys=keys, hits=hits, shared_slot=shared_slot)
        if rows is None or keys is None or not slots.numel():
            plain()
        else:
            scale = rows.applying(flight.step, t, keys)
            if not scalable(self, t) or bool((scale == 1.0).all()):
                plain()
            else:
                scale_row_steps(self, t, slots, scale, shared_slot, plain)
        if comp is not None:
            storage = self.groups[self.group_index(t)].storage()
            comp.record(t, done, storage.index_select(0, done)[:, :dim] - before)

    def drain(self) -> None:
        """Waits until every exchange handed over has run (a no-op without staleness)."""
        if self._pipeline is not None:
            self._pipeline.drain()

    @property
    def fetch_wait_seconds(self) -> float:
        """Seconds this rank's training forwards waited for rows fetched ahead (0.0 without staleness)."""
        return 0.0 if self._pipeline is None else self._pipeline.waited

    @property
    def batches_ahead(self) -> int:
        """Training batches enqueued whose forward has not run yet."""
        return 0 if self._pipeline is None else len(self._pipeline.ahead)
