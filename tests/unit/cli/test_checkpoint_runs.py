"""A fresh run never eats another run's snapshots (issue 31, finding 4), and the command line refuses what it
would misread (parts of finding 6): abbreviated flags, unknown config sections and keys."""

from __future__ import annotations

import json

import pytest

from clihelp import assert_one_line_error, run_cli
from hugeembed.cli import build_parser
from hugeembed.errors import ConfigError
from hugeembed.training import TrainConfig

FAST = ["--batch-size", "32", "--eval-rows", "64", "--threads", "1", "--synthetic-rows", "100000",
        "--embedding-dim", "4", "--eval-every", "0", "--quiet"]


def _snapshots(ck):
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))


@pytest.mark.slow
def test_a_fresh_run_into_a_used_checkpoint_dir_is_refused_unless_it_resumes_or_overwrites(tmp_path):
    ck = tmp_path / "ck"
    first = run_cli("train", "--steps", "4", "--checkpoint-dir", ck, "--checkpoint-every", "2", *FAST, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    theirs = _snapshots(ck)
    before = {n: (ck / n / "manifest.json").read_bytes() for n in theirs}

    # on 78baa67 this run exited 0 and its pruning deleted the snapshot it had just written
    fresh = run_cli("train", "--steps", "1", "--checkpoint-dir", ck, "--keep-checkpoints", "1", *FAST, cwd=tmp_path)
    assert fresh.returncode == 2 and _snapshots(ck) == theirs, (fresh.returncode, _snapshots(ck))
    run_id = json.loads((ck / theirs[-1] / "manifest.json").read_text())["run_id"]
    assert_one_line_error(fresh, str(ck), f"run {run_id}", "step-000000004", "--resume", "--overwrite")
    assert {n: (ck / n / "manifest.json").read_bytes() for n in _snapshots(ck)} == before  # nothing touched

    both = run_cli("train", "--steps", "1", "--checkpoint-dir", ck, "--resume", "--overwrite", *FAST, cwd=tmp_path)
    assert_one_line_error(both, "--resume", "--overwrite")

    over = run_cli("train", "--steps", "1", "--checkpoint-dir", ck, "--overwrite", *FAST[:-1], cwd=tmp_path)
    assert over.returncode == 0, over.stderr
    assert "deleted 2 snapshots of another run" in over.stdout + over.stderr
    assert _snapshots(ck) == ["step-000000001"] and (ck / "LATEST").read_text() == "step-000000001\n"
    assert json.loads((ck / "step-000000001" / "manifest.json").read_text())["run_id"] != run_id

    resumed = run_cli("train", "--steps", "2", "--checkpoint-dir", ck, "--resume", *FAST, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    ids = {json.loads((ck / n / "manifest.json").read_text())["run_id"] for n in _snapshots(ck)}
    assert len(ids) == 1  # a resume goes on under the id of the run it continues


def test_abbreviated_flags_are_errors():
    # on 78baa67, `train --npro 2` parsed as --nproc 2 and reached the launched processes, which all failed
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--npro", "2"])
    assert e.value.code == 2
    assert build_parser().parse_args(["train", "--nproc", "2"]).nproc == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "x", "--max-batch", "8"])


@pytest.mark.parametrize("toml,fragment", [
    ("[train]\nsteps = 2\n[trian]\nsteps = 5\n", "unknown section [trian] beside [train]"),
    ("[trian]\nsteps = 5\n", "unknown section [trian]"),
    ("steps = 2\n[model]\nname = 'dlrm'\n", "unknown section [model]"),
    ("stepz = 2\n", "unknown settings ['stepz']"),
    ("[train]\nstepz = 2\n", "unknown settings ['stepz']"),
    ("batch_size = 64\n[train]\nsteps = 2\n", "unknown key batch_size beside [train]"),
])
def test_an_unknown_config_section_or_key_is_an_error_naming_it(tmp_path, toml, fragment):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_toml(path)
    assert fragment in str(e.value) and str(path) in str(e.value)


def test_the_command_exits_2_on_an_unknown_config_section(tmp_path):
    (tmp_path / "run.toml").write_text("[train]\nsteps = 2\n[chekpoint]\nevery = 1\n")
    proc = run_cli("train", "--config", tmp_path / "run.toml", *FAST, cwd=tmp_path)
    assert_one_line_error(proc, "run.toml", "unknown section [chekpoint]")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # nothing trained, nothing written
