"""Garbage given to the real `hugeembed` command: every case exits 2 with one line on stderr and no traceback,
naming the file; nothing is written."""

from __future__ import annotations

import json
import os

import pytest

from clihelp import assert_one_line_error, run_cli
from hugeembed.data import SyntheticConfig, convert, write_criteo_tsv


@pytest.fixture
def junk(tmp_path):
    (tmp_path / "junk.bin").write_bytes(bytes(range(256)) * 8 + b"\x00\n\xff")
    (tmp_path / "empty.tsv").write_bytes(b"")
    (tmp_path / "adir").mkdir()
    (tmp_path / "junk.toml").write_bytes(b"\x00\x01\x02 = = [")
    return tmp_path


Q = ["--steps", "1", "--quiet", "--threads", "1"]
CASES = [
    (["train", "--data", "junk.bin", *Q], ["junk.bin:1", "tab-separated fields"]),
    (["train", "--data", "empty.tsv", *Q], ["empty.tsv", "0 usable rows"]),
    (["train", "--data", "adir", *Q], ["adir", "not a converted shard directory"]),
    (["train", "--config", "junk.toml", *Q], ["junk.toml", "not valid TOML"]),
    (["train", "--config", "junk.bin", *Q], ["junk.bin", "not valid TOML"]),
    (["train", "--config", "adir", *Q], ["adir", "is a directory"]),
    (["train", "--checkpoint-dir", "junk.bin", *Q], ["junk.bin", "is a file, not a directory"]),
    (["train", "--summary-json", "adir", *Q], ["--summary-json adir is a directory"]),
    (["train", "--plot", "junk.bin/x.png", *Q], ["--plot", "junk.bin is a file"]),
    (["eval", "--checkpoint", "junk.bin"], ["junk.bin holds no complete snapshot"]),
    (["eval", "--checkpoint", "empty.tsv"], ["empty.tsv holds no complete snapshot"]),
    (["eval", "--checkpoint", "adir"], ["adir holds no complete snapshot"]),
    (["inspect", "junk.bin"], ["junk.bin holds no complete snapshot"]),
    (["inspect", "adir", "--json", "adir"], ["--json adir is a directory"]),
    (["convert", "empty.tsv", "--out", "o", "--no-progress"], ["empty.tsv: no rows to convert (no lines)"]),
    (["convert", "junk.bin", "--out", "o", "--no-progress", "--skip-bad-lines"],
     ["junk.bin: no rows to convert (all 10 line(s) malformed and skipped)"]),
    (["convert", "adir", "--out", "o", "--no-progress"], ["adir", "is a directory"]),
]


@pytest.mark.parametrize("argv,fragments", CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
@pytest.mark.slow
def test_garbage_is_one_line_exit_2(junk, argv, fragments):
    before = sorted(os.listdir(junk))
    assert_one_line_error(run_cli(*argv, cwd=junk), *fragments)
    assert sorted(os.listdir(junk)) == before  # nothing written (no half output, no snapshot dir)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fz")
    write_criteo_tsv(d / "d.tsv", 600, config=SyntheticConfig(seed=5, max_cardinality=300))
    convert(d / "d.tsv", d / "shards", rows_per_shard=300)
    return d / "shards"


def test_training_on_a_shard_with_a_flipped_byte_is_refused(shard_dir, tmp_path):
    import shutil

    shutil.copytree(shard_dir, tmp_path / "s")
    f = tmp_path / "s" / "part-00001.labels.npy"
    data = bytearray(f.read_bytes())
    data[-10] = 254  # what a flipped bit in a label looks like
    f.write_bytes(bytes(data))
    proc = run_cli("train", "--data", tmp_path / "s", "--batch-size", "32", "--eval-rows", "64", "--steps", "12",
                   "--quiet", "--threads", "1", "--embedding-dim", "4", cwd=tmp_path)
    assert_one_line_error(proc, "part-00001.labels.npy: checksum mismatch")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    proc = run_cli("train", "--steps", "1", "--batch-size", "32", "--eval-rows", "32", "--synthetic-rows", "2000",
                   "--embedding-dim", "4", "--threads", "1", "--quiet", "--checkpoint-dir", d / "ck", cwd=d)
    assert proc.returncode == 0, proc.stderr
    return d / "ck"


@pytest.mark.slow
def test_nothing_to_score_is_an_error_not_nan_metrics(trained, junk, shard_dir):
    assert_one_line_error(run_cli("eval", "--checkpoint", trained, "--data", "empty.tsv", cwd=junk),
                          "empty.tsv: no rows to score")
    proc = run_cli("train", "--data", shard_dir, "--eval-data", "empty.tsv", "--batch-size", "32", "--steps", "2",
                   "--quiet", "--threads", "1", "--embedding-dim", "4", cwd=junk)
    assert_one_line_error(proc, "empty.tsv: no held-out rows to evaluate on")


def test_eval_of_a_snapshot_with_a_damaged_manifest(trained, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    path = ck / "step-000000001" / "manifest.json"
    m = json.loads(path.read_text())
    del m["tables"][3]["shards"][0]["rows"]
    path.write_text(json.dumps(m))
    for argv in (["eval", "--checkpoint", ck], ["inspect", ck]):
        assert_one_line_error(run_cli(*argv, cwd=tmp_path), str(path), "table 'C4' shards[0].rows is missing")
