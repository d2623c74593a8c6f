"""Deltas are data (issue 31, finding 1, and the manifests' paths of finding 6): nothing in deltas/ is ever
unpickled or executed -- at start-up, by the watcher, by POST /reload, by export --delta --, files not owned by
the server's user or writable by others are refused, so are symbolic links and paths outside the artifact,
a delta of another model structure, and with --delta-key an unsigned or altered delta."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import numpy as np
import httpx
import pytest
import torch

from hugeembed.cli import main
from hugeembed.errors import ArtifactError, ConfigError
from hugeembed.serving import ServingModel, export, export_delta
from hugeembed.serving import _trust
from hugeembed.serving._server import ServerConfig, make_app

from .conftest import snapshot
from .crafting import Payload, program_with_payload, record, rewrite, running

DELTA = "step-000000080"
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pristine(run, tmp_path_factory):
    """An fp32 artifact of step 40 with the delta to step 80."""
    art = export(snapshot(run, 40), tmp_path_factory.mktemp("trust") / "art", dtype="fp32")
    export_delta(snapshot(run, 80), art)
    return art


@pytest.fixture
def art(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "art", symlinks=True)


def _files(art):
    return json.loads((art / "deltas" / DELTA / "manifest.json").read_text())["files"]


def _make_old_format_delta(art, marker):
    """The delta as 78baa67 wrote it (its dense part a program.pt2), the program's first weight a payload pickle."""
    d = art / "deltas" / DELTA
    program_with_payload(art / "program.pt2", d / "program.pt2", marker)

    def old(m):
        del m["delta_format"], m["signed"]
        for k in [k for k in m["files"] if k.startswith("dense.")]:
            del m["files"][k]
        m["files"]["program"] = record(d, "program.pt2", array=False)

    rewrite(d, old)
    shutil.rmtree(d / "dense")




