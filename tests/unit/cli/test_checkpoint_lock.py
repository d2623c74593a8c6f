"""One writer per --checkpoint-dir: a second run is refused naming the holder's pid; a killed holder frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from clihelp import ROOT, assert_one_line_error, run_cli
from hugeembed.checkpoint import CheckpointLock
from hugeembed.errors import CheckpointError

FAST = ["--batch-size", "32", "--eval-rows", "64", "--threads", "1", "--synthetic-rows", "1000000",
        "--embedding-dim", "4", "--eval-every", "0", "--quiet"]


def test_lock_in_one_process_family(tmp_path):
    with CheckpointLock(tmp_path / "ck") as held:
        assert (tmp_path / "ck" / ".lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(CheckpointError, match=rf"in use by another run \(pid {os.getpid()} holds"):
            CheckpointLock(tmp_path / "ck").acquire()  # a second open file description: refused like another process
        assert held.held
    assert (tmp_path / "ck" / ".lock").read_text() == ""  # released: no stale pid
    CheckpointLock(tmp_path / "ck").acquire().release()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        CheckpointLock(tmp_path / "file").acquire()


@pytest.mark.slow
def test_a_second_run_on_one_checkpoint_dir_is_refused_and_a_killed_holder_frees_it(tmp_path):
    ck = tmp_path / "ck"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-m", "hugeembed", "train", "--steps", "1000000", "--checkpoint-dir",
                               str(ck), "--checkpoint-every", "1", "--keep-checkpoints", "1", *FAST],
                              env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while not (ck / "LATEST").exists():  # the holder is training and has saved a snapshot
            assert holder.poll() is None, holder.stderr.read()
            assert time.monotonic() < deadline, "the first run never saved a snapshot"
            time.sleep(0.2)
        second = run_cli("train", "--steps", "2", "--checkpoint-dir", ck, *FAST, cwd=tmp_path)
        assert_one_line_error(second, f"{ck} is in use by another run (pid {holder.pid}")
        assert holder.poll() is None  # the holder goes on undisturbed
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stderr.close()
    done = run_cli("train", "--steps", "2", "--checkpoint-dir", ck, "--overwrite", *FAST, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (ck / "LATEST").read_text().strip() == "step-000000002"
    assert (ck / ".lock").read_text() == ""
