"""Runs never eat each other's snapshots (issue 31, finding 4 and parts of 6): pruning removes only the
pruning run's snapshots, a save never replaces another run's step, a dangling LATEST is an error, steps
sort as numbers, a live process of another user keeps its temp directory, and the files a save creates
beside the snapshots (.lock, .LATEST.tmp-<pid>, a tier's .tier.json.<pid>) are never written through a
planted symbolic link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hugeembed import CheckpointError
from hugeembed.checkpoint import CheckpointLock, latest, list_snapshots, load, read_manifest, save
from hugeembed.errors import ConfigError
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adagrad

from .helpers import build


def _names(root: Path) -> list[str]:
    return [p.name for p in list_snapshots(root)]


def test_pruning_removes_only_the_snapshots_of_the_run_that_prunes(tmp_path):
    ec, *_ = build()
    for step in (100, 200, 300):  # another run's snapshots, all later by name than the fresh run's
        save(tmp_path, ec, step=step, run_id="first")
    for step in (1, 2, 3):
        newest = save(tmp_path, ec, step=step, keep=1, run_id="second")
        assert newest.is_dir()  # the snapshot just written survives its own save's pruning
    assert _names(tmp_path) == ["step-000000003", "step-000000100", "step-000000200", "step-000000300"]
    save(tmp_path, ec, step=400, keep=2, run_id="first")  # the first run prunes its own only
    assert _names(tmp_path) == ["step-000000003", "step-000000300", "step-000000400"]


def test_pruning_keeps_what_a_kept_delta_of_this_run_needs(tmp_path):
    ec, whole, opt, _ = build()
    save(tmp_path, ec, step=1, run_id="r")
    for step in (2, 3):
        save(tmp_path, ec, step=step, keep=1, delta=True, run_id="r")
    assert _names(tmp_path) == ["step-000000001", "step-000000002", "step-000000003"]  # the chain of step 3


def test_a_save_never_replaces_a_step_of_another_run(tmp_path):
    ec, *_ = build()
    theirs = save(tmp_path, ec, step=5, run_id="first")
    before = (theirs / "manifest.json").read_bytes()
    with pytest.raises(CheckpointError, match=r"step-000000005 was written by another run \(run first\)"):
        save(tmp_path, ec, step=5, run_id="second")
    assert (theirs / "manifest.json").read_bytes() == before
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".tmp-")]  # the refused save left nothing
    save(tmp_path, ec, step=5, run_id="first")  # the run itself may re-save its step


def test_a_dangling_latest_is_an_error_never_another_snapshot(tmp_path):
    ec, whole, opt, _ = build()
    save(tmp_path, ec, model=whole, dense_optimizer=opt, step=1)
    newest = save(tmp_path, ec, model=whole, dense_optimizer=opt, step=2)
    import shutil

    shutil.rmtree(newest)
    with pytest.raises(CheckpointError, match="LATEST names step-000000002, which is missing"):
        latest(tmp_path)
    with pytest.raises(CheckpointError, match="LATEST names step-000000002"):
        load(tmp_path, ec, model=whole)
    with pytest.raises(CheckpointError, match="LATEST names step-000000002"):
        read_manifest(tmp_path)  # what eval, export and inspect read first
    (tmp_path / "LATEST").unlink()  # no pointer at all (or a damaged one): the newest complete snapshot
    assert latest(tmp_path).name == "step-000000001"


def test_steps_sort_as_numbers_from_step_one_billion(tmp_path):
    ec, *_ = build()
    for step in (999_999_998, 999_999_999, 1_000_000_000):
        save(tmp_path, ec, step=step, keep=2)
    assert _names(tmp_path) == ["step-999999999", "step-1000000000"]
    assert latest(tmp_path).name == "step-1000000000"
    (tmp_path / "LATEST").unlink()
    assert latest(tmp_path).name == "step-1000000000"


@pytest.mark.parametrize("error,kept", [(PermissionError, True), (ProcessLookupError, False)])
def test_stale_temp_cleanup_keeps_a_live_process_of_another_user(tmp_path, monkeypatch, error, kept):
    ec, *_ = build()
    save(tmp_path, ec, step=1)
    others = [tmp_path / ".tmp-step-000000002-424242-0123abcd", tmp_path / ".tmp-old-step-000000002-424242-89abcdef"]
    for d in others:
        d.mkdir()

    def kill(pid, sig):  # 424242: a process of another user (EPERM), or none at all (ESRCH)
        if pid == 424242:
            raise error(pid)
        return real_kill(pid, sig)

    real_kill = os.kill
    monkeypatch.setattr(os, "kill", kill)
    save(tmp_path, ec, step=3)
    assert all(d.exists() == kept for d in others)


def test_lock_never_truncates_through_a_planted_link(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("do not touch\n")
    root = tmp_path / "ck"
    root.mkdir()
    (root / ".lock").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link"):
        CheckpointLock(root).acquire()
    assert outside.read_text() == "do not touch\n"


def test_latest_is_never_written_through_a_planted_link(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("do not touch\n")
    root = tmp_path / "ck"
    root.mkdir()
    (root / f".LATEST.tmp-{os.getpid()}").symlink_to(outside)  # the name a save writes LATEST through
    ec, *_ = build()
    save(root, ec, step=1)
    assert outside.read_text() == "do not touch\n"
    assert (root / "LATEST").read_text() == "step-000000001\n" and not (root / "LATEST").is_symlink()


def test_a_tier_json_is_never_written_through_a_planted_link(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("do not touch\n")
    table_dir = tmp_path / "tiers" / "t"  # a table's directory under its storage_dir
    table_dir.mkdir(parents=True)
    (table_dir / f".tier.json.{os.getpid()}").symlink_to(outside)  # the temp name the opening writes through
    ec = EmbeddingCollection([TableConfig("t", 4, storage_dir=str(tmp_path / "tiers"), memory_budget=1 << 20)],
                             optimizer=Adagrad(lr=0.1))
    assert outside.read_text() == "do not touch\n"
    assert (table_dir / "tier.json").is_file() and not (table_dir / "tier.json").is_symlink()
    del ec


@pytest.mark.parametrize("name", ["a/b", "../up", "..", "a\0b", ""])
def test_a_table_name_that_would_leave_the_snapshot_is_refused_when_the_config_is_built(name):
    with pytest.raises(ConfigError, match="table name must be"):
        TableConfig(name, dim=4)


def test_a_save_writes_only_inside_its_snapshot(tmp_path):
    # what a name with '/' did on 78baa67: the save wrote tables/../<x> and reported success
    ec = EmbeddingCollection([TableConfig("x", 4)], optimizer=Adagrad(lr=0.1))
    from hugeembed.features import SparseFeatures

    ec(SparseFeatures.from_lists({"x": [[1, 2], [3]]}))
    snap = save(tmp_path / "ck", ec, step=1)
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and snap not in p.parents
               and p.parent != tmp_path / "ck"]
    assert outside == [], outside
    assert torch.equal(ec.store("x").export().keys, torch.tensor([1, 2, 3]))
