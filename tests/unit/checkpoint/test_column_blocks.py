"""A column-wise table's shards (one per block of columns) joined when read, without processes: a one-process
snapshot's table cut into blocks by hand (plain slicing: weights, then each state part, then per-row state) reads
back as the whole table, and a damaged set of blocks is refused naming the table, the model untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hugeembed import checkpoint as ckpt
from hugeembed.checkpoint._files import write_tensor
from hugeembed.errors import CheckpointError
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adam


def _tables():
    rule = Adam(lr=0.01, mode="global")  # 2 per-element state parts and a per-row counter
    return [TableConfig("wide", 6, combiner="sum", optimizer=rule), TableConfig("other", 4, optimizer=rule)]


def _blocks(rows: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The oracle: columns [lo, hi) of the weights, of m and of v (6 each), then the counter."""
    return torch.cat([rows[:, lo:hi], rows[:, 6 + lo:6 + hi], rows[:, 12 + lo:12 + hi], rows[:, 18:]], 1)


def _split(snap: Path, spans=((0, 2), (2, 4), (4, 6))) -> None:
    """Rewrites table "wide" of `snap` as one shard per block of columns, as column-wise ranks write it."""
    m = json.loads((snap / "manifest.json").read_text())
    entry = next(t for t in m["tables"] if t["name"] == "wide")
    one = entry["shards"][0]
    rows = torch.from_numpy(np.load(snap / one["files"]["rows"]["file"]))
    shards = []
    for r, (lo, hi) in enumerate(spans):
        files = {}
        for f, rec in one["files"].items():
            path = snap / "tables" / f"wide.block{r}.{f}.npy"
            if f == "rows":
                files[f] = write_tensor(path, _blocks(rows, lo, hi))
            else:
                shutil.copyfile(snap / rec["file"], path)
                files[f] = dict(rec)
            files[f]["file"] = f"tables/{path.name}"
        shards.append({**one, "rank": r, "files": files, "columns": {"lo": lo, "hi": hi, "state_parts": 2}})
    entry["shards"] = shards
    (snap / "manifest.json").write_text(json.dumps(m))


def _ids(step: int):
    from hugeembed.features import SparseFeatures

    g = torch.Generator().manual_seed(step)
    return SparseFeatures.from_lists({"wide": [torch.randint(0, 50, (3,), generator=g).tolist() for _ in range(8)],
                                      "other": [[int(torch.randint(0, 9, (1,), generator=g))] for _ in range(8)]})


def _trained() -> EmbeddingCollection:
    ec = EmbeddingCollection(_tables())
    for step in range(3):
        ec(_ids(step)).concat().pow(2).sum().backward()
    return ec


def test_blocks_read_back_as_the_whole_table_and_damage_is_refused(tmp_path, monkeypatch):
    from hugeembed.checkpoint import _columns

    src = _trained()
    snap = ckpt.save(tmp_path / "ck", src)
    _split(snap)
    want = src.state_dict()
    monkeypatch.setattr(_columns, "_CHUNK_BYTES", 200)  # joined a few rows at a time
    got = EmbeddingCollection(_tables())
    ckpt.load(snap, got)
    for k, v in want.items():
        assert torch.equal(got.state_dict()[k], v), k
    # damaged: a block missing, a block of another width
    m = json.loads((snap / "manifest.json").read_text())
    wide = next(t for t in m["tables"] if t["name"] == "wide")
    cases = {"missing": ({**m, "tables": [{**wide, "shards": wide["shards"][::2]}]},
                         r"table 'wide': its blocks hold columns \[\(0, 2\), \(4, 6\)\] of dim 6, not 2 equal"),
             "parts": ({**m, "tables": [{**wide, "shards": [{**s, "columns": {**s["columns"], "state_parts": 1}}
                                                            for s in wide["shards"]]}]},
                       r"table 'wide': the block of columns \[0, 2\) holds rows of shape \[\d+, 7\], expected "
                       r"\[\d+, 11\]")}  # read as 1 part: (1 + 1) x 2 columns + 7 per-row values
    for name, (bad, match) in cases.items():
        bad["tables"] += [t for t in m["tables"] if t["name"] != "wide"]
        (snap / "manifest.json").write_text(json.dumps(bad))
        ec = EmbeddingCollection(_tables())
        before = {k: v.clone() for k, v in ec.state_dict().items()}
        with pytest.raises(CheckpointError, match=match) as e:
            ckpt.load(snap, ec)
        assert "\n" not in str(e.value), name
        assert all(torch.equal(v, ec.state_dict()[k]) for k, v in before.items()), name
