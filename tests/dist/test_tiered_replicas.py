"""Tables on disk with the default plan, which replicates the small tables it sizes from the data: a replica
needs its cache on every rank, so where the budget cannot hold them the trainer shards them instead
(training/_distributed.py::fit_replicas), and fails only where the plan without the sizes would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import islice

import pytest
import torch

from hugeembed import checkpoint as ckpt
from hugeembed.nn import EmbeddingCollection
from hugeembed.training import TrainConfig
from hugeembed.training._build import build_model
from hugeembed.training._distributed import fit_replicas, run_plan
from hugeembed.training._sources import make_source, run_schema
from hugeembed.training._tiers import BudgetError, shard_traffic, split_memory_budget_per_rank
from hugeembed.types import ShardKind

from ._harness import ROOT

CFG = TrainConfig(batch_size=64, steps=4, eval_rows=256)  # the CLI's defaults otherwise (dim 16, Adam, sized)


def _tables_and_optimizer(cfg: TrainConfig):
    got = {}

    def capture(tables, *, optimizer, **kw):
        got["tables"], got["optimizer"] = tables, optimizer
        return EmbeddingCollection(tables, optimizer=optimizer, **kw)

    build_model(cfg, torch.device("meta"), 1, run_schema(cfg), collection_factory=capture)
    return got["tables"], got["optimizer"]


def _split(cfg: TrainConfig, budget: int):
    """tiers(tables, plan, optimizer) as the trainer's: each rank's caches from the first 4 global batches."""
    batches = list(islice(make_source(cfg.replace(batch_size=2 * cfg.batch_size)).train_batches(0), 4))

    def tiers(tables, plan, optimizer):
        row_bytes = {t.name: t.row_layout(optimizer).row_bytes for t in tables}
        return split_memory_budget_per_rank(tables, plan, budget, shard_traffic(tables, batches, plan), row_bytes)

    return tiers


def _replicated(plan) -> set[str]:
    return {n for n, p in plan.placements.items() if p.kind is ShardKind.DATA_PARALLEL}


def test_replicas_that_do_not_fit_the_budget_are_sharded_largest_floor_first():
    tables, opt = _tables_and_optimizer(CFG)
    sized = run_plan(CFG, 2, tables, opt)
    unsized = run_plan(CFG.replace(size_from_data=False), 2, tables, opt)
    assert len(_replicated(sized)) == 16 and _replicated(unsized) == set()
    roomy = _split(CFG, 10 << 20)
    assert fit_replicas(CFG, 2, tables, opt, roomy)[0] == sized  # fits: the default plan as it is
    tight = _split(CFG, 400_000)
    with pytest.raises(BudgetError):
        tight(tables, sized, opt)  # the failure users hit: the replicas' caches on every rank
    tight(tables, unsized, opt)  # while every table sharded fits
    plan, share = fit_replicas(CFG, 2, tables, opt, tight)
    kept = _replicated(plan)
    assert kept < _replicated(sized) and kept  # some replicas sharded, not all
    assert share == tight(tables, plan, opt)
    for name, p in plan.placements.items():  # each table as the sized plan or the unsized one places it
        assert p in (sized[name], unsized[name]), name
    # the sharded ones are the replicas with the most rows a batch reads (largest floors), so a replica
    # kept never reads more distinct ids per batch than one sharded
    traffic = shard_traffic(tables, list(islice(make_source(CFG.replace(batch_size=128)).train_batches(0), 4)),
                            sized)[0]
    moved = _replicated(sized) - kept
    assert max(traffic[n] for n in kept) <= min(traffic[n] for n in moved)


def test_a_budget_nothing_fits_names_the_tables_it_sharded_and_overrides_stay_replicated():
    tables, opt = _tables_and_optimizer(CFG)
    with pytest.raises(BudgetError, match=r"rank 0: memory-budget 250000 B cannot hold two batches .*"
                                          r"\(already sharding the tables C\d+, .* instead of replicating them"):
        fit_replicas(CFG, 2, tables, opt, _split(CFG, 250_000))
    with pytest.raises(BudgetError):  # as the plan without sizes does
        fit_replicas(CFG.replace(size_from_data=False), 2, tables, opt, _split(CFG, 250_000))
    pinned = CFG.replace(sharding=("C13=data_parallel",))  # sharded at 450 kB without the pin (after C11, C18)
    plan, _ = fit_replicas(pinned, 2, tables, opt, _split(CFG, 450_000))
    assert plan["C13"].kind is ShardKind.DATA_PARALLEL


@pytest.mark.dist
@pytest.mark.slow
def test_cli_two_ranks_tables_on_disk_tight_budget_shards_replicas_instead_of_failing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(budget: int, name: str):
        cmd = [sys.executable, "-m", "hugeembed", "train", "--nproc", "2", "--batch-size", "64", "--steps", "4",
               "--eval-rows", "256", "--quiet", "--memory-budget", str(budget), "--storage-dir", str(tmp_path / name),
               "--checkpoint-dir", str(tmp_path / f"ck-{name}"), "--summary-json", str(tmp_path / f"{name}.json")]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)

    done = run(400_000, "fits")  # failed before: "rank 0: memory-budget 400000 B cannot hold two batches..."
    assert done.returncode == 0, done.stdout + done.stderr
    plan = ckpt.read_manifest(tmp_path / "ck-fits")["plan"]["tables"]
    kinds = {p["kind"] for p in plan.values()}
    assert kinds == {"data_parallel", "row_wise"}
    summary = json.loads((tmp_path / "fits.json").read_text())
    assert summary["steps"] == 4 and set(summary["tiers"]) == {f"C{i}" for i in range(1, 27)}
    done = run(250_000, "short")
    assert done.returncode == 2
    assert "cannot hold two batches of rows of every table" in done.stderr
    assert "instead of replicating them on every rank" in done.stderr
