"""The HTTP server: starlette app on uvicorn, micro-batching concurrent requests into one model call.

::

    POST /predict   JSON or TSV body (see _requests.py) -> {"predictions": [p, ...], "version": "step-..."}
    GET  /healthz   {"status": "ok" | "degraded", "version": ...} (degraded: a delta was refused, and why)
    GET  /metrics   requests, rows, errors, latency p50/p99 (ms), batches, version, deltas applied
    POST /reload    applies the deltas written since (with the --admin-token; also every --watch seconds)

Requests are parsed in the event loop (InputError -> 400 with its one line), then queued;
one batcher task takes the first waiting request with the others already queued (they arrived
while the previous call ran), gathers more for at most `max_wait_ms` (default 0: a lone request
does not wait), up to `max_batch_rows`, runs the model once on their concatenation in a worker thread
and hands each request its slice.  One model call reads one served version: every
response (it names its version) comes from the old model or the new one, never a mix.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from ..features import SparseFeatures
from ._model import ServingModel
from ._reloader import Reloader
from ._requests import MAX_BODY_BYTES, parse_body

__all__ = ["make_app", "serve", "ServerConfig", "Metrics"]


@dataclass(frozen=True)
class ServerConfig:
    """Args: max_wait_ms: longest a call waits for more requests to join it (0: none; requests that
    arrived while the previous call ran join it anyway, so batches form under load); max_batch_rows: rows
    per model call (a bigger request runs alone); watch_s: seconds between looks for new deltas
    (0, the default: none); admin_token: what POST /reload must present as ``Authorization: Bearer``
    (None, the default: POST /reload is off); max_body_bytes: larger bodies get 413."""

    max_wait_ms: float = 0.0
    max_batch_rows: int = 4096
    watch_s: float = 0.0
    admin_token: str | None = field(default=None, repr=False)
    max_body_bytes: int = MAX_BODY_BYTES


@dataclass
class Metrics:
    """Counters and the latencies of the last 10 000 requests (ms, arrival to response)."""

    requests: int = 0
    rows: int = 0
    errors: int = 0
    batches: int = 0
    reloads: int = 0
    reload_errors: int = 0
    latency_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))
    parse_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))
    model_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))

    def snapshot(self, model: ServingModel) -> dict[str, Any]:
        def pct(d, q):
            return round(float(np.percentile(np.fromiter(d, float), q)), 3) if d else None

        return {"requests": self.requests, "rows": self.rows, "errors": self.errors, "batches": self.batches,
                "latency_ms": {"p50": pct(self.latency_ms, 50), "p99": pct(self.latency_ms, 99)},
                "parse_ms": {"p50": pct(self.parse_ms, 50), "p99": pct(self.parse_ms, 99)},
                "model_ms": {"p50": pct(self.model_ms, 50), "p99": pct(self.model_ms, 99)},
                "version": model.version, "deltas": list(model.served.deltas), "dtype": model.dtype,
                "reloads": self.reloads, "reload_errors": self.reload_errors}


@dataclass
class _Pending:
    dense: torch.Tensor
    sparse: SparseFeatures
    future: asyncio.Future


class _Batcher:
    def __init__(self, model: ServingModel, cfg: ServerConfig, metrics: Metrics) -> None:
        self.model, self.cfg, self.metrics = model, cfg, metrics
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.task: asyncio.Task | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            rows = batch[0].dense.shape[0]
            deadline = loop.time() + self.cfg.max_wait_ms / 1000
            while rows < self.cfg.max_batch_rows:
                left = deadline - loop.time()
                if self.queue.empty() and left <= 0:  # nothing queued, no (more) wait: start the call
                    break
                try:
                    nxt = self.queue.get_nowait() if not self.queue.empty() else await asyncio.wait_for(
                        self.queue.get(), left)
                except (asyncio.TimeoutError, TimeoutError):
                    break
                batch.append(nxt)
                rows += nxt.dense.shape[0]
            try:
                results, version = await loop.run_in_executor(None, self._compute, batch)
            except Exception as e:  # a bug, not a bad request (those are refused at parse): 500 for these
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p, r in zip(batch, results):
                if not p.future.done():
                    p.future.set_result((r, version))

    def _compute(self, batch: list[_Pending]) -> tuple[list[list[float]], str]:
        started = time.perf_counter()
        served = self.model.served  # one version for the whole call
        if len(batch) == 1:
            dense, sparse = batch[0].dense, batch[0].sparse
        else:
            dense = torch.cat([p.dense for p in batch])
            sparse = SparseFeatures.concat_batches([p.sparse for p in batch])
        values, offsets = sparse.values(), sparse.offsets()
        probs = torch.sigmoid(self.model.logits_raw(dense, values, offsets, served)).tolist()
        out, at = [], 0
        for p in batch:
            n = p.dense.shape[0]
            out.append(probs[at: at + n])
            at += n
        self.metrics.batches += 1
        self.metrics.model_ms.append((time.perf_counter() - started) * 1000)
        return out, served.version


def make_app(model: ServingModel, cfg: ServerConfig | None = None):
    """The starlette application serving `model` (the batcher and the delta watcher start with it)."""
    try:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse
        from starlette.routing import Route
    except ImportError:
        raise ImportError("the server needs starlette and uvicorn: pip install 'hugeembed[serve]'") from None
    cfg = cfg or ServerConfig()
    metrics = Metrics()
    batcher = _Batcher(model, cfg, metrics)
    reloader = Reloader(model, metrics, watch_s=cfg.watch_s, token=cfg.admin_token)

    def bad(status: int, reason: str):
        metrics.errors += 1
        return PlainTextResponse(reason.splitlines()[0] + "\n", status_code=status)

    async def predict(request):
        t0 = time.perf_counter()
        metrics.requests += 1
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            return bad(413, f"body of {declared} bytes, more than {cfg.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > cfg.max_body_bytes:
                return bad(413, f"body larger than {cfg.max_body_bytes} bytes")
        body = b"".join(chunks)
        try:
            dense, sparse = parse_body(body, request.headers.get("content-type", ""), model.features, model.num_dense)
            model.check(dense, sparse)  # the same checks as the Python API; changes nothing
        except (InputError, NotImplementedError) as e:
            return bad(400, str(e))
        metrics.parse_ms.append((time.perf_counter() - t0) * 1000)
        fut = asyncio.get_running_loop().create_future()
        await batcher.queue.put(_Pending(dense, sparse, fut))
        try:
            probs, version = await fut
        except Exception as e:
            return bad(500, f"prediction failed: {type(e).__name__}: {e}")
        metrics.rows += len(probs)
        metrics.latency_ms.append((time.perf_counter() - t0) * 1000)
        return JSONResponse({"predictions": probs, "version": version})

    async def healthz(request):
        return JSONResponse(reloader.health())

    async def get_metrics(request):
        return JSONResponse(metrics.snapshot(model))

    async def reload(request):
        denied = reloader.authorize(request.headers.get("authorization"))
        if denied is not None:
            return PlainTextResponse(denied[1] + "\n", status_code=denied[0],
                                     headers={"WWW-Authenticate": "Bearer"} if denied[0] == 401 else None)
        applied = await reloader.reload_now()
        if model.refused is not None:  # those before it were applied; the served version is the last good one
            return JSONResponse({"version": model.version, "applied": applied, "refused": model.refused.delta,
                                 "reason": model.refused.reason}, status_code=409)
        return JSONResponse({"version": model.version, "applied": applied})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        tasks = [asyncio.create_task(batcher.run())]
        reloader.start()
        try:
            yield
        finally:  # uvicorn has answered every request in flight by now (graceful shutdown)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await reloader.stop()

    routes = [Route("/predict", predict, methods=["POST"]), Route("/healthz", healthz, methods=["GET"]),
              Route("/metrics", get_metrics, methods=["GET"]), Route("/reload", reload, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan)


def serve(model: ServingModel, *, host: str = "127.0.0.1", port: int = 8080, cfg: ServerConfig | None = None,
          log_level: str = "warning") -> None:
    """Runs the server until SIGINT/SIGTERM (uvicorn: stops accepting, finishes the requests in flight)."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("the server needs starlette and uvicorn: pip install 'hugeembed[serve]'") from None
    uvicorn.run(make_app(model, cfg), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
