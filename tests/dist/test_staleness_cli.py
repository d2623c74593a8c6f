"""`hugeembed train --nproc 2 --staleness 2`: snapshots drain the pipeline, so --resume continues exactly."""

from __future__ import annotations

import json

import pytest

from tests.unit.cli.clihelp import run_cli

from .test_train_cli import PER_PROCESS, toml

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _train(tmp_path, name: str, *flags: str, kd: tuple[int, int] = (2, 2)) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = ["train", "--nproc", "2", "--config", str(tmp_path / "run.toml"),
           "--staleness", str(kd[0]), "--dense-staleness", str(kd[1]), "--summary-json", str(out), "--quiet", *flags]
    done = run_cli(*cmd, timeout=240, cwd=tmp_path)  # the launcher and its ranks forked from the tests' zygote
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


# (3, 1): the data-parallel tables read 1 step stale (the dense delay), the others 3; with DC-ASGD too
_REPLICAS = ("--shard", "C6=data_parallel", "--shard", "C9=data_parallel")


@pytest.mark.parametrize("kd, shard", [((2, 2), ()), ((3, 1), _REPLICAS),
                                       ((3, 1), (*_REPLICAS, "--stale-compensation", "50"))])
def test_a_staleness_run_resumed_from_its_snapshot_equals_the_uninterrupted_run(tmp_path, kd, shard):
    (tmp_path / "run.toml").write_text(toml(PER_PROCESS))
    whole = _train(tmp_path, "whole", "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "6", *shard,
                   kd=kd)
    _train(tmp_path, "first", "--checkpoint-dir", str(tmp_path / "b"), "--steps", "6", *shard, kd=kd)
    resumed = _train(tmp_path, "resumed", "--checkpoint-dir", str(tmp_path / "b"), "--checkpoint-every", "6",
                     "--resume", *shard, kd=kd)
    assert whole["steps"] == resumed["steps"] == 12
    # bit for bit: the same figures to the last digit, the same rows admitted
    assert resumed["auc"] == whole["auc"] and resumed["logloss"] == whole["logloss"]
    assert resumed["table_rows"] == whole["table_rows"]
    assert resumed["history"]["loss"][-1] == whole["history"]["loss"][-1]
    # where the time went: no jitter, no sleep; the waits are part of the training time
    assert whole["jitter_sleep_s"] == 0.0 and 0.0 <= whole["wait_rows_s"] + whole["wait_dense_s"] <= whole["train_seconds"]
