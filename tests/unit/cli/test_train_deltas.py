"""`hugeembed train --full-checkpoint-every K`: deltas between full snapshots, a resume from a delta that equals
the uninterrupted run bit for bit, an evaluation of a delta that reproduces the run's, and the option's checks."""

from __future__ import annotations

import json

import pytest
import torch

from clihelp import run_cli
from hugeembed import checkpoint as ckpt
from hugeembed.cli import main
from hugeembed.training import RunRecord, build_model, evaluate_snapshot

# constant learning rates: the 6-step run that is resumed to 10 steps stands for a 10-step run that
# stopped at step 6, which it is only when the rates do not follow the run's length (--lr-decay)
FAST = ["--batch-size", "64", "--eval-rows", "128", "--threads", "1", "--synthetic-rows", "20000", "--embedding-dim",
        "4", "--eval-every", "0", "--checkpoint-every", "2", "--full-checkpoint-every", "3", "--lr-decay", "0"]


def _kinds(ck) -> dict[int, str]:
    return {ckpt.read_manifest(p)["step"]: ckpt.read_manifest(p)["kind"] for p in ckpt.list_snapshots(ck)}


def _final_state(ck):
    """The newest snapshot loaded into a model built from its own run record: (tables, dense state)."""
    snap = ckpt.latest(ck)
    cfg = RunRecord.from_dict(ckpt.read_extra(snap), str(snap)).config
    model, _ = build_model(cfg, torch.device("cpu"))
    ckpt.load(snap, model.embeddings, model=model, restore_rng=False)
    tables = {c.name: s.export() for c, s in model.embeddings.stores()}
    return tables, {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}


@pytest.mark.slow
def test_deltas_between_full_snapshots_and_a_resume_from_a_delta(tmp_path):
    whole = run_cli("train", "--steps", "10", "--checkpoint-dir", tmp_path / "whole", "--quiet", "--summary-json",
                    tmp_path / "whole.json", *FAST, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    ck = tmp_path / "ck"
    first = run_cli("train", "--steps", "6", "--checkpoint-dir", ck, *FAST, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"snapshot {ck / 'step-000000004'} (delta)" in first.stderr
    # the final save re-writes step 6 with the same parent: still a delta
    assert _kinds(ck) == {2: "full", 4: "delta", 6: "delta"}
    resumed = run_cli("train", "--steps", "10", "--checkpoint-dir", ck, "--resume", "--quiet", "--summary-json",
                      tmp_path / "resumed.json", *FAST, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    # --keep-checkpoints 3 keeps 6, 8, 10 and what they need: 2 and 4 (6's chain), 8 (10's)
    assert _kinds(ck) == _kinds(tmp_path / "whole") == {2: "full", 4: "delta", 6: "delta", 8: "full", 10: "delta"}

    tw, dw = _final_state(tmp_path / "whole")
    tr, dr = _final_state(ck)
    for name in tw:
        for f in ("keys", "rows", "counts", "last_step", "pending_keys"):
            assert torch.equal(getattr(tw[name], f), getattr(tr[name], f)), (name, f)
    assert dw.keys() == dr.keys() and all(torch.equal(dw[k], dr[k]) for k in dw)
    sw, sr = (json.loads((tmp_path / f).read_text()) for f in ("whole.json", "resumed.json"))
    assert sw["history"]["loss"] == sr["history"]["loss"] and sw["auc"] == sr["auc"]
    again = evaluate_snapshot(ck)  # a delta scored again: its chain loads as the run ended
    assert again["step"] == 10 and again["auc"] == sr["auc"] and again["logloss"] == sr["logloss"]


def test_full_checkpoint_every_must_be_positive(capsys):
    assert main(["train", "--full-checkpoint-every", "0", "--steps", "1"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "full-checkpoint-every must be a positive integer, got 0" in err, err


def test_inspect_describes_a_delta_as_written(tmp_path, capsys):
    from tests.unit.checkpoint.delta_helpers import make, seeded_ids, step

    ec = make("adagrad", cap=20)
    for s in range(3):
        step(ec, seeded_ids(s))
    ckpt.save(tmp_path, ec)
    ec.evict(max_rows=1)
    step(ec, seeded_ids(3))
    m = ckpt.read_manifest(ckpt.save(tmp_path, ec, delta=True))
    assert main(["inspect", str(tmp_path), "--json", str(tmp_path / "i.json")]) == 0
    out, _ = capsys.readouterr()
    assert "delta 1 of the chain from the full snapshot step-000000003, parent step-000000003" in out
    desc = json.loads((tmp_path / "i.json").read_text())
    assert desc["kind"] == "delta" and desc["base"] == "step-000000003" and desc["depth"] == 1
    written = {t["name"]: (t["shards"][0]["rows"], t["shards"][0]["removed"]) for t in m["tables"]}
    assert {t["name"]: (t["rows"], t["removed"]) for t in desc["tables"]} == written
    assert written["ttl"][1] > 0  # the eviction shows

