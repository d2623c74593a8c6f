"""`hugeembed train` runs on the edges: small files, short runs, finished runs, --eval-data without --data,
and damaged run records in snapshots."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from clihelp import assert_one_line_error, run_cli
from hugeembed import checkpoint as ckpt
from hugeembed.checkpoint._files import write_bytes
from hugeembed.data import SyntheticConfig, write_criteo_tsv
from hugeembed.errors import CheckpointError
from hugeembed.training import TrainConfig, Trainer, evaluate_snapshot
from tests.unit.damage import set_field

FAST = ["--batch-size", "64", "--eval-rows", "128", "--threads", "1", "--synthetic-rows", "20000", "--embedding-dim",
        "4"]
# on the CPU: these compare runs bit for bit, and CUDA's atomic adds sum in no fixed order
SMALL = dict(batch_size=64, eval_rows=128, synthetic_max_cardinality=2000, threads=1, embedding_dim=4, eval_every=0,
             device="cpu")


def tree_bytes(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_small_file_holds_out_a_fraction_and_says_so(tmp_path):
    write_criteo_tsv(tmp_path / "small.tsv", 400, config=SyntheticConfig(seed=1, max_cardinality=500))
    proc = run_cli("train", "--data", tmp_path / "small.tsv", "--batch-size", "64", "--steps", "3", "--quiet",
                   "--eval-every", "0", "--threads", "1", "--summary-json", tmp_path / "s.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # 400 rows = 6 batches of 64 (16 dropped): 5% of 6 -> at least one batch held out, 5 left to train on
    assert proc.stderr.count("\n") == 1 and "holding out the first 64 rows" in proc.stderr
    assert "training on the other 320" in proc.stderr and "--eval-rows 32768" in proc.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["count"] == 64 and s["steps"] == 3


def test_a_file_too_small_to_split_names_the_cause_and_the_flags(tmp_path):
    write_criteo_tsv(tmp_path / "tiny.tsv", 100, config=SyntheticConfig(seed=1, max_cardinality=500))
    proc = run_cli("train", "--data", tmp_path / "tiny.tsv", "--batch-size", "64", "--steps", "3", cwd=tmp_path)
    assert_one_line_error(proc, "tiny.tsv", "64 usable rows", "--batch-size", "--eval-data")


def test_small_shards_hold_out_a_fraction_too(tmp_path):
    from hugeembed.data import convert

    write_criteo_tsv(tmp_path / "d.tsv", 1000, config=SyntheticConfig(seed=1, max_cardinality=500))
    convert(tmp_path / "d.tsv", tmp_path / "shards", rows_per_shard=300)
    notes = []
    t = Trainer(TrainConfig(data=(str(tmp_path / "shards"),), steps=None, eval_fraction=0.2,
                            **{**SMALL, "eval_rows": 32768}),
                progress=lambda e, i: notes.append(i["message"]) if e == "note" else None)
    s = t.fit()
    assert t.source.holdout == 3 and s["steps"] == 15 - 3 and s["count"] == 3 * 64  # 1000 rows = 15 batches
    assert len(notes) == 1 and "holding out the first 192 rows" in notes[0]


def test_eval_data_without_data_is_refused(tmp_path):
    write_criteo_tsv(tmp_path / "e.tsv", 10)
    assert_one_line_error(run_cli("train", "--eval-data", tmp_path / "e.tsv", "--steps", "1", cwd=tmp_path),
                          "eval-data needs data")


def test_a_short_run_has_a_curve_ending_at_its_last_step():
    per_step = Trainer(TrainConfig(steps=6, log_every=1, **SMALL)).fit()  # oracle: every step recorded
    assert per_step["history"]["step"] == [1, 2, 3, 4, 5, 6]
    s = Trainer(TrainConfig(steps=6, **SMALL)).fit()  # default log_every=10
    assert s["history"]["step"] == [1, 2, 3, 4, 5, 6] and s["history"]["loss"] == per_step["history"]["loss"]
    assert s["final_train_loss"] == per_step["history"]["loss"][-1]
    # 101 steps recording every 2nd: points average two steps, and the curve still ends at step 101
    s = Trainer(TrainConfig(steps=101, log_every=2, **{**SMALL, "batch_size": 8})).fit()
    every = Trainer(TrainConfig(steps=101, log_every=1, **{**SMALL, "batch_size": 8})).fit()["history"]["loss"]
    assert s["history"]["step"] == [1, *range(2, 101, 2), 101]
    assert s["history"]["loss"][-2] == pytest.approx((every[98] + every[99]) / 2, rel=1e-9)
    assert s["final_train_loss"] == pytest.approx(every[100], rel=1e-9)


def test_long_runs_record_every_log_every_steps():
    assert Trainer(TrainConfig(steps=5000, log_every=10, **SMALL))._record_every == 10
    assert Trainer(TrainConfig(steps=200, log_every=10, **SMALL))._record_every == 4


@pytest.mark.slow
def test_resuming_a_finished_run_changes_nothing(tmp_path):
    ck = tmp_path / "ck"
    args = ["train", "--steps", "4", "--eval-every", "2", "--checkpoint-dir", ck, "--quiet", *FAST]
    assert run_cli(*args, cwd=tmp_path).returncode == 0
    before = tree_bytes(ck)
    proc = run_cli(*args, "--resume", "--summary-json", tmp_path / "s.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "the run is complete (step 4 of 4)" in proc.stderr and proc.stderr.count("\n") == 1
    assert tree_bytes(ck) == before
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["history"]["eval_step"] == [2, 4] and s["steps"] == 4


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    ck = tmp_path_factory.mktemp("rec") / "ck"
    Trainer(TrainConfig(steps=2, checkpoint_dir=str(ck), **SMALL)).fit()
    return ck


def _damage_extra(ck, change):
    """Rewrites the snapshot's extra.pt with `change` applied (checksums updated: a consistent but bad record)."""
    snap = ckpt.latest(ck)
    extra = torch.load(snap / "extra.pt", weights_only=True)
    extra = change(extra)
    import io
    buf = io.BytesIO()
    torch.save(extra, buf)
    manifest = json.loads((snap / "manifest.json").read_text())
    manifest["files"]["extra"] = write_bytes(snap / "extra.pt", buf.getvalue())
    (snap / "manifest.json").write_text(json.dumps(manifest))




