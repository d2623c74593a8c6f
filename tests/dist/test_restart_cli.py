"""A run restarted on another number of processes (2 -> 3) from its snapshot ends where the uninterrupted run does."""

from __future__ import annotations

import json

import pytest

from hugeembed.training import TrainConfig, Trainer
from tests.unit.cli.clihelp import run_cli

from .test_train_cli import PER_PROCESS, toml

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # two training runs of several processes


def _train(tmp_path, nproc: int, batch: int, name: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = ["train", "--nproc", str(nproc), "--config", str(tmp_path / "run.toml"),
           "--batch-size", str(batch), "--checkpoint-dir", str(tmp_path / "ck"), "--summary-json", str(out), "--quiet",
           *flags]
    done = run_cli(*cmd, timeout=300, cwd=tmp_path)  # the launcher and its ranks forked from the tests' zygote
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def test_a_two_process_run_resumed_on_three_reaches_the_uninterrupted_runs_auc(tmp_path):
    (tmp_path / "run.toml").write_text(toml(PER_PROCESS))  # constant rates: 6 steps of a 12-step run are 6 steps
    first = _train(tmp_path, 2, 96, "first", "--steps", "6")  # stopped after its snapshot of step 6
    resumed = _train(tmp_path, 3, 64, "resumed", "--steps", "12", "--resume")  # the same global batch of 192
    # the uninterrupted run: one process on the same global batches (N processes train its model: test_train_cli)
    whole = Trainer(TrainConfig(**{**PER_PROCESS, "batch_size": 192})).fit()
    assert first["world_size"] == 2 and resumed["world_size"] == 3
    assert resumed["steps"] == whole["steps"] == 12 and resumed["samples"] == whole["samples"]
    assert resumed["auc"] == pytest.approx(whole["auc"], abs=1e-3)
    assert resumed["logloss"] == pytest.approx(whole["logloss"], abs=1e-3)
