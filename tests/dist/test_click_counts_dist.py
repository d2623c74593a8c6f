"""Click counts in sharded runs (gloo, CPU): 2 ranks fed the slices of the global batches keep the count tables and
the count fit that one process keeps on those batches, and train its model (issue 33: one model for 1 and N
processes with default flags).

The count tables (clicks, hits, the log-odds at the run's click rate) are sums of 0/1 labels: bit for bit, on
every kind of shard.  The fit (a Newton step over the global batch) sums the batch's rows in another order (a
text file's global batch is rank 0's lines, then rank 1's) from logits DDP rounds otherwise: equal to float
rounding, and the same on every rank."""

from __future__ import annotations

import pytest
import torch

from ._harness import run_ranks
from .common import assert_tables, export_all, merge_shards

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # whole training runs of several processes: CI, not the inner loop

# 2 ranks x 32 rows = the one process's batch of 64; 320 rows: 5 batches a pass, 7 steps cross into the second
RUN = dict(embedding_dim=4, steps=7, eval_every=0, threads=1, click_counts=True, dist_timeout=60.0)


def _files(tmp_path) -> dict:
    pytest.importorskip("pyarrow")
    from tests.unit.data.schema_oracle import SCHEMA, write_rows

    (tmp_path / "s.toml").write_text(SCHEMA)
    write_rows(tmp_path / "train.csv", 320, seed=1)
    write_rows(tmp_path / "test.csv", 120, seed=2)
    return dict(schema=str(tmp_path / "s.toml"), data=(str(tmp_path / "train.csv"),),
                eval_data=(str(tmp_path / "test.csv"),))


def _state(trainer, summary) -> dict:
    m = trainer.model
    return {"tables": {n: t for n, t in export_all(trainer.collection).items() if n.startswith("count_")},
            "fit": m.count_fit.clone(), "hessian": m.count_hessian.clone(), "rows": m.count_rows.clone(),
            "shift": float(m.count_shift), "calibration": summary["count_calibration"],
            "auc": summary["auc"], "logloss": summary["logloss"]}


def fit(rank: int, world: int, workdir: str, cfg: dict) -> dict:
    from hugeembed.training import TrainConfig, Trainer
    from hugeembed.types import ShardKind

    trainer = Trainer(TrainConfig(**cfg), rank=rank, world_size=world)
    out = _state(trainer, trainer.fit())
    plan = trainer.collection.plan
    out["kinds"] = {n: str(plan.kind(n)) for n in out["tables"]}
    out["replicated"] = {n for n in out["tables"] if plan.kind(n) is ShardKind.DATA_PARALLEL}
    return out


def test_two_ranks_keep_the_counts_and_the_fit_one_process_keeps_at_the_same_global_batch(tmp_path):
    from hugeembed.training import TrainConfig, Trainer

    files = _files(tmp_path)
    one = Trainer(TrainConfig(**RUN, **files, batch_size=64))
    want = _state(one, one.fit())
    # every kind of shard a count table may have (the planner's own choice for the others: row-wise)
    shard = ("count_movie_id=table_wise@1", "count_genres=data_parallel", "count_city=table_wise@0")
    got = run_ranks(2, "tests.dist.test_click_counts_dist:fit",
                    {"cfg": {**RUN, **files, "batch_size": 32, "sharding": shard}}, deadline_s=300.0)
    assert got[0]["kinds"]["count_user_id"] == "row_wise" and got[0]["kinds"]["count_movie_id"] == "table_wise"
    merged = merge_shards([g["tables"] for g in got], got[0]["replicated"])
    assert_tables(merged, want["tables"], exact=set(want["tables"]), what="click counts, 2 ranks vs 1")
    assert float(want["rows"][0]) == 2 * 64  # the second pass's two batches: every pass starts from zero
    for g in got:
        assert torch.equal(g["rows"], want["rows"])
        assert torch.equal(g["fit"], got[0]["fit"]) and torch.equal(g["hessian"], got[0]["hessian"])
    torch.testing.assert_close(got[0]["fit"], want["fit"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0]["hessian"], want["hessian"], rtol=1e-6, atol=1e-9)
    assert float((want["fit"] - torch.tensor([0.0] + [1.0] * (want["fit"].numel() - 1))).abs().max()) > 1e-3
    # the run's end: the logit shift from every rank's training rows (their bins summed), the one process's shift
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731  the buffer's float32
    assert {g["shift"] for g in got} == {f32(got[0]["calibration"])} and want["shift"] == f32(want["calibration"]) != 0
    assert got[0]["shift"] == pytest.approx(want["shift"], abs=1e-3)
    assert got[0]["auc"] == pytest.approx(want["auc"], abs=2e-4)
    assert got[0]["logloss"] == pytest.approx(want["logloss"], abs=2e-4)
