"""Artifact deltas: a base export plus deltas serves exactly what a full export of the newest snapshot does;
deltas apply in chain order only, and a refused or damaged one changes nothing (the longest valid prefix of
the chain is served)."""

from __future__ import annotations

import shutil

import pytest
import torch

from hugeembed.cli import main
from hugeembed.errors import ArtifactError, ConfigError
from hugeembed.serving._index import is_serving_index
from hugeembed.serving import ServingModel, export, export_delta
from hugeembed.serving import _lookup_ops, _runtime
from hugeembed.serving._patch import effective_rows

from .conftest import snapshot


@pytest.fixture(scope="module")
def chained(run, tmp_path_factory):
    """dtype -> an artifact of step 40 with deltas to step 80 and to the newest (160)."""
    out = tmp_path_factory.mktemp("chained")
    made = {}
    for dtype in ("fp32", "int8"):
        art = export(snapshot(run, 40), out / dtype, dtype=dtype)
        export_delta(snapshot(run, 80), art)
        export_delta(run, art)
        made[dtype] = art
    return made


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
@pytest.mark.slow
def test_base_plus_deltas_equals_the_full_export(chained, artifacts, heldout, dtype, path, monkeypatch):
    if path == "torch":  # the lookups' torch twins (the patched one's and the base op's), as an artifact's runtime.py
        # runs them: on the artifact's own key index (hugeembed's private one is read by its kernels only)
        monkeypatch.setattr(_lookup_ops, "bags_accelerator", None)
        monkeypatch.setattr(_lookup_ops, "find_accelerator", None)
        monkeypatch.setattr(_lookup_ops, "pool_accelerator", None)
        monkeypatch.setattr(_runtime, "index_builder", None)
    m = ServingModel.load(chained[dtype])
    assert m.version == "step-000000160" and m.served.deltas == ("step-000000080", "step-000000160")
    patches = [p for p in m.served.patch if p is not None]
    assert patches and all(is_serving_index(p.index) == (path == "kernels") for p in patches)  # keyed like the base
    full = ServingModel.load(artifacts(dtype))
    for b in heldout[1][:3]:
        torch.testing.assert_close(m.predict(b.dense, b.sparse), full.predict(b.dense, b.sparse), atol=0, rtol=0)
    # the tables themselves: every id either version holds (and so every id the deltas removed) reads the
    # same stored row, the base's untouched (only the rows the deltas changed live beside it)
    base = ServingModel.load(chained[dtype], apply_deltas=False)
    for g, group in enumerate(m.manifest["groups"]):
        for t in range(len(group["tables"])):
            if group["table_keys"][t] < 0:
                ids = torch.arange(group["table_rows"][t] + 3)  # static: its rows and a few beyond
            else:
                held = [v.served.tables.keys[g][int(v.served.tables.meta[g][t, 2]):][:int(v.served.tables.meta[g][t, 1])]
                        for v in (full, base)]
                ids = torch.cat([*held, torch.tensor([10**15])]).unique()
            got = effective_rows(m.served.tables, m.served.patch, g, t, ids)
            want = effective_rows(full.served.tables, (None,) * len(m.manifest["groups"]), g, t, ids)
            assert torch.equal(got, want), (group["tables"][t], dtype)
    assert all(torch.equal(a, b) for a, b in zip(m.served.tables.rows, base.served.tables.rows))


def test_reload_applies_only_what_follows_in_order(chained, run, tmp_path):
    art = shutil.copytree(chained["fp32"], tmp_path / "a")
    later = tmp_path / "later"
    shutil.move(art / "deltas" / "step-000000160", later)
    m = ServingModel.load(art)
    assert m.version == "step-000000080"
    assert m.reload() == []  # nothing new
    shutil.move(later, art / "deltas" / "step-000000160")
    assert m.reload() == ["step-000000160"] and m.version == "step-000000160"


def test_a_delta_that_does_not_follow_is_refused_and_changes_nothing(chained, tmp_path):
    art = shutil.copytree(chained["fp32"], tmp_path / "a")
    base = ServingModel.load(art, apply_deltas=False)
    before = base.served
    with pytest.raises(ArtifactError, match="follows step-000000080, the model serves step-000000040"):
        base.apply_delta(art / "deltas" / "step-000000160")
    assert base.served is before
    assert base.apply_delta(art / "deltas" / "step-000000080") == "step-000000080"


@pytest.mark.slow
def test_a_damaged_delta_is_refused_and_the_served_version_kept(chained, tmp_path):
    art = shutil.copytree(chained["int8"], tmp_path / "a")
    rows = next((art / "deltas" / "step-000000160" / "tables").glob("C3.upsert_rows.npy"))
    data = bytearray(rows.read_bytes())
    data[-1] ^= 0x55
    rows.write_bytes(bytes(data))
    started = ServingModel.load(art)  # serves the longest valid prefix, and says which delta it refused
    assert started.version == "step-000000080" and started.refused.delta == "step-000000160"
    assert "C3.upsert_rows.npy is damaged" in started.refused.reason
    m = ServingModel.load(art, apply_deltas=False)
    with pytest.raises(ArtifactError, match="step-000000160 refused.*C3.upsert_rows.npy is damaged"):
        m.reload()
    assert m.version == "step-000000080"  # the good delta before it was applied, the damaged one not
    assert m.refusals == 1
    with pytest.raises(ArtifactError):
        m.reload()  # refused again, unchanged: not read again, not counted twice
    assert m.refusals == 1 and m.version == "step-000000080"
    data[-1] ^= 0x55  # repaired: the next reload applies it
    rows.write_bytes(bytes(data))
    assert m.reload() == ["step-000000160"] and m.refused is None


@pytest.mark.slow
def test_export_delta_refusals(chained, run, tmp_path, capsys):
    with pytest.raises(ConfigError, match="already serves step-000000160"):
        export_delta(run, chained["fp32"])
    art = export(run, tmp_path / "new", dtype="fp16")
    assert main(["export", "--delta", "--checkpoint", str(snapshot(run, 120)), "--out", str(art)]) == 2
    assert "not after the served step-000000160" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_export_delta(run, tmp_path, capsys):
    art = tmp_path / "a"
    assert main(["export", "--checkpoint", str(snapshot(run, 120)), "--out", str(art), "--dtype", "int4"]) == 0
    assert main(["export", "--delta", "--checkpoint", str(run), "--out", str(art)]) == 0
    assert "exported delta" in capsys.readouterr().out
    assert ServingModel.load(art).version == "step-000000160"
