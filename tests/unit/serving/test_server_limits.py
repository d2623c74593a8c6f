"""The server's bounds, in a server run in this process (uvicorn on a thread, the real model): a full
queue gets 503 + Retry-After, a request past its time 504, and neither such a request nor one whose
client went away is ever computed; bodies and rows past the limits 413, other content types 415, a
foreign Host header 400, and fuzzed bodies 400, never 500.  The model call is held at a gate (the
real call runs once the test opens it), so what waits in the queue is known exactly."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hugeembed.data import CAT_NAMES, SyntheticConfig, SyntheticCriteo, format_criteo_lines
from hugeembed.serving import ServingModel
from hugeembed.serving._server import ServerConfig, uvicorn_config


def _rows(n: int, start: int = 0):
    gen = SyntheticCriteo(SyntheticConfig(max_cardinality=20000))
    blk = gen.rows(5 * 10**6 + start, n)
    body = {"dense": blk.dense.tolist(), "sparse": {f: [[int(x)] for x in blk.cats[:, j]] for j, f in enumerate(CAT_NAMES)}}
    return body, format_criteo_lines(gen.raw_rows(5 * 10**6 + start, n))


class _Gate:
    """Holds every model call until opened; counts the rows computed."""

    def __init__(self, model: ServingModel) -> None:
        self.open, self.rows, self.calls = threading.Event(), 0, 0
        real = model.logits_raw

        def gated(dense, values, offsets, served=None):
            self.calls += 1
            assert self.open.wait(30), "the test never opened the gate"
            self.rows += int(dense.shape[0])
            return real(dense, values, offsets, served)

        model.logits_raw = gated


@pytest.fixture(scope="module")
def model(artifacts):
    return artifacts("fp32")


@contextlib.contextmanager
def _serving(artifact, cfg: ServerConfig, gate: bool = False):
    import uvicorn

    m = ServingModel.load(artifact)  # its own instance: the gate patches it
    g = _Gate(m) if gate else None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(m, port=port, cfg=cfg))  # the settings `hugeembed serve` runs with
    if g is not None:
        g.server = server
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield url, g
    finally:
        if g is not None:
            g.open.set()
        server.should_exit = True
        thread.join(30)


def _metrics(url):
    return httpx.get(url + "/metrics", timeout=10).json()


def _wait_for(cond, what: str, seconds: float = 20):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _post_async(url, body, out: list, **kw):
    def go():
        try:
            out.append(httpx.post(url + "/predict", json=body, timeout=60, **kw))
        except httpx.HTTPError as e:
            out.append(e)

    t = threading.Thread(target=go)
    t.start()
    return t


def test_a_full_queue_answers_503_with_retry_after_and_the_admitted_requests_finish(model):
    body, _ = _rows(16)
    cfg = ServerConfig(watch_s=0, max_batch_rows=16, max_queue_rows=32)
    with _serving(model, cfg, gate=True) as (url, gate):
        out: list = []
        threads = [_post_async(url, body, out)]
        _wait_for(lambda: gate.calls == 1, "the first request's model call")
        threads += [_post_async(url, body, out) for _ in range(2)]
        _wait_for(lambda: _metrics(url)["queued_rows"] == 32, "two queued requests")
        r = httpx.post(url + "/predict", json=body, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "queue holds 32 rows" in r.text
        gate.open.set()
        for t in threads:
            t.join()
        assert [x.status_code for x in out] == [200] * 3
        assert gate.rows == 48 and _metrics(url)["refused"] == {"503": 1}


def test_a_request_past_its_timeout_gets_504_and_is_never_computed(model):
    body, _ = _rows(8)
    cfg = ServerConfig(watch_s=0, max_batch_rows=8, request_timeout_s=0.5)
    with _serving(model, cfg, gate=True) as (url, gate):
        first: list = []
        t = _post_async(url, body, first)
        _wait_for(lambda: gate.calls == 1, "the first request's model call")
        r = httpx.post(url + "/predict", json=body, timeout=10)  # queued behind the held call
        assert r.status_code == 504 and "no prediction within 0.5 s" in r.text
        t.join()
        assert first[0].status_code == 504  # held in its model call past its time
        gate.open.set()
        _wait_for(lambda: gate.rows == 8, "the held call")
        assert httpx.post(url + "/predict", json=body, timeout=10).status_code == 200
        assert gate.rows == 16 and gate.calls == 2  # the timed-out, queued request never reached the model


def test_a_request_whose_client_left_is_dropped_before_its_model_call(model):
    body, _ = _rows(8)
    raw = json.dumps(body).encode()
    cfg = ServerConfig(watch_s=0, max_batch_rows=8)
    with _serving(model, cfg, gate=True) as (url, gate):
        first: list = []
        t = _post_async(url, body, first)
        _wait_for(lambda: gate.calls == 1, "the first request's model call")
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:  # sends a whole request, then leaves
            s.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
            _wait_for(lambda: _metrics(url)["queued_rows"] == 8, "the second request in the queue")
        _wait_for(lambda: _metrics(url)["dropped"] == 1, "the server to see the client leave")
        assert _metrics(url)["queued_rows"] == 0
        gate.open.set()
        t.join()
        assert first[0].status_code == 200
        assert httpx.post(url + "/predict", json=body, timeout=10).status_code == 200
        assert gate.rows == 16 and gate.calls == 2


def test_connections_past_limit_concurrency_get_503(model):
    body, _ = _rows(4)
    # uvicorn refuses a request when the connections, its own counted, reach the limit: 3 lets two in
    with _serving(model, ServerConfig(watch_s=0, limit_concurrency=3), gate=True) as (url, gate):
        out: list = []
        threads = [_post_async(url, body, out)]
        _wait_for(lambda: gate.calls == 1, "the first request's model call")
        threads.append(_post_async(url, body, out))  # the second connection: queued
        _wait_for(lambda: len(gate.server.server_state.connections) == 2, "the second connection")
        r = httpx.post(url + "/predict", json=body, timeout=10)  # a third at once: refused by uvicorn
        assert r.status_code == 503
        gate.open.set()
        for t in threads:
            t.join()
        assert [x.status_code for x in out] == [200, 200]


def test_bodies_and_rows_past_the_limits_get_413(model):
    body, tsv = _rows(5)
    raw = json.dumps(body).encode()
    cfg = ServerConfig(watch_s=0, max_batch_rows=64, max_request_rows=4, max_body_bytes=len(raw) + 10)
    with _serving(model, cfg) as (url, _):
        r = httpx.post(url + "/predict", content=raw + b" " * 11, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "--max-body-bytes" in r.text

        def chunks():  # no Content-Length: the server counts what arrives
            for _ in range(3):
                yield raw

        r = httpx.post(url + "/predict", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        for content, ctype in ((raw, "application/json"), (tsv, "text/tab-separated-values"),
                               (tsv.replace(b"\t", b","), "text/csv")):
            r = httpx.post(url + "/predict", content=content, headers={"content-type": ctype})
            assert r.status_code == 413 and "more than 4 rows" in r.text, r.text
        small, _ = _rows(4)
        assert httpx.post(url + "/predict", json=small).status_code == 200
        assert _metrics(url)["refused"] == {"413": 5}


def test_content_types_and_host_names(model):
    body, tsv = _rows(3)
    raw = json.dumps(body).encode()
    with _serving(model, ServerConfig(watch_s=0)) as (url, _):
        want = httpx.post(url + "/predict", json=body).json()["predictions"]
        for content, ctype in ((tsv, "text/tab-separated-values"), (tsv.replace(b"\t", b","), "text/csv; charset=utf-8")):
            r = httpx.post(url + "/predict", content=content, headers={"content-type": ctype})
            np.testing.assert_allclose(r.json()["predictions"], want, atol=1e-6)
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "text/tsv"):
            assert httpx.post(url + "/predict", content=raw, headers={"content-type": ctype}).status_code == 415
        assert httpx.post(url + "/predict", content=raw).status_code == 415  # none given
        port = url.rsplit(":", 1)[1]
        for host, status in ((f"localhost:{port}", 200), ("127.0.0.1", 200), (f"[::1]:{port}", 200),
                             ("LOCALHOST.", 200), ("attacker.example", 400), (f"attacker.example:{port}", 400),
                             ("127.0.0.1.attacker.example", 400)):
            r = httpx.post(url + "/predict", json=body, headers={"host": host})
            assert r.status_code == status, (host, r.text)
        assert httpx.get(url + "/healthz", headers={"host": "attacker.example"}).status_code == 400
    with _serving(model, ServerConfig(watch_s=0, allowed_hosts=("*",))) as (url, _):
        assert httpx.post(url + "/predict", json=body, headers={"host": "anything.example"}).status_code == 200


_FUZZ = st.one_of(st.binary(max_size=300),
                  st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                         st.text(max_size=4)),
                               lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                                   st.sampled_from(["dense", "sparse", "C1", "x"]), inner, max_size=4),
                               max_leaves=12).map(lambda v: json.dumps(v).encode()))


def test_fuzzed_bodies_get_400_never_a_server_error(model):
    with _serving(model, ServerConfig(watch_s=0)) as (url, _), httpx.Client(timeout=30) as c:
        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_FUZZ, st.sampled_from(["application/json", "text/tab-separated-values", "text/csv"]))
        def post(body, ctype):
            r = c.post(url + "/predict", content=body, headers={"content-type": ctype})
            assert r.status_code == 400 and r.text.count("\n") == 1, (body[:80], r.status_code, r.text[:200])

        post()
        assert c.get(url + "/healthz").status_code == 200


def test_serve_refuses_abbreviated_flags(capsys):
    from hugeembed.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "nowhere", "--max-b", "8"])  # --max-batch-rows? --max-body-bytes? neither
    assert e.value.code == 2 and "--max-b" in capsys.readouterr().err