@pytest.mark.slow
def test_an_old_format_delta_carrying_code_never_runs_in_any_path(art, run, tmp_path):
    marker = tmp_path / "PAYLOAD-RAN"
    _make_old_format_delta(art, marker)

    started = ServingModel.load(art)  # start-up
    assert not marker.exists()
    assert started.version == "step-000000040" and started.refused.delta == DELTA
    assert "program (code" in started.refused.reason

    with pytest.raises(ArtifactError):  # an explicit reload
        started.reload()
    assert not marker.exists()

    model = ServingModel.load(art, apply_deltas=False)
    with running(make_app(model, ServerConfig(watch_s=0.05, admin_token=TOKEN))) as url, \
            httpx.Client(base_url=url, timeout=30) as client:  # the watcher, and POST /reload
        deadline = time.monotonic() + 20
        while client.get("/metrics").json()["reload_errors"] < 1:
            assert time.monotonic() < deadline, "the watcher never looked at the delta"
            time.sleep(0.05)
        r = client.post("/reload", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 409 and r.json()["refused"] == DELTA
        health = client.get("/healthz").json()
        assert health["status"] == "degraded" and health["refused"] == DELTA and "program" in health["reason"]
        assert health["version"] == "step-000000040"
    assert not marker.exists()

    assert main(["export", "--delta", "--checkpoint", str(run), "--out", str(art)]) == 0  # export --delta
    assert not marker.exists()

    # the control: what 78baa67 did with this delta (torch.export.load of its program) runs the payload
    with contextlib.suppress(Exception):  # torch fails on the weight after unpickling it
        torch.export.load(str(art / "deltas" / DELTA / "program.pt2"))
    assert marker.exists()


@pytest.mark.parametrize("kind", ["dense", "upsert_rows"])
@pytest.mark.slow
def test_a_pickled_array_in_a_delta_is_never_unpickled(art, tmp_path, kind):
    marker = tmp_path / "PAYLOAD-RAN"
    d = art / "deltas" / DELTA
    key = next(k for k in _files(art) if k.startswith(f"{kind}."))
    rel = _files(art)[key]["file"]
    np.save(d / rel, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    # the manifest keeps claiming its dtype and shape; its size and sha256 are recomputed
    rewrite(d, lambda m: m["files"][key].update({k: v for k, v in record(d, rel, array=False).items()
                                                 if k in ("bytes", "sha256")}))
    model = ServingModel.load(art)
    assert not marker.exists()
    assert model.version == "step-000000040" and model.refused.delta == DELTA
    assert "allow_pickle" in model.refused.reason or "unreadable" in model.refused.reason
    np.load(d / rel, allow_pickle=True)  # the control: a reader that unpickles runs the payload
    assert marker.exists()


def test_files_another_user_could_write_are_refused(art, monkeypatch):
    d = art / "deltas" / DELTA
    rows = next(d.glob("tables/*.upsert_rows.npy"))
    os.chmod(rows, 0o664)
    m = ServingModel.load(art)
    assert m.version == "step-000000040" and "writable by its group" in m.refused.reason
    os.chmod(rows, 0o644)
    os.chmod(art / "deltas", 0o757)
    m = ServingModel.load(art)
    assert m.version == "step-000000040" and m.refused.delta == "deltas/" and "writable by others" in m.refused.reason
    os.chmod(art / "deltas", 0o755)
    assert ServingModel.load(art).version == "step-000000080"
    os.chmod(art / "program.pt2", 0o646)  # the base artifact too: it is code
    with pytest.raises(ArtifactError, match="program.pt2 is writable by others"):
        ServingModel.load(art)
    os.chmod(art / "program.pt2", 0o644)
    base = ServingModel.load(art, apply_deltas=False)
    monkeypatch.setattr(_trust, "trusted_owners", lambda: {os.geteuid() + 4242})  # files of another user
    with pytest.raises(ArtifactError, match="owned by uid"):
        base.reload()
    with pytest.raises(ArtifactError, match="owned by uid"):
        ServingModel.load(art)


def test_symbolic_links_and_paths_outside_the_artifact_are_refused(art, tmp_path):
    d = art / "deltas" / DELTA
    key = next(k for k in _files(art) if k.startswith("upsert_rows."))
    rel = _files(art)[key]["file"]
    outside = shutil.copy(d / rel, tmp_path / "outside.npy")  # the same bytes: only where they are is wrong
    for where in (str(outside), "../../../outside.npy"):
        rewrite(d, lambda m: m["files"][key].update(file=where))
        m = ServingModel.load(art)
        assert m.version == "step-000000040" and "not a relative path inside" in m.refused.reason, where
    rewrite(d, lambda m: m["files"][key].update(file=rel))
    (d / rel).unlink()
    (d / rel).symlink_to(outside)
    m = ServingModel.load(art)
    assert m.version == "step-000000040" and "symbolic link" in m.refused.reason
    # the base artifact's manifest too
    base = json.loads((art / "manifest.json").read_text())
    base["files"]["rows.0"]["file"] = "../art/tables/g0.rows.npy"
    (art / "manifest.json").write_text(json.dumps(base))
    with pytest.raises(ArtifactError, match="not a relative path inside"):
        ServingModel.load(art)


def test_a_delta_of_another_model_structure_is_refused(art):
    d = art / "deltas" / DELTA
    key = next(k for k in _files(art) if k.startswith("dense.") and k.endswith(".bias"))
    rel = _files(art)[key]["file"]
    np.save(d / rel, np.zeros(np.load(d / rel).shape[0] + 1, dtype=np.float32))
    rewrite(d, lambda m: m["files"][key].update(record(d, rel)))
    m = ServingModel.load(art)
    assert m.version == "step-000000040" and "another model structure" in m.refused.reason
    np.save(d / rel, np.zeros(np.load(d / rel).shape[0] - 1, dtype=np.float32))
    np.save(d / "dense" / "extra.weight.npy", np.zeros(3, dtype=np.float32))

    def extra(m):
        m["files"][key].update(record(d, rel))
        m["files"]["dense.extra.weight"] = record(d, "dense/extra.weight.npy")

    rewrite(d, extra)
    m = ServingModel.load(art)
    assert m.version == "step-000000040" and "another model structure" in m.refused.reason


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "delta.key"
    path.write_bytes(os.urandom(32))
    os.chmod(path, 0o600)
    return path


@pytest.mark.slow
def test_with_a_delta_key_only_deltas_signed_with_it_apply(pristine, run, tmp_path, key_file):
    key = key_file.read_bytes()
    art = shutil.copytree(pristine, tmp_path / "signed")
    shutil.rmtree(art / "deltas")
    assert main(["export", "--delta", "--checkpoint", str(snapshot(run, 80)), "--out", str(art),
                 "--delta-key", str(key_file)]) == 0
    assert (art / "deltas" / DELTA / "manifest.sig").is_file()
    assert ServingModel.load(art, delta_key=key).version == "step-000000080"
    m = ServingModel.load(art, delta_key=os.urandom(32))
    assert m.version == "step-000000040" and "does not sign" in m.refused.reason
    rewrite(art / "deltas" / DELTA, lambda m: m.update(created_unix=0.0))  # altered after signing
    m = ServingModel.load(art, delta_key=key)
    assert m.version == "step-000000040" and "does not sign" in m.refused.reason
    unsigned = shutil.copytree(pristine, tmp_path / "unsigned")
    m = ServingModel.load(unsigned, delta_key=key)
    assert m.version == "step-000000040" and "not signed" in m.refused.reason
    assert ServingModel.load(unsigned).version == "step-000000080"  # no key: signatures are not asked for


def test_key_and_token_files_must_be_private(tmp_path, key_file, capsys, pristine):
    os.chmod(key_file, 0o644)
    with pytest.raises(ConfigError, match="readable or writable by others"):
        _trust.read_secret(key_file, "--delta-key")
    link = tmp_path / "link.key"
    link.symlink_to(key_file)
    with pytest.raises(ConfigError, match="symbolic link"):
        _trust.read_secret(link, "--delta-key")
    assert main(["serve", str(pristine), "--delta-key", str(key_file)]) == 2
    assert "--delta-key" in capsys.readouterr().err
