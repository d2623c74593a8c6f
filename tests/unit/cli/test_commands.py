"""train / eval / inspect / bench run in-process: happy paths and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hugeembed.cli import main
from hugeembed.optim import make_optimizer
from hugeembed.training import TrainConfig

FAST = ["--batch-size", "128", "--eval-rows", "512", "--threads", "2", "--synthetic-rows", "100000"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    rc = main(["train", "--steps", "12", "--eval-every", "6", "--checkpoint-dir", str(d / "ck"), "--summary-json",
               str(d / "s.json"), "--plot", str(d / "curves.png"), "--model", "widedeep", *FAST])
    assert rc == 0
    return d


def test_train_happy_path_writes_summary_json_plot_and_snapshot(trained, capsys):
    summary = json.loads((trained / "s.json").read_text())
    assert summary["steps"] == 12 and summary["model"] == "widedeep"
    for key in ("auc", "logloss", "ctr", "pctr", "copc", "samples_per_s", "table_rows", "table_bytes"):
        assert key in summary
    assert (trained / "curves.png").stat().st_size > 1000
    assert (trained / "ck" / "step-000000012" / "manifest.json").exists()


def test_train_prints_a_summary_table(tmp_path, capsys):
    assert main(["train", "--steps", "3", "--eval-every", "0", "--quiet", *FAST]) == 0
    out, err = capsys.readouterr()
    assert "held-out AUC" in out and "samples/s (training)" in out and "COPC" in out and err == ""


def test_eval_reproduces_the_final_metrics(trained, capsys):
    summary = json.loads((trained / "s.json").read_text())
    assert main(["eval", "--checkpoint", str(trained / "ck"), "--summary-json", str(trained / "e.json")]) == 0
    got = json.loads((trained / "e.json").read_text())
    assert got["auc"] == summary["auc"] and got["logloss"] == summary["logloss"] and got["step"] == 12


def test_eval_on_files(trained, tmp_path, capsys):
    from hugeembed.data import SyntheticConfig, write_criteo_tsv

    write_criteo_tsv(tmp_path / "test.tsv", 700, config=SyntheticConfig(seed=0, max_cardinality=1000))
    assert main(["eval", "--checkpoint", str(trained / "ck"), "--data", str(tmp_path / "test.tsv")]) == 0
    out, _ = capsys.readouterr()
    assert "rows scored  700" in out


def test_resume_continues(trained, capsys):
    assert main(["train", "--steps", "14", "--eval-every", "0", "--checkpoint-dir", str(trained / "ck"),
                 "--resume", "--model", "widedeep", "--quiet", *FAST]) == 0
    out, _ = capsys.readouterr()
    assert "steps                           14" in out


def test_inspect(trained, tmp_path, capsys):
    assert main(["inspect", str(trained / "ck"), "--json", str(tmp_path / "i.json"), "--histogram",
                 str(tmp_path / "h.png")]) == 0
    out, _ = capsys.readouterr()
    rule = make_optimizer(TrainConfig().sparse_optimizer, lr=1.0).name  # the run's (default) sparse optimizer
    assert "C26" in out and "rows by number of hits" in out and rule in out
    desc = json.loads((tmp_path / "i.json").read_text())
    assert len(desc["tables"]) == 52  # widedeep: 26 embedding + 26 wide tables
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_bench_runs_the_scripts_it_finds(tmp_path, capsys):
    (tmp_path / "lookup.py").write_text("import sys\nprint('ratio 1.5x', '--quick' in sys.argv)\n")
    assert main(["bench", "lookup", "--quick", "--bench-dir", str(tmp_path)]) == 0
    (tmp_path / "tables.py").write_text("raise SystemExit(3)\n")
    assert main(["bench", "tables", "--bench-dir", str(tmp_path)]) == 1


@pytest.mark.parametrize("argv,message", [
    (["train", "--steps", "0"], "steps must be a positive integer, got 0"),
    (["train", "--data", "/no/such/file.tsv"], "/no/such/file.tsv"),
    (["train", "--resume"], "--resume needs --checkpoint-dir"),
    (["train", "--config", "/no/such.toml"], "config file /no/such.toml does not exist"),
    (["eval", "--checkpoint", "/no/such/dir"], "no checkpoint at /no/such/dir"),
    (["inspect", "/no/such/dir"], "no checkpoint at /no/such/dir"),
    (["bench", "nope"], "unknown benchmark 'nope'"),
    (["train", "--shard", "C3=row_wise"], "with one process they would be ignored"),
    (["train", "--nproc", "2", "--shard", "C3=row_wise", "--shard", "C3=data_parallel"], "'C3' is placed twice"),
    (["train", "--staleness", "2"], "with one process they would be ignored"),
    (["train", "--nproc", "2", "--staleness", "-1"], "staleness must be a non-negative integer, got -1"),
    (["train", "--jitter", "0.2"], "jitter must be P:F"),
    (["train", "--jitter", "1.5:3"], "jitter must be P:F"),
    (["train", "--jitter", "0.2:0.5"], "jitter must be P:F"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("hugeembed ") and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_unreadable_data_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_text("not\ta\tcriteo\tfile\n" * 3)
    assert main(["train", "--data", str(bad), "--steps", "2", "--quiet", *FAST]) == 2
    _, err = capsys.readouterr()
    assert "bad.tsv:1" in err and err.count("\n") == 1


@pytest.mark.slow
def test_bad_flag_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "hugeembed", "train", "--model", "gpt"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'gpt'" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "hugeembed", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("hugeembed ")
