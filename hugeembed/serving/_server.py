"""The HTTP server: starlette app on uvicorn, micro-batching concurrent requests into one model call.

::

    POST /predict   JSON, TSV or CSV body (see _schema_requests.py) -> {"predictions": [p, ...], "version": "step-..."},
                    and a Server-Timing header: parse, queue and model milliseconds, and the model call's CPU ms
    GET  /healthz   {"status": "ok" | "degraded", "version": ...} (degraded: a delta was refused, and why)
    GET  /metrics   requests, rows, refusals by status, latency / parse / queue / model p50 and p99 (ms), ...
    POST /reload    applies the deltas written since (with the --admin-token; also every --watch seconds)

A request is bounded at every step: its Host header must name the server (else 400: DNS
rebinding), its content type be one the server reads (415), its body at most max_body_bytes (413)
and its rows at most max_request_rows (413).  The body is parsed off the event loop (small ones
inline: the kernels take microseconds; larger ones on the parse thread, the interpreter lock
released), then queued unless the queue holds max_queue_rows already (503 + Retry-After); the
batcher (_batcher.py) runs the model on its own thread.  A request not answered within
request_timeout_s gets 504; one whose client went away is dropped before its model call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError, InputError
from ._batcher import Batcher, Pending
from ._model import ServingModel
from ._reloader import Reloader
from ._requests import MAX_BODY_BYTES, RequestParser, RequestTooLarge, UnsupportedContentType, media_type
from ._schema_requests import SchemaBodyParser

__all__ = ["make_app", "serve", "uvicorn_config", "ServerConfig", "Metrics", "LOOPBACK_HOSTS", "freeze_loaded_heap"]

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_INLINE_PARSE_BYTES = 64 << 10  # smaller bodies parse on the event loop: ~0.1 ms, less than a thread handoff


@dataclass(frozen=True)
class ServerConfig:
    """Args: max_wait_ms: longest a call waits for more requests to join it (0: none; requests that
    arrived while the previous call ran join it anyway, so batches form under load); max_batch_rows: rows
    per model call (a bigger request runs alone); watch_s: seconds between looks for new deltas
    (0, the default: none); admin_token: what POST /reload must present as ``Authorization: Bearer``
    (None, the default: POST /reload is off); max_body_bytes: larger bodies get 413; max_request_rows: rows of one
    request (more: 413; None: max_batch_rows); max_queue_rows: rows that may wait for the model (a
    request that does not fit gets 503 + Retry-After; None: 4 x max_batch_rows); request_timeout_s:
    arrival to answer (then 504); allowed_hosts: names the Host header may give ("*": any);
    limit_concurrency: connections and requests at once (uvicorn answers 503 beyond)."""

    max_wait_ms: float = 0.0
    max_batch_rows: int = 4096
    watch_s: float = 0.0
    admin_token: str | None = field(default=None, repr=False)
    max_body_bytes: int = MAX_BODY_BYTES
    max_request_rows: int | None = None
    max_queue_rows: int | None = None
    request_timeout_s: float = 10.0
    allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    limit_concurrency: int = 64

    def __post_init__(self) -> None:
        checks = [("max_wait_ms", self.max_wait_ms >= 0), ("max_batch_rows", self.max_batch_rows >= 1),
                  ("max_body_bytes", self.max_body_bytes >= 1), ("request_timeout_s", self.request_timeout_s > 0),
                  ("limit_concurrency", self.limit_concurrency >= 1),
                  ("max_request_rows", self.max_request_rows is None or self.max_request_rows >= 1)]
        bad = [name for name, ok in checks if not ok]
        if bad:
            raise ConfigError(f"server settings out of range: {', '.join(bad)} (sizes and limits must be >= 1, "
                              f"max_wait_ms >= 0)")
        if self.max_queue_rows is not None and self.max_queue_rows < self.request_rows:
            raise ConfigError(f"max_queue_rows {self.max_queue_rows} is less than a request's rows "
                              f"({self.request_rows}): a full request could never be queued")
        if not self.allowed_hosts:
            raise ConfigError("allowed_hosts is empty: no request could be served (give '*' to allow any)")

    @property
    def request_rows(self) -> int:
        return self.max_batch_rows if self.max_request_rows is None else self.max_request_rows

    @property
    def queue_rows(self) -> int:
        return 4 * max(self.max_batch_rows, self.request_rows) if self.max_queue_rows is None else self.max_queue_rows


@dataclass
class Metrics:
    """Counters and the latencies of the last 10 000 requests (ms; latency: arrival to response)."""

    requests: int = 0
    rows: int = 0
    errors: int = 0
    batches: int = 0
    reloads: int = 0
    reload_errors: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)  # HTTP status -> count
    dropped: int = 0  # the client went away before its model call: never computed
    latency_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))
    parse_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))
    queue_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))
    model_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=10_000))

    def snapshot(self, model: ServingModel, queued_rows: int = 0) -> dict[str, Any]:
        def pct(d):
            if not d:
                return {"p50": None, "p99": None}
            a = np.fromiter(d, float)
            return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3)}

        return {"requests": self.requests, "rows": self.rows, "errors": self.errors, "batches": self.batches,
                "refused": {str(k): v for k, v in sorted(self.refused.items())}, "dropped": self.dropped,
                "queued_rows": queued_rows,
                "latency_ms": pct(self.latency_ms), "parse_ms": pct(self.parse_ms), "queue_ms": pct(self.queue_ms),
                "model_ms": pct(self.model_ms),
                "version": model.version, "deltas": list(model.served.deltas), "dtype": model.dtype,
                "reloads": self.reloads, "reload_errors": self.reload_errors,
                # objects frozen at start (freeze_loaded_heap) and the collections per generation since start
                "gc": {"frozen": gc.get_freeze_count(), "collections": [g["collections"] for g in gc.get_stats()]}}


class _HostCheck:
    """ASGI middleware: 400 unless the Host header names an allowed host (any port).  A page that
    rebinds its own DNS name to 127.0.0.1 sends its own name here, and is refused."""

    def __init__(self, app, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.any = "*" in allowed
        self.allowed = frozenset(h.strip().lower().rstrip(".").strip("[]") for h in allowed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket") and not self.any:
            raw = next((v for k, v in scope.get("headers", ()) if k == b"host"), None)
            name = host_name(raw.decode("latin-1")) if raw is not None else None
            if name not in self.allowed:
                from starlette.responses import PlainTextResponse

                shown = "no Host header" if raw is None else f"host {raw.decode('latin-1')[:80]!r}"
                await PlainTextResponse(f"{shown} is not served here (hugeembed serve --allow-host NAME)\n",
                                        status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def host_name(host: str) -> str:
    """The name of a Host header value, lower case, without port, brackets or a final dot."""
    h = host.strip().lower()
    if h.startswith("["):
        h = h[1: h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.split(":")[0]
    return h.rstrip(".")


def make_app(model: ServingModel, cfg: ServerConfig | None = None, parse: RequestParser | None = None):
    """The starlette application serving `model` (the batcher and the delta watcher start with it).

    `parse(body, content_type) -> ParsedRequest` reads request bodies (default: SchemaBodyParser,
    under the model's data schema); it runs off the event loop and may raise InputError (400), RequestTooLarge (413)
    or UnsupportedContentType (415)."""
    try:
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse, PlainTextResponse, Response
        from starlette.routing import Route
    except ImportError:
        raise ImportError("the server needs starlette and uvicorn: pip install 'hugeembed[serve]'") from None
    cfg = cfg or ServerConfig()
    metrics = Metrics()
    parse = parse or SchemaBodyParser(model.schema, model.features, model.num_dense, max_rows=cfg.request_rows)
    F, num_dense = len(model.features), model.num_dense
    parse_pool = ThreadPoolExecutor(1, thread_name_prefix="hugeembed-parse")

    def on_batch(requests: int, rows: int, queue_ms: list[float], model_ms: float) -> None:
        metrics.batches += 1
        metrics.queue_ms.extend(queue_ms)
        metrics.model_ms.append(model_ms)

    batcher = Batcher(model, max_batch_rows=cfg.max_batch_rows, max_queue_rows=cfg.queue_rows,
                      max_wait_ms=cfg.max_wait_ms, on_batch=on_batch)
    reloader = Reloader(model, metrics, watch_s=cfg.watch_s, token=cfg.admin_token)

    def refuse(status: int, reason: str, headers: dict[str, str] | None = None):
        metrics.errors += 1
        metrics.refused[status] += 1
        return PlainTextResponse(reason.splitlines()[0] + "\n", status_code=status, headers=headers)

    def parse_checked(body: bytes, content_type: str):
        return parse(body, content_type).check(F, num_dense)

    async def read_body(request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise RequestTooLarge(f"body of {declared} bytes, more than {cfg.max_body_bytes} (--max-body-bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise RequestTooLarge(f"body larger than {cfg.max_body_bytes} bytes (--max-body-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def client_gone(receive) -> None:
        """Returns when the client disconnects (the body is read: the next message is the disconnect)."""
        while (await receive())["type"] != "http.disconnect":
            pass

    async def answer(request, t0: float, cpu0: float):
        content_type = request.headers.get("content-type")
        media_type(content_type)  # 415 before the body is read
        body = await read_body(request)
        if len(body) <= _INLINE_PARSE_BYTES:
            parsed = parse_checked(body, content_type)
        else:
            parsed = await asyncio.get_running_loop().run_in_executor(parse_pool, parse_checked, body, content_type)
        parse_ms = (time.perf_counter() - t0) * 1000
        metrics.parse_ms.append(parse_ms)
        p = Pending(parsed, asyncio.get_running_loop().create_future())
        if not batcher.admit(p):
            return refuse(503, f"the queue holds {batcher.queued_rows} rows: try again shortly", {"Retry-After": "1"})
        gone = asyncio.ensure_future(client_gone(request.receive))
        try:
            await asyncio.wait((p.future, gone), return_when=asyncio.FIRST_COMPLETED)
            if not p.future.done():  # the client left: nobody reads the answer
                metrics.dropped += p.queued  # (one in a model call already is computed all the same)
                return Response(status_code=499)
            probs, version = p.future.result()
        finally:
            gone.cancel()
            if not p.future.done():
                batcher.abandon(p)
        metrics.rows += len(probs)
        metrics.latency_ms.append((time.perf_counter() - t0) * 1000)
        # the server's share of the latency (W3C Server-Timing): the rest is HTTP and the network.  app-cpu: the
        # event loop thread's CPU from arrival to here (with requests at once, theirs too): with model-cpu, whether
        # a slow request cost more CPU or waited (for a CPU, the interpreter lock, the other thread)
        timing = (f"parse;dur={parse_ms:.3f}, queue;dur={p.queue_ms:.3f}, model;dur={p.model_ms:.3f}, "
                  f"model-cpu;dur={p.model_cpu_ms:.3f}, app-cpu;dur={(time.thread_time() - cpu0) * 1000:.3f}")
        return JSONResponse({"predictions": probs, "version": version}, headers={"Server-Timing": timing})

    async def predict(request):
        t0, cpu0 = time.perf_counter(), time.thread_time()
        metrics.requests += 1
        try:
            return await asyncio.wait_for(answer(request, t0, cpu0), cfg.request_timeout_s)
        except UnsupportedContentType as e:
            return refuse(415, str(e))
        except RequestTooLarge as e:
            return refuse(413, str(e))
        except (InputError, NotImplementedError) as e:
            return refuse(400, str(e))
        except asyncio.TimeoutError:
            return refuse(504, f"no prediction within {cfg.request_timeout_s:g} s (--request-timeout)")
        except ClientDisconnect:
            metrics.dropped += 1
            return Response(status_code=499)
        except Exception as e:  # a bug, not a bad request
            return refuse(500, f"prediction failed: {type(e).__name__}: {e}")

    async def healthz(request):
        return JSONResponse(reloader.health())

    async def get_metrics(request):
        return JSONResponse(metrics.snapshot(model, batcher.queued_rows))

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
            batcher.close()
            parse_pool.shutdown(wait=False, cancel_futures=True)
            await reloader.stop()

    routes = [Route("/predict", predict, methods=["POST"]), Route("/healthz", healthz, methods=["GET"]),
              Route("/metrics", get_metrics, methods=["GET"]), Route("/reload", reload, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(_HostCheck, allowed=cfg.allowed_hosts)])


def freeze_loaded_heap() -> None:
    """Moves every object alive now (torch, the loaded model and its program, the app) out of the
    collector's reach, once, when a server process starts (`serve`, not make_app: a process that makes
    apps for a while, as the tests do, keeps its heap collectable).  A full collection walked them all:
    one request in ~1000 (64 rows, one client) took 150-230 ms of CPU more, 740-750 ms wall at load 14
    (gc.callbacks).  Versions built later (deltas) stay collectable; the base version's own cycles stay
    in memory once a delta replaces it (one program's graph objects; its weights are the base export's)."""
    if gc.get_freeze_count() == 0:
        gc.collect()  # the load's garbage is freed, not frozen
        gc.freeze()


def uvicorn_config(model: ServingModel, *, host: str = "127.0.0.1", port: int = 8080,
                   cfg: ServerConfig | None = None, log_level: str = "warning"):
    """The uvicorn settings `serve` runs with: the app, the address, limit_concurrency, a graceful shutdown."""
    try:
        import uvicorn
    except ImportError:
        raise ImportError("the server needs starlette and uvicorn: pip install 'hugeembed[serve]'") from None
    cfg = cfg or ServerConfig()
    return uvicorn.Config(make_app(model, cfg), host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=10, limit_concurrency=cfg.limit_concurrency)


def serve(model: ServingModel, *, host: str = "127.0.0.1", port: int = 8080, cfg: ServerConfig | None = None,
          log_level: str = "warning") -> None:
    """Runs the server until SIGINT/SIGTERM (uvicorn: stops accepting, finishes the requests in flight)."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(model, host=host, port=port, cfg=cfg, log_level=log_level))
    freeze_loaded_heap()
    server.run()
