"""`hugeembed train --nproc 2 --data-queue` on shards of uneven sizes, with staleness, resumed on 3 processes."""

from __future__ import annotations

import json

import pytest

from hugeembed import checkpoint as ckpt
from hugeembed.data import SyntheticConfig, convert, write_criteo_tsv

from tests.unit.cli.clihelp import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # whole training runs of several processes


def _train(tmp_path, nproc: int, name: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = ["train", "--nproc", str(nproc), "--data", str(tmp_path / "shards"),
           "--eval-data", str(tmp_path / "eval.tsv"), "--data-queue", "300", "--epochs", "2", "--embedding-dim", "4",
           "--threads", "1", "--lr-decay", "0", "--eval-every", "0", "--dist-timeout", "60", "--summary-json", str(out),
           "--quiet", "--checkpoint-dir", str(tmp_path / "ck"), *flags]
    done = run_cli(*cmd, timeout=300, cwd=tmp_path)  # the launcher and its ranks forked from the tests' zygote
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def test_uneven_shards_through_the_queue_with_staleness_resume_on_three_processes(tmp_path):
    config = SyntheticConfig(seed=3, max_cardinality=2000)
    write_criteo_tsv(tmp_path / "train.tsv", 2300, config=config)
    write_criteo_tsv(tmp_path / "eval.tsv", 512, config=config, start=10_000)
    convert(tmp_path / "train.tsv", tmp_path / "shards", rows_per_shard=1000)  # shards of 1000, 1000 and 300 rows
    # 2 processes x 128 rows, staleness 2: stopped after 6 steps (a snapshot there), mid-epoch
    first = _train(tmp_path, 2, "first", "--batch-size", "128", "--staleness", "2", "--dense-staleness", "2",
                   "--steps", "6")
    assert first["steps"] == 6 and first["samples"] == 6 * 2 * 128  # no rank ran out yet
    state = ckpt.read_extra(ckpt.latest(tmp_path / "ck"))["train_state"]["data_queue"]
    assert state["epoch"] == 0 and sum(b - a for a, b in state["ranges"]) == 2300 - 6 * 2 * 128
    # resumed on 3 processes x 100 rows, staleness 1: the rest of epoch 0, then epoch 1, every row once per epoch
    # (ranks that run out at an epoch's end train empty batches through the pipeline)
    rest = _train(tmp_path, 3, "rest", "--batch-size", "100", "--staleness", "1", "--resume")
    assert rest["samples"] == 2 * 2300 and rest["epochs"] == 2
    assert 0.55 < rest["auc"] < 1.0  # it learned (synthetic data of a known model)
