"""``hugeembed convert`` run in-process: happy path, summary, one-line errors with exit code 2."""

from __future__ import annotations

import re

import pytest

from hugeembed.cli import main
from hugeembed.data import ShardSet, SyntheticConfig, read_criteo, write_criteo_tsv

CFG = SyntheticConfig(seed=2, max_cardinality=1000)


@pytest.fixture
def tsv(tmp_path):
    write_criteo_tsv(tmp_path / "a.txt.gz", 1500, config=CFG)
    write_criteo_tsv(tmp_path / "b.txt", 700, config=CFG, start=1500)
    return tmp_path


def test_happy_path(tsv, capsys):
    rc = main(["convert", str(tsv / "a.txt.gz"), str(tsv / "b.txt"), "--out", str(tsv / "out"),
               "--rows-per-shard", "1000"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "converted 2,200 rows into 3 shard(s)" in out and "0 malformed line(s) skipped" in out and "MB/s" in out
    assert re.search(r"100(\.0)?%", err)  # the progress reached the end (tqdm's bar, or the plain line without tqdm)
    assert ShardSet(tsv / "out").read_all().equals(read_criteo([tsv / "a.txt.gz", tsv / "b.txt"]))


def test_skip_bad_lines(tsv, capsys):
    with open(tsv / "b.txt", "a") as f:
        f.write("1\tnot\ta\tcriteo\tline\n")
    assert main(["convert", str(tsv / "b.txt"), "--out", str(tsv / "out"), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().count("\n") == 0 and "b.txt:701: expected 40 tab-separated fields" in err
    assert err.startswith("hugeembed convert: error: ") and not (tsv / "out").exists()
    assert main(["convert", str(tsv / "b.txt"), "--out", str(tsv / "out"), "--skip-bad-lines", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "converted 700 rows" in out and "1 malformed line(s) skipped" in out and "b.txt:701: wrong field count" in out
    assert err == ""


@pytest.mark.parametrize("args,message", [
    (["missing.txt", "--out", "o"], "no such file: "),
    (["a.txt.gz", "--out", "exists"], "output exists"),
])
def test_run_errors_are_one_line_with_exit_code_2(tsv, capsys, args, message):
    (tsv / "exists").mkdir()
    rc = main(["convert", *[str(tsv / a) if a not in ("--out",) else a for a in args], "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("hugeembed convert: error: ") and message in err
    assert err.strip().count("\n") == 0


@pytest.mark.parametrize("args,message", [
    (["a.txt.gz", "--out", "o", "--rows-per-shard", "0"], "expected a positive integer, got 0"),
    (["a.txt.gz"], "the following arguments are required: --out"),
])
def test_usage_errors_exit_2(tsv, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["convert", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and err.strip().count("\n") == 0


def test_unreadable_gzip(tsv, capsys):
    (tsv / "corrupt.gz").write_bytes(b"\x1f\x8b\x08\x00garbage-not-deflate")
    assert main(["convert", str(tsv / "corrupt.gz"), "--out", str(tsv / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "corrupt.gz: corrupt or truncated gzip data" in err and err.strip().count("\n") == 0
