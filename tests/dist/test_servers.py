"""--servers M: of N ranks, the last M hold the tables' shards and read no data.  N = 3, M = 1 trains the model that
N = 2 workers train without servers at the same global batches (synchronous and staleness 2), snapshots cross
between runs with and without servers, --data-queue works with them, and a dead server is named."""

from __future__ import annotations

import pytest
import torch

from ._harness import run_ranks
from .common import assert_tables, export_all, merge_shards

pytestmark = pytest.mark.dist

# 2 workers x 32 rows: the global batch of 64 in every run; constant rates (a resumed 6 + 6 steps is a 12-step run)
RUN = dict(model="dlrm", embedding_dim=4, batch_size=32, steps=8, eval_every=4, eval_rows=256,
           synthetic_max_cardinality=3000, log_every=4, threads=1, sparse_optimizer="adagrad", lr_decay=0.0,
           dist_timeout=60.0, size_from_data=False)  # sized, 3000 ids of dim 4 would all be replicated


def fit(rank: int, world: int, workdir: str, cfg: dict) -> dict:
    """One rank of a Trainer run; returns its summary, its shards (export) and, on rank 0, the dense weights."""
    from hugeembed.training import TrainConfig, Trainer
    from hugeembed.types import ShardKind

    trainer = Trainer(TrainConfig(**cfg), rank=rank, world_size=world)
    summary = trainer.fit()
    ec = trainer.collection
    out = {"summary": {k: v for k, v in summary.items() if k != "history"}, "loss": summary["history"]["loss"],
           "tables": export_all(ec), "server": trainer.is_server,
           "replicated": {n for n in ec.plan.tables() if ec.plan.kind(n) is ShardKind.DATA_PARALLEL},
           "holders": sorted({r for n in ec.plan.tables() if ec.plan.kind(n) is not ShardKind.DATA_PARALLEL
                              for r in ec.plan[n].ranks})}
    if rank == 0:
        out["dense"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return out


def _run(world: int, **cfg) -> list[dict]:
    return run_ranks(world, "tests.dist.test_servers:fit", {"cfg": {**RUN, **cfg}}, deadline_s=300.0)


def _assert_same_model(got: list[dict], want: list[dict], exact: bool, blocks: tuple = ()) -> None:
    """Tables by key (every shard of every rank) and dense weights equal: bit for bit when `exact`; the column
    blocks of `blocks` tables are compared block by block by the caller."""
    def rest(r: dict) -> dict:
        return {n: t for n, t in r["tables"].items() if n not in blocks}

    tg = merge_shards([rest(r) for r in got], got[0]["replicated"])
    tw = merge_shards([rest(r) for r in want], want[0]["replicated"])
    assert_tables(tg, tw, exact=set(tw) if exact else set(), what="servers vs none")
    assert got[0]["dense"].keys() == want[0]["dense"].keys()
    for n, p in want[0]["dense"].items():
        if exact:
            assert torch.equal(got[0]["dense"][n], p), n
        else:
            torch.testing.assert_close(got[0]["dense"][n], p, rtol=1e-5, atol=1e-6)
    a, b = got[0]["summary"], want[0]["summary"]
    for k in ("auc", "logloss", "copc", "table_rows", "samples", "steps"):
        assert a[k] == b[k] if exact else a[k] == pytest.approx(b[k], abs=1e-5), (k, a[k], b[k])
    assert got[0]["loss"] == want[0]["loss"] if exact else got[0]["loss"] == pytest.approx(want[0]["loss"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 2])
def test_three_ranks_one_server_train_the_model_two_workers_train(staleness):
    stale = dict(staleness=staleness, dense_staleness=staleness)
    served = _run(3, servers=1, **stale)
    plain = _run(2, **stale)
    assert [r["server"] for r in served] == [False, False, True]
    assert served[0]["holders"] == [2]  # every shard on the server; replicas of tiny tables everywhere
    assert served[2]["tables"].keys() == plain[0]["tables"].keys()
    for w in (0, 1):  # the workers hold no row of a sharded table
        assert all(served[w]["tables"][n]["keys"].numel() == 0 for n in served[w]["tables"]
                   if n not in served[0]["replicated"])
    assert served[0]["summary"]["servers"] == 1 and served[0]["summary"]["world_size"] == 3
    _assert_same_model(served, plain, exact=True)


@pytest.mark.slow
def test_snapshots_resume_across_runs_with_and_without_servers(tmp_path):
    """A run with a server snapshots at step 4; a run without servers resumes it to step 8, and back: both equal
    the uninterrupted run without servers (the same global batches)."""
    whole = _run(2)
    _run(3, servers=1, steps=4, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=4)
    into_plain = _run(2, checkpoint_dir=str(tmp_path / "a"), resume=True)
    _run(2, steps=4, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=4)
    into_served = _run(3, servers=1, checkpoint_dir=str(tmp_path / "b"), resume=True)
    from hugeembed import checkpoint as ckpt

    manifest = ckpt.read_manifest(tmp_path / "b")
    assert manifest["world_size"] == 3 and manifest["step"] == 8
    assert {s["rank"] for t in manifest["tables"] for s in t["shards"]} <= {0, 2}  # replicas by rank 0, shards by 2
    for got in (into_plain, into_served):
        assert got[0]["summary"]["steps"] == 8 and got[0]["summary"]["samples"] == 8 * 64
        tg = merge_shards([r["tables"] for r in got], got[0]["replicated"])
        tw = merge_shards([r["tables"] for r in whole], whole[0]["replicated"])
        assert_tables(tg, tw, exact=set(tw), what="resumed")
        for k in ("auc", "logloss", "table_rows"):
            assert got[0]["summary"][k] == whole[0]["summary"][k], k


@pytest.mark.slow
def test_data_queue_with_a_server_trains_every_row_of_the_epoch_once():
    """--data-queue 32 (chunks of one worker batch) with a server: the workers take the chunks, the server none;
    the epoch's 640 rows trained in 10 global steps, the model the fixed split trains to float rounding (a global
    batch's two chunks may come in either order)."""
    epoch = dict(steps=None, epochs=1, synthetic_rows=640, eval_every=0)
    queued = _run(3, servers=1, data_queue=32, **epoch)
    plain = _run(2, **epoch)
    s = queued[0]["summary"]
    assert s["samples"] == 640 and s["steps"] == 10 and s["epochs"] == 1
    assert queued[2]["server"] and queued[0]["holders"] == [2]
    assert s["auc"] == pytest.approx(plain[0]["summary"]["auc"], abs=1e-4)
    assert s["logloss"] == pytest.approx(plain[0]["summary"]["logloss"], abs=1e-4)


def consume(rank: int, world: int, workdir: str, servers: int, chunk: int, batch: int, stop_after: int | None = None
            ) -> dict:
    """The queue as a run with `servers` takes it: workers read numbered rows, servers empty batches."""
    from hugeembed.training._queue import QueueSource
    from hugeembed.training._servers import ServerSource
    from hugeembed.training._distributed import empty_batch

    from .workers_queue import _Rows, numbered

    workers = world - servers
    if rank < workers:
        src = QueueSource(_Rows(), numbered, [(0, 1000)], [300, 1000], ["f"], chunk, batch, rank, world, 30.0, workers)
    else:
        empty = empty_batch(["f"], 1, torch.device("cpu"))
        src = QueueSource(ServerSource(empty, batch, workers), None, [], [], None, chunk, batch, rank, world, 30.0,
                          workers, server_batch=empty)
    steps = []
    for b in src.train_batches(0):
        steps.append((b.dense[:, 0].long().tolist(), src.trained(b, workers)))
        if stop_after is not None and len(steps) == stop_after:
            return {"steps": steps, "position": src.position()}
    return {"steps": steps, "position": None}


@pytest.mark.slow
def test_the_queue_hands_no_chunk_to_a_server_and_keeps_its_position():
    got = run_ranks(3, "tests.dist.test_servers:consume", {"servers": 1, "chunk": 48, "batch": 16})
    assert len({len(r["steps"]) for r in got}) == 1  # the same steps (collectives) on every rank
    assert all(rows == [] for rows, _ in got[2]["steps"])  # the server read nothing
    trained = sorted(row for r in got[:2] for rows, _ in r["steps"] for row in rows)
    assert trained == list(range(1000))  # every row once
    for t in range(len(got[0]["steps"])):  # every rank counts the step's rows of both workers
        assert {r["steps"][t][1] for r in got} == {len(got[0]["steps"][t][0]) + len(got[1]["steps"][t][0])}
    part = run_ranks(3, "tests.dist.test_servers:consume", {"servers": 1, "chunk": 48, "batch": 16, "stop_after": 5})
    done = [row for r in part[:2] for rows, _ in r["steps"] for row in rows]
    left = [row for a, b in part[0]["position"]["ranges"] for row in range(a, b)]
    assert part[1]["position"] == part[0]["position"]  # (rank 0's is saved; the server's lacks the untaken chunks)
    assert sorted(done + left) == list(range(1000))


def die(rank: int, world: int, workdir: str, victim: int, at: int = 3, timeout: float = 10.0,
        staleness: int | None = None, broken_group: bool = True) -> dict:
    """Rank `victim` (a server: the last rank) dies after `at` steps; the workers report the error and its delay."""
    import os
    import time

    from hugeembed import ShardingError
    from hugeembed.distributed import ShardedEmbeddingCollection, ShardingPlan, new_embedding_group
    from hugeembed.features import SparseFeatures

    from .workers_stale import linear_batch, linear_tables

    plan = ShardingPlan(world, {"a": f"row_wise@{world - 1}", "b": "data_parallel", "c": f"table_wise@{world - 1}"})
    ec = ShardedEmbeddingCollection(linear_tables(), plan=plan, process_group=new_embedding_group("cpu", timeout),
                                    timeout=timeout, staleness=staleness, servers=1)
    empty = SparseFeatures(["a", "b", "c"], torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(1, dtype=torch.int64),
                           batch_size=0)
    batches = [empty if ec.is_server else linear_batch(s, rank, world - 1) for s in range(at + 6)]

    def steps(lo: int, hi: int) -> None:
        k = staleness or 0
        for i in range(lo, hi):
            if staleness is not None:
                while ec.step + ec.batches_ahead < min(i + k + 1, hi):
                    ec.enqueue(batches[ec.step + ec.batches_ahead])
            ec(batches[i]).concat().sum().backward()
        ec.drain()

    steps(0, at)
    if rank == victim:
        os._exit(3)
    t0 = time.monotonic()
    try:
        steps(at, at + 6)
    except ShardingError as e:
        out = {"error": str(e), "seconds": time.monotonic() - t0}
        if rank == 0:  # rank 0 hosts the store under tcp:// init: up while the others look
            time.sleep(4.0)
        return out
    return {"error": None, "seconds": time.monotonic() - t0}


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [None, 2])
def test_a_dead_server_is_named_like_a_dead_worker(staleness):
    got = run_ranks(3, "tests.dist.test_servers:die", {"victim": 2, "staleness": staleness, "broken_group": True},
                   expected_codes={2: 3})
    for rank in (0, 1):
        err = got[rank]["error"]
        assert err is not None, f"worker {rank} kept training after the server died"
        assert f"rank {rank} of 3" in err and "--resume" in err, err
        assert "Who is gone: rank 2 of 3 stopped responding" in err, err
        assert f"rank {1 - rank} " not in err.split("Who is gone:")[1], err
        assert got[rank]["seconds"] < 10.0 + 5.0


