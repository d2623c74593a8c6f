"""Conversion to shards: exact round trip, manifest, atomicity, crash recovery, checksums."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hugeembed.data import ShardSet, SyntheticConfig, convert, read_criteo, write_criteo_tsv
from hugeembed.errors import ConfigError, InputError

from .criteo_oracle import line

CFG = SyntheticConfig(seed=11, max_cardinality=10_000)


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    write_criteo_tsv(root / "a.txt.gz", 2500, config=CFG)
    write_criteo_tsv(root / "b.txt", 1700, config=CFG, start=2500)
    write_criteo_tsv(root / "c.txt", 40, config=CFG)
    return root


@pytest.mark.parametrize("rows_per_shard", [1, 1000, 4200, 10_000])
def test_round_trip_is_exact(tsv, tmp_path, rows_per_shard):
    if rows_per_shard == 1:  # one row per shard: every row crosses a shard boundary
        inputs = [tsv / "c.txt"]
        ref = read_criteo(inputs)
    else:
        inputs = [tsv / "a.txt.gz", tsv / "b.txt"]
        ref = read_criteo(inputs)
    summary = convert(inputs, tmp_path / "out", rows_per_shard=rows_per_shard, chunk_bytes=50_000)
    shards = ShardSet(tmp_path / "out", verify=True)
    assert shards.rows == summary.rows == len(ref)
    assert summary.shards == len(shards.shards) == -(-len(ref) // rows_per_shard)
    assert shards.read_all().equals(ref)
    stop = min(2600, len(ref))
    assert shards.read(37, stop).equals(ref.slice(37, stop))
    arrays = shards.arrays(0)
    assert isinstance(arrays["cats"], np.memmap) and arrays["labels"].dtype == np.uint8


def test_manifest_contents(tsv, tmp_path):
    convert([tsv / "a.txt.gz", tsv / "b.txt"], tmp_path / "out", rows_per_shard=3000)
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["format"] == "hugeembed.criteo-shards" and m["version"] == 1 and m["rows"] == 4200
    assert [s["rows"] for s in m["shards"]] == [3000, 1200]
    assert m["schema"]["sparse"]["missing_ids"][0] == 2**32 and m["schema"]["dense"]["names"][0] == "I1"
    assert [(os.path.basename(s["path"]), s["rows"], s["skipped"]) for s in m["sources"]] == [
        ("a.txt.gz", 2500, 0), ("b.txt", 1700, 0)]
    f = m["shards"][1]["files"]["dense"]
    assert f["file"] == "part-00001.dense.npy" and len(f["sha256"]) == 64
    assert f["bytes"] == (tmp_path / "out" / f["file"]).stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left behind


def test_skip_mode_counts_in_manifest(tmp_path):
    text = "\n".join([line(), "oops", line("0"), line(label="x")]) + "\n"
    (tmp_path / "in.txt").write_text(text)
    with pytest.raises(InputError, match=r"in\.txt:2: expected 40"):
        convert(tmp_path / "in.txt", tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["in.txt"]
    s = convert(tmp_path / "in.txt", tmp_path / "out", on_error="skip")
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert s.rows == 2 and s.skipped == 2 and m["skipped"] == 2 and m["on_error"] == "skip"
    assert [e.rsplit(":", 2)[1:] for e in m["skipped_examples"]] == [["2", " wrong field count"], ["4", " bad label"]]


def test_crash_leaves_nothing_and_a_rerun_starts_over(tsv, tmp_path):
    calls = []

    def crash(progress):
        calls.append(progress)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(tsv / "b.txt", tmp_path / "out", progress=crash, chunk_bytes=20_000, rows_per_shard=100)
    assert list(tmp_path.iterdir()) == []
    # a temp dir of a killed process (not cleaned by an exception handler) is removed by the next run
    stale = tmp_path / ".out.tmp-999999999-dead"
    stale.mkdir()
    (stale / "part-00000.dense.npy").write_bytes(b"partial")
    progress = []
    convert(tsv / "b.txt", tmp_path / "out", progress=progress.append, chunk_bytes=20_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert progress[-1].bytes_done == progress[-1].bytes_total and progress[-1].rows == 1700
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(progress, progress[1:]))


def test_existing_output_and_overwrite(tsv, tmp_path):
    convert(tsv / "b.txt", tmp_path / "out")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert(tsv / "b.txt", tmp_path / "out")
    convert(tsv / "a.txt.gz", tmp_path / "out", overwrite=True)
    assert ShardSet(tmp_path / "out").rows == 2500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_corruption_is_detected(tsv, tmp_path):
    convert(tsv / "b.txt", tmp_path / "out", rows_per_shard=1000)
    path = tmp_path / "out" / "part-00001.cats.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    ShardSet(tmp_path / "out")  # cheap open: checks counts and shapes, not checksums
    with pytest.raises(InputError, match="part-00001.cats.npy: checksum mismatch"):
        ShardSet(tmp_path / "out", verify=True)
    path.write_bytes(bytes(data[:-80]))
    with pytest.raises(InputError, match="part-00001.cats.npy"):
        ShardSet(tmp_path / "out").arrays(1)
    (tmp_path / "out" / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(InputError, match="format"):
        ShardSet(tmp_path / "out")


def test_bad_arguments(tsv, tmp_path):
    with pytest.raises(ConfigError, match="rows_per_shard"):
        convert(tsv / "b.txt", tmp_path / "out", rows_per_shard=0)
    with pytest.raises(FileNotFoundError):
        convert(tsv / "missing.txt", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_npy_writer_header_rewritten_before_more_rows(tmp_path):
    """The header can be written (the file whole, for its sha256) before close, and rows appended after it
    still land at the end: np.load reads every row."""
    from hugeembed.data._shards import NpyWriter

    w = NpyWriter(tmp_path / "a.npy", np.int64, (3,))
    w.append(np.arange(6, dtype=np.int64).reshape(2, 3))
    w.write_header()
    assert np.load(tmp_path / "a.npy").shape == (2, 3)
    w.append(np.arange(6, 12, dtype=np.int64).reshape(2, 3))
    w.close()
    np.testing.assert_array_equal(np.load(tmp_path / "a.npy"), np.arange(12).reshape(4, 3))


def test_the_gc_freeze_is_undone_and_leaves_another_freeze_alone(tsv, tmp_path):
    """convert freezes the objects alive before it (fewer GC passes over them) and unfreezes them after,
    also when it fails; a freeze someone else made is left as it was."""
    import gc

    seen = []
    convert(tsv / "c.txt", tmp_path / "a", progress=lambda p: seen.append(gc.get_freeze_count()))
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
    def stop(progress):
        raise InputError("stop")

    with pytest.raises(InputError, match="stop"):
        convert(tsv / "c.txt", tmp_path / "b", progress=stop)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        convert(tsv / "c.txt", tmp_path / "c")
        assert gc.get_freeze_count() > 0  # still frozen (a frozen object that dies leaves the count: no ==)
    finally:
        gc.unfreeze()
