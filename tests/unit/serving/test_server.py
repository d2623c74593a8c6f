"""`hugeembed serve` in a subprocess on 127.0.0.1, driven by httpx: both body formats, every bad request,
8 concurrent clients, a delta hot-swapped under load, and a graceful SIGTERM.  One server for the module."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hugeembed.data import CAT_NAMES, SyntheticConfig, SyntheticCriteo, format_criteo_lines, sparse_from_ids
from hugeembed.serving import ServingModel, export, export_delta

from .conftest import snapshot

pytestmark = pytest.mark.slow
ROWS = 16
NPAYLOADS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _payload(start: int):
    """(block, JSON body with raw Criteo hex ids, TSV lines with the label) of held-out-like rows."""
    gen = SyntheticCriteo(SyntheticConfig(max_cardinality=20000))
    at = 10**6 + start * ROWS
    blk = gen.rows(at, ROWS)
    hexed = {f: [[format(int(x), "x")] if x < (1 << 32) else [""] for x in blk.cats[:, j]]
             for j, f in enumerate(CAT_NAMES)}
    return blk, {"dense": blk.dense.tolist(), "sparse": hexed}, format_criteo_lines(gen.raw_rows(at, ROWS))


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    base = export(snapshot(run, 40), d / "served", dtype="fp32")
    staging = shutil.copytree(base, d / "staging")
    export_delta(run, staging)  # the increment pushed during the load test
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    (d / "token").write_text("admin-token\n")
    os.chmod(d / "token", 0o600)
    proc = subprocess.Popen([sys.executable, "-m", "hugeembed", "serve", str(base), "--port", str(port),
                             "--watch", "0.2", "--threads", "1", "--admin-token", str(d / "token")], env=env,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("server did not start: " + proc.stderr.read()[-2000:])
    old, new = ServingModel.load(base), ServingModel.load(staging)
    payloads = []
    for i in range(NPAYLOADS):
        blk, body, tsv = _payload(i)
        dense = torch.from_numpy(np.ascontiguousarray(blk.dense))
        sf = sparse_from_ids(torch.from_numpy(np.ascontiguousarray(blk.cats)))
        payloads.append((tsv, body, old.predict(dense, sf).tolist(), new.predict(dense, sf).tolist()))
    yield {"url": url, "proc": proc, "base": base, "staging": staging, "payloads": payloads}
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stderr.close()


def test_json_and_tsv_bodies_give_the_python_api_predictions(server):
    url = server["url"]
    for tsv, body, expected, _ in server["payloads"][:2]:
        r = httpx.post(url + "/predict", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["version"] == "step-000000040"
        np.testing.assert_allclose(r.json()["predictions"], expected, atol=1e-6, rtol=0)
        for label in (True, False):
            lines = tsv if label else b"".join(ln.split(b"\t", 1)[1] + b"\n" for ln in tsv.splitlines())
            r = httpx.post(url + "/predict", content=lines, headers={"content-type": "text/tab-separated-values"},
                           timeout=10)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["predictions"], expected, atol=1e-6, rtol=0)


BAD = [
    ("malformed JSON", b"{bad", "application/json", "malformed JSON"),
    ("dense row of 12", None, "application/json", "expected 13 numbers"),
    ("non-hex id", None, "application/json", "not a hex id of 1-8 digits: 'zz12'"),
    ("missing feature", None, "application/json", "lacks features ['C26']"),
    ("TSV of 38 fields", b"1\t2\t3\n", "text/tab-separated-values", "expected 40 tab-separated fields"),
    ("10 MB of garbage", bytes(np.random.default_rng(0).integers(0, 256, 10 << 20, dtype=np.uint8)),
     "application/json", "malformed JSON"),
    ("10 MB of garbage as TSV", b"\x01\x02" * (5 << 20), "text/tab-separated-values", "TSV line 1"),
    ("content type", b"x", "image/png", "content type 'image/png'"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_get_400_with_one_line_and_the_server_keeps_serving(server, case):
    name, raw, ctype, reason = case
    body = server["payloads"][0][1]
    if raw is None:
        body = json.loads(json.dumps(body))
        if name == "dense row of 12":
            body["dense"][3] = body["dense"][3][:12]
        elif name == "non-hex id":
            body["sparse"]["C7"][2] = ["zz12"]
        else:
            del body["sparse"]["C26"]
        raw = json.dumps(body).encode()
    r = httpx.post(server["url"] + "/predict", content=raw, headers={"content-type": ctype}, timeout=30)
    assert r.status_code == 400
    assert reason in r.text and r.text.count("\n") == 1, r.text[:300]
    assert httpx.post(server["url"] + "/predict", json=server["payloads"][0][1], timeout=10).status_code == 200


def _hammer(url, payloads, seconds, results, errors):
    with httpx.Client(timeout=10) as c:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            k = i % len(payloads)
            try:
                r = c.post(url + "/predict", json=payloads[k][1])
                results.append((k, r.status_code, r.json() if r.status_code == 200 else r.text))
            except Exception as e:  # a failed request is a test failure, counted below
                errors.append(repr(e))
            i += 1


def test_eight_concurrent_clients_get_their_single_request_predictions(server):
    results, errors = [], []
    threads = [threading.Thread(target=_hammer, args=(server["url"], server["payloads"], 1.5, results, errors))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results and all(s == 200 for _, s, _ in results)
    for k, _, body in results:
        np.testing.assert_allclose(body["predictions"], server["payloads"][k][2], atol=1e-6, rtol=0)
    m = httpx.get(server["url"] + "/metrics", timeout=5).json()
    assert m["batches"] < m["requests"]  # concurrent requests were batched together
    assert m["latency_ms"]["p99"] is not None and m["rows"] >= len(results) * ROWS


def test_a_delta_is_hot_swapped_under_load_with_no_failure_and_no_mix(server):
    results, errors = [], []
    threads = [threading.Thread(target=_hammer, args=(server["url"], server["payloads"], 3.0, results, errors))
               for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.8)
    deltas = server["base"] / "deltas"
    deltas.mkdir(exist_ok=True)
    shutil.copytree(server["staging"] / "deltas" / "step-000000160", deltas / ".incoming")
    os.rename(deltas / ".incoming", deltas / "step-000000160")  # appears whole; the watcher applies it
    for t in threads:
        t.join()
    assert not errors and all(s == 200 for _, s, _ in results)
    versions = [b["version"] for _, _, b in results]
    assert {"step-000000040", "step-000000160"} == set(versions)
    assert versions.index("step-000000160") > 0 and "step-000000040" not in versions[-50:]
    for k, _, body in results:
        want = server["payloads"][k][2 if body["version"] == "step-000000040" else 3]
        np.testing.assert_allclose(body["predictions"], want, atol=1e-6, rtol=0)
    m = httpx.get(server["url"] + "/metrics", timeout=5).json()
    assert m["version"] == "step-000000160" and m["deltas"] == ["step-000000160"] and m["reloads"] == 1
    r = httpx.post(server["url"] + "/reload", headers={"Authorization": "Bearer admin-token"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"version": "step-000000160", "applied": []}


def test_sigterm_finishes_the_requests_in_flight_then_exits(server):
    proc, results, errors = server["proc"], [], []
    threads = [threading.Thread(target=_hammer, args=(server["url"], server["payloads"], 1.0, results, errors))
               for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while not results and time.monotonic() < deadline:  # the clients are being served: now stop it
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join()
    # uvicorn finishes the requests in flight, then re-raises the signal it caught: the exit is by SIGTERM
    assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
    assert results and all(s == 200 for _, s, _ in results)  # every request answered was answered whole
    # requests sent after the signal are refused: a new connection is not accepted (ConnectError), or a
    # keep-alive one is closed (RemoteProtocolError: no response) or reset (ReadError / WriteError on a
    # loaded machine) before the server reads the request; never a timeout (a hang)
    refused = ("ConnectError", "RemoteProtocolError", "ReadError", "WriteError")
    assert all(any(k in e for k in refused) for e in errors), errors
    assert "Traceback" not in proc.stderr.read()
