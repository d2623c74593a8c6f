"""The server's queue and micro-batcher: requests wait, bounded by rows, then run together.

A parsed request is admitted to the queue unless the rows already waiting and its own would pass
``max_queue_rows`` (the server answers 503 with Retry-After).  One batcher task takes the first
waiting request with every other one already queued (those that arrived while the previous model
call ran), waits up to ``max_wait_ms`` for more, up to ``max_batch_rows``, and runs the model once
on all of them on its own thread (parsing and reloads have theirs).  A request whose client left
or whose time ran out while it waited is dropped from the queue before the call, never computed.
One model call reads one served version: every response names it, none mixes two.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from ._model import ServingModel
from ._requests import ParsedRequest, concat_requests

__all__ = ["Batcher", "Pending", "SMALL_CALL_ROWS"]

SMALL_CALL_ROWS = 128  # model calls of at most this many rows run on one torch thread


class Pending:
    """One admitted request: its rows, the future of its (probabilities, version), its state."""

    __slots__ = ("parsed", "future", "rows", "queued", "abandoned", "admitted_at", "queue_ms", "model_ms",
                 "model_cpu_ms")

    def __init__(self, parsed: ParsedRequest, future: asyncio.Future) -> None:
        self.parsed, self.future, self.rows = parsed, future, parsed.rows
        self.queued = self.abandoned = False
        self.admitted_at = time.perf_counter()
        # its wait for the model, the model call it was in, and that call's CPU time (the model thread's)
        self.queue_ms = self.model_ms = self.model_cpu_ms = 0.0


class Batcher:
    """Args: model; max_batch_rows: rows per model call (a larger request runs alone); max_queue_rows:
    rows that may wait; max_wait_ms: how long a call waits for more requests; on_batch(requests,
    rows, queue_ms, model_ms): called on the event loop after each call (metrics)."""

    def __init__(self, model: ServingModel, *, max_batch_rows: int, max_queue_rows: int, max_wait_ms: float,
                 on_batch: Callable[[int, int, list[float], float], Any]) -> None:
        self.model, self.on_batch = model, on_batch
        self.max_batch_rows, self.max_queue_rows, self.max_wait_s = max_batch_rows, max_queue_rows, max_wait_ms / 1000
        self.waiting: collections.deque[Pending] = collections.deque()
        self.queued_rows = 0
        self._wake = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="hugeembed-model")
        self.threads = torch.get_num_threads()  # for large calls; small ones run on one (see _compute)

    def admit(self, p: Pending) -> bool:
        """Queues `p` (True), or False when the queue has no room for its rows (one request always fits
        an empty queue)."""
        if self.waiting and self.queued_rows + p.rows > self.max_queue_rows:
            return False
        p.queued = True
        self.waiting.append(p)
        self.queued_rows += p.rows
        self._wake.set()
        return True

    def abandon(self, p: Pending) -> None:
        """`p` is no longer wanted (its client left, or its time ran out): dropped if still queued."""
        p.abandoned = True
        if p.queued:
            p.queued = False
            self.queued_rows -= p.rows

    def _take(self, batch: list[Pending], rows: int) -> int:
        while self.waiting and (not batch or rows + self.waiting[0].rows <= self.max_batch_rows):
            p = self.waiting.popleft()
            if p.abandoned:
                continue
            p.queued = False
            self.queued_rows -= p.rows
            batch.append(p)
            rows += p.rows
        return rows

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            batch: list[Pending] = []
            rows = self._take(batch, 0)
            deadline = loop.time() + self.max_wait_s
            while batch and rows < self.max_batch_rows and loop.time() < deadline:
                if not self.waiting:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), deadline - loop.time())
                    except asyncio.TimeoutError:
                        break
                before = rows
                rows = self._take(batch, rows)
                if rows == before and self.waiting:  # the next one does not fit: run these
                    break
            if not batch:
                continue
            started = time.perf_counter()
            for p in batch:
                p.queue_ms = (started - p.admitted_at) * 1000
            try:
                results, version, cpu_ms = await loop.run_in_executor(self.executor, self._compute, batch, rows)
            except Exception as e:  # a bug, not a bad request (those are refused at parse): 500 for these
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            model_ms = (time.perf_counter() - started) * 1000
            self.on_batch(len(batch), rows, [p.queue_ms for p in batch], model_ms)
            for p, r in zip(batch, results):
                p.model_ms, p.model_cpu_ms = model_ms, cpu_ms
                if not p.future.done():
                    p.future.set_result((r, version))

    def _compute(self, batch: list[Pending], rows: int) -> tuple[list[list[float]], str, float]:
        # A small call on one thread: its matrix products are too small to split, and waking an OpenMP worker
        # (which another process may hold the CPU of) cost more than it saved (64 rows: 2.4 vs 2.7 ms of CPU).
        cpu0 = time.thread_time()  # this thread's CPU alone: the call's cost, without the waits for a CPU
        threads = 1 if rows <= SMALL_CALL_ROWS else self.threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        served = self.model.served  # one version for the whole call
        req = concat_requests([p.parsed for p in batch], len(self.model.features))
        logits = self.model.logits_raw(torch.from_numpy(req.dense), torch.from_numpy(req.values),
                                       torch.from_numpy(req.offsets), served)
        probs = torch.sigmoid(logits).tolist()
        out, at = [], 0
        for p in batch:
            out.append(probs[at: at + p.rows])
            at += p.rows
        return out, served.version, (time.thread_time() - cpu0) * 1000

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
