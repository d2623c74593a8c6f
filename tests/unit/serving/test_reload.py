"""Deltas that fail change nothing and stop nothing (issue 31, finding 2; the reload parts of 1 and 3): watching
is opt-in and POST /reload needs the admin token; any error of a reload is caught, counted in /metrics and
shown in /healthz while the last good version serves on and the watcher goes on; at start the longest valid
prefix of the chain is served; reloads run on a thread of their own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hugeembed.cli import build_parser
from hugeembed.serving import ServingModel, export, export_delta
from hugeembed.serving import _model
from hugeembed.serving._server import ServerConfig, make_app

from .conftest import snapshot
from .crafting import rewrite, running

TOKEN = "tok-" + "x" * 20
AUTH = {"Authorization": f"Bearer {TOKEN}"}
D80, D160 = "step-000000080", "step-000000160"


@pytest.fixture(scope="module")
def pristine(run, tmp_path_factory):
    """An fp32 artifact of step 40 with its deltas to step 80 and 160."""
    art = export(snapshot(run, 40), tmp_path_factory.mktemp("reload") / "art", dtype="fp32")
    export_delta(snapshot(run, 80), art)
    export_delta(run, art)
    return art


@pytest.fixture
def art(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "art")


def _wait(client, predicate, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not predicate(client.get("/metrics").json()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _predict(client, model):
    body = {"dense": [[0.5] * model.num_dense], "sparse": {f: [[1, 2]] for f in model.features}}
    r = client.post("/predict", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_watching_is_off_by_default_and_reload_needs_the_admin_token(art, tmp_path):
    assert ServerConfig().watch_s == 0 and build_parser().parse_args(["serve", "x"]).watch == 0
    staged = shutil.move(art / "deltas", tmp_path / "staged")
    model = ServingModel.load(art)
    with running(make_app(model, ServerConfig())) as url, httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/reload", headers=AUTH)
        assert r.status_code == 403 and "--admin-token" in r.text  # no token given: reloads from the network are off
    (art / "deltas").mkdir()
    shutil.move(Path(staged) / D80, art / "deltas" / D80)
    with running(make_app(model, ServerConfig(admin_token=TOKEN))) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        time.sleep(0.5)
        assert client.get("/healthz").json() == {"status": "ok", "version": "step-000000040"}  # nobody watches
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = client.post("/reload", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.get("/healthz").json()["version"] == "step-000000040"
        r = client.post("/reload", headers=AUTH)
        assert r.status_code == 200 and r.json() == {"version": D80, "applied": [D80]}


@pytest.mark.parametrize("injury", ["bug", "crafted"])
def test_any_reload_error_is_caught_counted_and_shown_and_the_watcher_goes_on(art, monkeypatch, injury):
    model = ServingModel.load(art, apply_deltas=False)
    threads: list[str] = []
    if injury == "bug":  # an error that is not an ArtifactError, from deep inside the apply
        real = _model.version_program

        def broken(*args, **kwargs):
            threads.append(threading.current_thread().name)
            raise RuntimeError("boom")

        monkeypatch.setattr(_model, "version_program", broken)
    else:  # a manifest whose tables are not a list (on 78baa67: an AttributeError that ended the watcher)
        original = (art / "deltas" / D80 / "manifest.json").read_bytes()
        rewrite(art / "deltas" / D80, lambda m: m.update(tables={"C1": 1}))
    with running(make_app(model, ServerConfig(watch_s=0.05, admin_token=TOKEN))) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        _wait(client, lambda m: m["reload_errors"] >= 1, "the failed reload was never counted")
        health = client.get("/healthz").json()
        assert health["status"] == "degraded" and health["version"] == "step-000000040"
        assert health["refused"] == D80 and ("RuntimeError: boom" if injury == "bug" else "tables") in health["reason"]
        assert _predict(client, model)["version"] == "step-000000040"  # the last good version serves on
        time.sleep(0.3)
        assert client.get("/metrics").json()["reload_errors"] == 1  # the same refusal is counted once
        if injury == "bug":
            monkeypatch.setattr(_model, "version_program", real)
            os.utime(art / "deltas" / D80 / "manifest.json", ns=(1, 1))  # changed since it was refused: read again
        else:
            # whole at once (os.replace), as a publisher writes: the watcher polls every 50 ms and a torn read
            # would be a second refusal
            fixed = art / "deltas" / D80 / "manifest.json.new"
            fixed.write_bytes(original)
            os.replace(fixed, art / "deltas" / D80 / "manifest.json")
        _wait(client, lambda m: m["version"] == D160, "the watcher stopped after the error")
        assert client.get("/healthz").json() == {"status": "ok", "version": D160}
        m = client.get("/metrics").json()
        assert m["reloads"] == 2 and m["reload_errors"] == 1 and m["deltas"] == [D80, D160]
    if injury == "bug":  # the reload ran on the reload thread, not on the model calls' executor
        assert threads and all(t.startswith("hugeembed-reload") for t in threads)


@pytest.mark.slow
def test_serve_starts_on_the_longest_valid_prefix_and_says_which_delta_it_refused(art):
    rows = next((art / "deltas" / D160 / "tables").glob("*.upsert_rows.npy"))
    data = bytearray(rows.read_bytes())
    data[-1] ^= 0x55
    rows.write_bytes(bytes(data))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hugeembed", "serve", str(art), "--port", str(port),
                             "--threads", "1"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not any(line.startswith("serving") for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)  # on 78baa67: the server did not start (exit 2)
            lines.append(line)
        assert f"delta {D160} refused" in lines[0] and "is damaged" in lines[0] and "serving step-000000080" in lines[0]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for _ in range(300):
                try:
                    health = client.get("/healthz").json()
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert health["status"] == "degraded" and health["version"] == D80 and health["refused"] == D160
            assert client.get("/metrics").json()["reload_errors"] == 1
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
