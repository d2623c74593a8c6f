"""`hugeembed train --nproc 2` on converted shards: the planner reads the data's ids per bag (column-wise for a
wide table of long bags, row-wise for one of one id per bag), delta snapshots of the column-wise table, and a
served artifact's deltas from them."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hugeembed.data import Loader, ShardSet

from tests.unit.cli.clihelp import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a training run of 2 processes

SCHEMA = """format = "csv"
header = true
[label]
column = "clicked"
[dense.age]
transform = "log1p"
[sparse.user]
[sparse.tags]
separator = "|"
"""


def _csv(path, rows: int = 1200) -> None:
    rnd = random.Random(5)
    with open(path, "w") as f:
        f.write("clicked,age,user,tags\n")
        for _ in range(rows):
            tags = "|".join(str(rnd.randrange(3000)) for _ in range(rnd.randint(6, 10)))
            f.write(f"{rnd.randint(0, 1)},{rnd.randint(18, 80)},{rnd.randrange(3000)},{tags}\n")


def _cli(*args, cwd) -> str:
    done = run_cli(*args, timeout=300, cwd=cwd)  # the launcher and its ranks forked from the tests' zygote
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_cli_plans_column_wise_from_the_shards_ids_per_bag_and_serves_its_deltas(tmp_path):
    from hugeembed.serving import ServingModel, export, export_delta

    _csv(tmp_path / "long.csv")
    (tmp_path / "s.toml").write_text(SCHEMA)
    _cli("convert", "--schema", tmp_path / "s.toml", "--out", tmp_path / "shards", tmp_path / "long.csv",
         "--no-progress", cwd=tmp_path)
    per_bag = ShardSet(tmp_path / "shards").ids_per_bag()
    assert per_bag["user"] == 1.0 and 7.5 < per_bag["tags"] < 8.5, per_bag  # 6..10 tags a row
    ck = tmp_path / "ck"
    # tables of 64 columns and up to 4096 rows: tags' ~3000 ids too big to replicate or to keep whole on one
    # rank; user's ~1000 (the manifest's distinct_ids) replicated; no --shard
    _cli("train", "--nproc", 2, "--data", tmp_path / "shards", "--embedding-dim", 64, "--capacity", 4096,
         "--steps", 3, "--batch-size", 32, "--checkpoint-dir", ck, "--checkpoint-every", 1,
         "--full-checkpoint-every", 3, "--quiet", "--threads", 1, cwd=tmp_path)
    snaps = sorted(ck.glob("step-*"))
    manifests = [json.loads((s / "manifest.json").read_text()) for s in snaps]
    assert [m["kind"] for m in manifests] == ["full", "delta", "delta"]
    plan = manifests[-1]["plan"]["tables"]
    assert plan["tags"] == {"kind": "column_wise", "ranks": [0, 1]}  # ~8 ids a bag: pooled blocks travel
    assert plan["user"]["kind"] == "data_parallel"  # < 1 MiB by its distinct ids
    tags = next(t for t in manifests[1]["tables"] if t["name"] == "tags")
    assert [s["columns"]["lo"] for s in tags["shards"]] == [0, 32]  # each rank wrote its block of the delta
    # an artifact of the first snapshot plus the deltas to the newest serves what a full export of it does
    art = export(snaps[0], tmp_path / "art")
    export_delta(ck, art)
    full = ServingModel.load(export(ck, tmp_path / "full"))
    live = ServingModel.load(art)
    assert live.version == snaps[-1].name
    batch = next(iter(Loader(str(tmp_path / "shards"), 64)))
    want = full.predict(batch.dense, batch.sparse)
    assert torch.equal(live.predict(batch.dense, batch.sparse), want)
    assert not torch.equal(ServingModel.load(art, apply_deltas=False).predict(batch.dense, batch.sparse), want)
