"""hugeembed train --memory-budget / --storage-dir: same numbers as in memory, figures reported,
a killed run resumes exactly, another run's directory is refused."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from clihelp import assert_one_line_error, run_cli
from tests._zygote import Child, child_env, run_command

# Holds two batches of rows of every table but not the tables: rows of the default optimizer (Adam,
# per-row: weights + 2 D moments + a counter, 196 B at D = 16) need about 1 MiB for two batches here
BUDGET = "1100KiB"
# One tiered run of 24 steps (fewer write no row to disk), snapshots every 8, is shared by the two slow tests
# below: the in-memory run's twin, and the reference of the run killed after its snapshot of step 16 (not a run
# of 40 steps killed at 20 of its own); a tiered step costs ~0.5-1 s here, an in-memory one ~30 ms
STEPS, EVERY = 24, 8
TIERED = ("--memory-budget", BUDGET, "--checkpoint-every", str(EVERY))
BASE = ("train", "--steps", str(STEPS), "--batch-size", "128", "--eval-every", "8", "--eval-rows", "2048", "--quiet",
        "--synthetic-rows", "8192", "--seed", "3")


def summary(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    proc = run_cli(*BASE, "--summary-json", out, *extra, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    """(directory, summary) of the tiered run: checkpoints in <d>/ck, rows in <d>/rows."""
    d = tmp_path_factory.mktemp("tier")
    return d, summary(d, "tier", *TIERED, "--storage-dir", d / "rows", "--checkpoint-dir", d / "ck")


@pytest.mark.slow  # two whole CLI training runs
def test_a_tiered_run_equals_the_in_memory_run_and_reports_its_cache(tmp_path, tier):
    d, tier = tier
    # the same snapshots as the tiered run: only where the rows live differs
    mem = summary(tmp_path, "mem", "--checkpoint-every", str(EVERY), "--checkpoint-dir", tmp_path / "ck")
    for k in ("auc", "logloss", "copc", "final_train_loss", "history", "table_rows"):
        assert tier[k] == mem[k], k
    assert 0.0 < tier["cache_hit_rate"] < 1.0
    assert tier["table_bytes_stored"] > 0 and tier["table_bytes_resident"] > 0
    assert set(tier["tiers"]) == set(mem["table_rows_per_table"])
    assert "cache_hit_rate" not in mem
    shown = run_cli("inspect", d / "ck")
    assert shown.returncode == 0 and "tiered table" in shown.stdout and "hit rate" in shown.stdout, shown.stderr
    # a clean exit leaves no rows behind
    assert not list((d / "rows").glob("*/rows-*.bin")) and not list((d / "rows").glob("*/tier.json"))


@pytest.mark.slow
def test_kill_9_mid_training_then_resume_continues_exactly(tmp_path, tier):
    args = [*TIERED, "--checkpoint-dir", str(tmp_path / "ck"), "--storage-dir", str(tmp_path / "rows")]
    # a process of its own, forked from the tests' zygote (tests/_zygote.py): SIGKILLed as any process is
    proc = Child(run_command, ([*map(str, BASE), *args], None, os.devnull, None, child_env(), None))
    try:
        deadline = time.time() + 200
        while time.time() < deadline and not list((tmp_path / "ck").glob(f"step-{STEPS - EVERY:09d}")):
            time.sleep(0.05)
    finally:  # (also when the test is cut short: no run left behind for a later test to trip over)
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert list((tmp_path / "rows").glob("*/tier.json")), "the killed run left its tier behind"
    b = summary(tmp_path, "res", *args, "--resume")
    a = tier[1]
    assert b["steps"] == a["steps"] == STEPS
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