@pytest.mark.parametrize("change,fragment", [
    (lambda e: [1, 2], "holds no training config"),
    (set_field(["config"], None), "config must be a mapping"),
    (set_field(["config", "batch_size"], "x"), "batch-size must be a positive integer"),
    (set_field(["train_state"], KeyError), "no train_state"),
    (set_field(["train_state", "step"], "3"), "train_state.step must be a non-negative integer"),
    (set_field(["train_state", "history"], None), "train_state.history must be"),
    (set_field(["train_state", "history", "loss"], [1.0, "x"]), "train_state.history.loss must be a list of numbers"),
    (set_field(["train_state", "last_eval"], [0.5]), "train_state.last_eval must be"),
    (set_field(["train_state", "samples"], KeyError), "missing fields ['samples']"),
    (set_field(["world_size"], 0), "world_size must be a positive integer"),
])
def test_a_damaged_run_record_is_a_checkpoint_error(saved_run, tmp_path, change, fragment):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(saved_run, ck)
    _damage_extra(ck, change)
    snap = str(ckpt.latest(ck))
    with pytest.raises(CheckpointError) as e:
        Trainer(TrainConfig(steps=4, checkpoint_dir=str(ck), resume=True, **SMALL)).fit()
    assert fragment in str(e.value) and snap in str(e.value), str(e.value)
    with pytest.raises(CheckpointError, match="step-000000002"):
        evaluate_snapshot(ck)
