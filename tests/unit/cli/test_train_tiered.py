"""hugeembed train --memory-budget / --storage-dir: same numbers as in memory, figures reported,
a killed run resumes exactly, another run's directory is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from clihelp import ROOT, assert_one_line_error, run_cli

# Holds two batches of rows of every table but not the tables: rows of the default optimizer (Adam,
# per-row: weights + 2 D moments + a counter, 196 B at D = 16) need about 1 MiB for two batches here
BUDGET = "1100KiB"
BASE = ("train", "--steps", "24", "--batch-size", "128", "--eval-every", "8", "--eval-rows", "2048", "--quiet",
        "--synthetic-rows", "8192", "--seed", "3")


def summary(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    proc = run_cli(*BASE, "--summary-json", out, *extra, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # two whole CLI training runs
def test_a_tiered_run_equals_the_in_memory_run_and_reports_its_cache(tmp_path):
    mem = summary(tmp_path, "mem")
    tier = summary(tmp_path, "tier", "--memory-budget", BUDGET, "--storage-dir", tmp_path / "rows",
                   "--checkpoint-dir", tmp_path / "ck")
    for k in ("auc", "logloss", "copc", "final_train_loss", "history", "table_rows"):
        assert tier[k] == mem[k], k
    assert 0.0 < tier["cache_hit_rate"] < 1.0
    assert tier["table_bytes_stored"] > 0 and tier["table_bytes_resident"] > 0
    assert set(tier["tiers"]) == set(mem["table_rows_per_table"])
    assert "cache_hit_rate" not in mem
    shown = run_cli("inspect", tmp_path / "ck")
    assert shown.returncode == 0 and "tiered table" in shown.stdout and "hit rate" in shown.stdout, shown.stderr
    # a clean exit leaves no rows behind
    assert not list((tmp_path / "rows").glob("*/rows-*.bin")) and not list((tmp_path / "rows").glob("*/tier.json"))


@pytest.mark.slow
def test_kill_9_mid_training_then_resume_continues_exactly(tmp_path):
    args = [*BASE[:2], "40", *BASE[3:], "--memory-budget", BUDGET, "--checkpoint-every", "10"]
    ref = run_cli(*args, "--checkpoint-dir", tmp_path / "ck_ref", "--storage-dir", tmp_path / "rows_ref",
                  "--summary-json", tmp_path / "ref.json", timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    env_cmd = [sys.executable, "-m", "hugeembed", *map(str, args), "--checkpoint-dir", str(tmp_path / "ck"),
               "--storage-dir", str(tmp_path / "rows")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(env_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 200
        while time.time() < deadline and not list((tmp_path / "ck").glob("step-000000020")):
            time.sleep(0.05)
    finally:  # (also when the test is cut short: no run left behind for a later test to trip over)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list((tmp_path / "rows").glob("*/tier.json")), "the killed run left its tier behind"
    res = run_cli(*args, "--checkpoint-dir", tmp_path / "ck", "--storage-dir", tmp_path / "rows", "--resume",
                  "--summary-json", tmp_path / "res.json", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = json.loads((tmp_path / "ref.json").read_text()), json.loads((tmp_path / "res.json").read_text())
    for k in ("auc", "logloss", "copc", "table_rows"):
        assert a[k] == b[k], k


def test_another_runs_storage_dir_is_refused(tmp_path):
    d = tmp_path / "rows" / "C1"
    d.mkdir(parents=True)
    (d / "tier.json").write_text(json.dumps({"format": 1, "table": "C1", "layout": {"x": 1}, "owner": "other"}))
    proc = run_cli(*BASE, "--memory-budget", BUDGET, "--storage-dir", tmp_path / "rows")
    assert_one_line_error(proc, "storage directory", "another table layout")


@pytest.mark.parametrize("extra, fragment", [
    (("--memory-budget", "12XB", "--storage-dir", "x"), "is not a size"),
    (("--memory-budget", "1MiB"), "memory-budget and storage-dir go together"),
    (("--memory-budget", "1KiB", "--storage-dir", "x"), "cannot hold two batches of rows"),
    (("--memory-budget", "1MiB", "--storage-dir", "x", "--memory-per-rank", "1GiB"), "give one of them"),
])
def test_bad_tier_flags_are_one_line_errors(tmp_path, extra, fragment):
    proc = run_cli(*BASE, *extra, cwd=tmp_path)
    assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr[-2000:]
