"""`hugeembed train --nproc 2` (torchrun, gloo, DDP, sharded tables) against one process on the same data."""

from __future__ import annotations

import json

import pytest

from hugeembed import checkpoint as ckpt
from hugeembed.training import TrainConfig, Trainer
from tests.unit.cli.clihelp import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # whole training runs of several processes: CI, not the inner loop

PER_PROCESS = dict(model="dlrm", embedding_dim=4, batch_size=64, steps=12, eval_every=6, eval_rows=512,
                   synthetic_max_cardinality=5000, log_every=5, threads=1, sparse_optimizer="adagrad",
                   # the default admission (a shared row for ids seen fewer than 3 times) in both runs; constant
                   # rates, so the 12-step run resumed to 16 steps stands for a 16-step run (lr_decay follows the
                   # run's length)
                   lr_decay=0.0,
                   # unsized tables (row-wise unless placed): sized, 5000 ids of dim 4 would all be replicated
                   size_from_data=False)


def toml(d: dict) -> str:
    return "[train]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in d.items())


def test_nproc_2_matches_one_process_then_one_process_resumes_its_snapshot(tmp_path):
    (tmp_path / "run.toml").write_text(toml(PER_PROCESS))
    ck = tmp_path / "ck"
    cmd = ["train", "--nproc", "2", "--config", str(tmp_path / "run.toml"), "--checkpoint-dir", str(ck), "--checkpoint-every", "6", "--summary-json", str(tmp_path / "s.json"),
           "--quiet", "--shard", "C1=data_parallel", "--shard", "C2=table_wise@1"]
    done = run_cli(*cmd, timeout=240, cwd=tmp_path)  # the launcher and its ranks forked from the tests' zygote
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("processes") == 1  # rank 0 prints the summary, once
    assert "processes                       2" in done.stdout
    two = json.loads((tmp_path / "s.json").read_text())

    one_cfg = TrainConfig(**{**PER_PROCESS, "batch_size": 128})  # the same global batches in one process
    one = Trainer(one_cfg).fit()
    assert two["world_size"] == 2 and two["samples"] == one["samples"] == 12 * 128
    assert two["table_rows"] == one["table_rows"]  # the same ids were admitted, counted over all ranks
    assert two["auc"] == pytest.approx(one["auc"], abs=5e-4)
    assert two["logloss"] == pytest.approx(one["logloss"], abs=5e-4)
    assert two["history"]["loss"] == pytest.approx(one["history"]["loss"], abs=5e-4)

    manifest = ckpt.read_manifest(ck)
    assert manifest["world_size"] == 2 and manifest["step"] == 12
    assert manifest["plan"]["tables"]["C1"]["kind"] == "data_parallel"
    assert manifest["plan"]["tables"]["C2"] == {"kind": "table_wise", "ranks": [1]}
    assert {s["rank"] for s in manifest["tables"][2]["shards"]} == {0, 1}  # C3: row-wise, both ranks wrote

    # one process resumes the 2-process snapshot (same global batch) and goes on as if never split
    resumed = Trainer(one_cfg.replace(steps=16, checkpoint_dir=str(ck), resume=True)).fit()
    whole = Trainer(one_cfg.replace(steps=16)).fit()
    assert resumed["steps"] == 16 and resumed["table_rows"] == whole["table_rows"]
    assert resumed["auc"] == pytest.approx(whole["auc"], abs=5e-4)


def test_nproc_2_with_tables_on_disk_equals_nproc_2_in_memory(tmp_path):
    """--memory-budget with 2 processes: each rank keeps its shards under <storage-dir>/rank<r>/ within
    the budget; the run's numbers equal the in-memory 2-process run's bit for bit."""
    (tmp_path / "run.toml").write_text(toml(PER_PROCESS))

    def run(name: str, *extra: str) -> dict:
        cmd = ["train", "--nproc", "2", "--config", str(tmp_path / "run.toml"),
               "--checkpoint-dir", str(tmp_path / name), "--summary-json", str(tmp_path / f"{name}.json"), "--quiet",
               "--shard", "C1=data_parallel", "--shard", "C2=table_wise@1", *extra]
        done = run_cli(*cmd, timeout=240, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads((tmp_path / f"{name}.json").read_text())

    budget = 120 * 1024  # (the default admission: ids seen fewer than 3 times share a row, fewer rows)
    tiered = run("tiered", "--memory-budget", str(budget), "--storage-dir", str(tmp_path / "tiers"))
    plain = run("plain")
    for k in ("auc", "logloss", "copc", "table_rows", "history"):
        assert tiered[k] == plain[k], k
    assert "tiers" not in plain
    tiers = tiered["tiers"]  # over both ranks
    assert set(tiers) == {f"C{i}" for i in range(1, 27)}
    assert sum(t["rows_written"] for t in tiers.values()) > 0 and sum(t["rows_read"] for t in tiers.values()) > 0
    assert 0 < tiered["cache_hit_rate"] < 1
    assert tiered["table_bytes_stored"] > 0
    # each rank's caches within the budget (row bytes: dim 4 + Adagrad state 4, fp32, + slot metadata)
    from hugeembed.store import SLOT_METADATA_BYTES

    per_rank = {0: 0, 1: 0}
    plan = ckpt.read_manifest(tmp_path / "tiered")["plan"]["tables"]
    for name, t in tiers.items():
        ranks = plan[name]["ranks"] if plan[name]["kind"] != "data_parallel" else [0, 1]
        for r in ranks:
            per_rank[r] += t["capacity_rows"] // len(ranks) * (32 + SLOT_METADATA_BYTES)
    assert max(per_rank.values()) <= budget, per_rank
    assert sorted(p.name for p in (tmp_path / "tiers").iterdir()) == ["rank0", "rank1"]