@pytest.mark.slow
def test_the_cli_trains_with_a_server_as_one_process_trains_the_global_batch(tmp_path):
    """`hugeembed train --nproc 3 --servers 1`: rank 0 prints one summary saying so; the model is
    the one process's on the same global batches (to float rounding: row gradients summed per worker first)."""
    import json
    import os
    import subprocess
    import sys

    from hugeembed.training import TrainConfig, Trainer

    from ._harness import ROOT

    from .test_train_cli import toml

    (tmp_path / "run.toml").write_text(toml(RUN))
    cmd = [sys.executable, "-m", "hugeembed", "train", "--nproc", "3", "--servers", "1", "--config",
           str(tmp_path / "run.toml"), "--summary-json", str(tmp_path / "s.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("summary") == 1 and "3 (1 of them servers)" in done.stdout
    served = json.loads((tmp_path / "s.json").read_text())
    one = Trainer(TrainConfig(**{**RUN, "batch_size": 64})).fit()
    assert served["servers"] == 1 and served["samples"] == one["samples"] == 8 * 64
    assert served["table_rows"] == one["table_rows"]
    assert served["auc"] == pytest.approx(one["auc"], abs=5e-4)
    assert served["logloss"] == pytest.approx(one["logloss"], abs=5e-4)


@pytest.mark.slow
def test_tables_on_disk_live_on_the_server_and_train_as_in_memory(tmp_path):
    """--memory-budget with a server: the tiered shards (and their directory) are the server's alone; the run equals
    the in-memory run with a server bit for bit (the workers take part in the tiers' figures with nothing)."""
    tiered = _run(3, servers=1, memory_budget=120 * 1024, storage_dir=str(tmp_path / "tiers"))
    plain = _run(3, servers=1)
    _assert_same_model(tiered, plain, exact=True)
    assert sorted(p.name for p in (tmp_path / "tiers").iterdir()) == ["rank2"]
    assert 0 < tiered[0]["summary"]["cache_hit_rate"] <= 1


@pytest.mark.slow
def test_a_column_wise_table_on_two_servers_trains_as_on_two_workers():
    """C3 column-wise over the 2 servers of 4 ranks (2 workers) against C3 column-wise over 2 ranks without servers."""
    served = _run(4, servers=2, sharding=("C3=column_wise@2,3",), steps=4)
    plain = _run(2, sharding=("C3=column_wise",), steps=4)
    assert served[2]["tables"]["C3"]["keys"].numel() > 0 and served[0]["tables"]["C3"]["keys"].numel() == 0
    _assert_same_model(served, plain, exact=True, blocks=("C3",))
    for s, p in ((2, 0), (3, 1)):  # block b of C3: on server 2 + b with servers, on rank b without
        got, want = ({"C3": r["tables"]["C3"]} for r in (served[s], plain[p]))
        assert_tables(merge_shards([got]), merge_shards([want]), exact={"C3"}, what=f"C3 block {p}")


@pytest.mark.slow
def test_converted_shards_with_a_server_train_as_without(tmp_path):
    """Shards: the workers read their slices and hold out their first batches for evaluation; the server follows
    worker 0's epoch length (2 epochs) without opening the data."""
    from hugeembed.data import SyntheticConfig, convert, write_criteo_tsv

    write_criteo_tsv(tmp_path / "train.tsv", 600, config=SyntheticConfig(seed=5, max_cardinality=500))
    convert(tmp_path / "train.tsv", tmp_path / "shards", rows_per_shard=250)
    files = dict(data=(str(tmp_path / "shards"),), steps=None, epochs=2, eval_rows=64, eval_every=0)
    served = _run(3, servers=1, **files)
    plain = _run(2, **files)
    a, b = served[0]["summary"], plain[0]["summary"]
    assert a["steps"] == b["steps"] > 0 and a["epochs"] == b["epochs"] and a["samples"] == b["samples"]
    _assert_same_model(served, plain, exact=True)
