"""Snapshots of column-wise tables, full and delta: each rank of a placement writes its own block of
columns (the rows seen since the parent, for a delta), and a reader joins the blocks.

Oracle: one EmbeddingCollection trained on the same global batches (tests/dist/workers_colwise.py),
as in test_column_wise.py: rows bit for bit but for a table's shared row (float rounding).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hugeembed import checkpoint as ckpt
from hugeembed.errors import CheckpointError
from hugeembed.nn import EmbeddingCollection

from ._harness import run_ranks
from .test_column_wise import COLWISE, TABLES, assert_same_tables
from .workers_colwise import colwise_tables, train

pytestmark = pytest.mark.dist

MIXED = {"user": "column_wise@0,2", "item": "column_wise", "country": "column_wise@1,2", "page": "table_wise@1"}


def trained(steps: int) -> EmbeddingCollection:
    ec = EmbeddingCollection(colwise_tables("adagrad"))
    train(ec, range(steps))
    return ec


def loaded(snap) -> EmbeddingCollection:
    ec = EmbeddingCollection(colwise_tables("adagrad"))
    ckpt.load(snap, ec, restore_rng=False)
    return ec


def manifest(snap) -> dict:
    return json.loads((Path(snap) / "manifest.json").read_text())


def blocks_of(snap, table: str) -> list[tuple[int, int, int]]:
    """(first column, last + 1, rows file width) of each shard of `table` in a snapshot."""
    entry = next(t for t in manifest(snap)["tables"] if t["name"] == table)
    return [(s["columns"]["lo"], s["columns"]["hi"], s["files"]["rows"]["shape"][1]) for s in entry["shards"]]


@pytest.mark.slow
def test_delta_chains_of_column_blocks_across_one_three_and_two_ranks(tmp_path, monkeypatch):
    # one process: full at step 2, delta at 3; 3 ranks (column-wise beside table-wise) load it and write a
    # delta of blocks (4), a full (5) and a delta (6); 3 ranks again load 5 + 6 and write a delta (7); 2 ranks
    # load 5 + 6 + 7 and write deltas at 8 and 9: every snapshot of the chain loads into one process as the
    # run was then
    root = tmp_path / "chain"
    one = trained(2)
    ckpt.save(root, one)
    train(one, range(2, 3))
    tip1 = ckpt.save(root, one, delta=True)
    three = run_ranks(3, "tests.dist.workers_coldelta:main", {"runs": [
        {"name": "a", "opt": "adagrad", "plan": MIXED, "load": str(tip1), "root": str(root),
         "legs": [(3, 4, True), (4, 5, False), (5, 6, True)]},
        {"name": "b", "opt": "adagrad", "plan": MIXED, "load": str(root / "step-000000006"), "root": str(root),
         "legs": [(6, 7, True)]}]})
    s4, s5, s6 = three[0]["a"]["saved"]
    s7 = three[0]["b"]["saved"][0]
    assert all(r["a"]["saved"] == [s4, s5, s6] and r["b"]["saved"] == [s7] for r in three), three
    two = run_ranks(2, "tests.dist.workers_coldelta:main", {"runs": [
        {"name": "c", "opt": "adagrad", "plan": COLWISE, "load": s7, "root": str(root),
         "legs": [(7, 8, True), (8, 9, True)]}]})
    s8, s9 = two[0]["c"]["saved"]
    assert [manifest(s)["kind"] for s in (s4, s5, s6, s7, s8, s9)] == ["delta", "full"] + ["delta"] * 4
    # each block owner wrote its columns with their Adagrad state: width 2 x block dim
    assert blocks_of(s4, "user") == [(0, 3, 6), (3, 6, 6)]
    assert blocks_of(s4, "item") == [(0, 2, 4), (2, 4, 4), (4, 6, 4)]
    assert blocks_of(s9, "country") == [(0, 3, 6), (3, 6, 6)]
    assert "columns" not in next(t for t in manifest(s4)["tables"] if t["name"] == "page")["shards"][0]
    # a delta holds the rows seen since its parent only
    full_rows = sum(s["rows"] for t in manifest(s5)["tables"] for s in t["shards"][:1])
    delta_rows = sum(s["rows"] for t in manifest(s6)["tables"] for s in t["shards"][:1])
    assert 0 < delta_rows < full_rows, (delta_rows, full_rows)
    from hugeembed.checkpoint import _columns

    monkeypatch.setattr(_columns, "_CHUNK_BYTES", 300)  # here the blocks are joined a few rows at a time
    for snap, steps in ((s4, 4), (s5, 5), (s6, 6), (s7, 7), (s8, 8), (s9, 9)):
        assert_same_tables(loaded(snap).state_dict(), trained(steps).state_dict(), f"{Path(snap).name}")
    for rank, r in enumerate(two):  # the 2 ranks' own state after the chain: as one process
        assert_same_tables(r["c"]["state"], trained(9).state_dict(), f"2 ranks, rank {rank}")
    _bad_column_snapshots(root, s8, s9, tmp_path)


def _rewrite(path: Path, arr: np.ndarray) -> dict:
    """Overwrites an array file and returns its new record (a tampered file that passes its checksum)."""
    from hugeembed.checkpoint._files import write_tensor
    import torch

    rec = write_tensor(path, torch.from_numpy(arr))
    return {k: v for k, v in rec.items() if k != "file"}


def _tamper(src: Path, dst: Path, edit) -> Path:
    """A copy of snapshot `src` as `dst` (same parent links) with `edit(manifest, dir)` applied to its manifest."""
    shutil.copytree(src, dst)
    m = manifest(dst)
    edit(m, dst)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _refused(snap, match: str) -> None:
    """Loading `snap` raises a one-line CheckpointError naming the table, and changes nothing."""
    ec = loaded(snap.parent / "step-000000008")
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    with pytest.raises(CheckpointError, match=match) as e:
        ckpt.load(snap, ec, restore_rng=False)
    assert "\n" not in str(e.value)
    after = ec.state_dict()
    assert all(np.array_equal(before[k].numpy(), after[k].numpy()) for k in before)


def _bad_column_snapshots(root: Path, s8: str, s9: str, tmp: Path) -> None:
    """Copies of delta `s9` (its parent `s8`) with one block's shard dropped, widened or given other keys."""
    s9 = Path(s9)

    def user(m):
        return next(t for t in m["tables"] if t["name"] == "user")

    def drop_block(m, d):  # a partial delta: one block's shard missing
        user(m)["shards"] = user(m)["shards"][:1]

    _refused(_tamper(s9, root / "step-000000010", drop_block),
             r"table 'user': its blocks hold columns \[\(0, 3\)\] of dim 6.*a block is missing")

    def wide_block(m, d):  # a block of the wrong width
        sh = user(m)["shards"][1]
        rows = np.load(d / sh["files"]["rows"]["file"])
        sh["files"]["rows"].update(_rewrite(d / sh["files"]["rows"]["file"], np.concatenate([rows, rows[:, :1]], 1)))

    _refused(_tamper(s9, root / "step-000000011", wide_block),
             r"table 'user': the block of columns \[3, 6\) holds rows of shape \[\d+, 7\], expected \[\d+, 6\]")

    def torn_block(m, d):  # a block written by another save: other keys
        sh = user(m)["shards"][1]
        keys = np.load(d / sh["files"]["keys"]["file"])
        sh["files"]["keys"].update(_rewrite(d / sh["files"]["keys"]["file"], keys + 1000))

    _refused(_tamper(s9, root / "step-000000012", torn_block),
             r"table 'user': the block of columns \[3, 6\) holds other keys .*torn snapshot")
    # a chain with a missing link: step 9's parent (8) gone
    orphan = tmp / "orphan"
    shutil.copytree(root, orphan)
    shutil.rmtree(orphan / Path(s8).name)
    with pytest.raises(CheckpointError, match=r"is a delta of step-000000008, which is missing") as e:
        loaded(orphan / s9.name)
    assert "\n" not in str(e.value)
