"""What each rank runs in the multi-rank tests (started by _harness.run_ranks).

Workers only train, save, load and record; every comparison happens in the test
process against a single-process reference, so a failure shows a plain assertion.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from hugeembed import ShardingError, SparseFeatures, StoreError
from hugeembed import checkpoint as ckpt
from hugeembed.distributed import ShardedEmbeddingCollection, ShardingPlan, new_embedding_group

from .common import dense_model, export_all, local_batch, metrics_batch, metrics_model, rare_tables, tables, train

EVAL_STEP = 100  # the batch scored in eval mode after training


def build(world: int, plan: dict, opt: str, group, timeout: float = 30.0,
          dtype: str = "float32", tiered: dict | None = None, rare: bool = False) -> ShardedEmbeddingCollection:
    """The test tables under `plan`; with `tiered` ({"dir", "cache_rows"}) every table's rows on disk under
    "dir", each rank's shard of table t caching cache_rows[t] rows (each rank makes its own subdirectory);
    `rare`: common.rare_tables (shared rows of rare ids, lr_count_scale) instead."""
    ts = rare_tables(opt) if rare else tables(opt, dtype=dtype)
    if tiered is not None:
        from hugeembed.store import SLOT_METADATA_BYTES

        ts = [dataclasses.replace(t, storage_dir=tiered["dir"], memory_budget=tiered["cache_rows"][t.name] * (
            t.row_layout(t.optimizer).row_bytes + SLOT_METADATA_BYTES)) for t in ts]
    return ShardedEmbeddingCollection(ts, plan=ShardingPlan(world, plan), process_group=group, timeout=timeout,
                                      storage_owner=None if tiered is None else "dist-test")


def run_case(rank: int, world: int, group, case: dict) -> dict:
    """Trains one sharded collection (optionally with a DDP dense model); records what to compare."""
    ec = build(world, case["plan"], case["opt"], group, dtype=case.get("dtype", "float32"), tiered=case.get("tiered"),
               rare=case.get("rare", False))
    dense = ddp = opt = None
    if case.get("dense"):
        dense = dense_model(16)
        ddp = DistributedDataParallel(dense)
        opt = torch.optim.Adam(dense.parameters(), lr=0.01)
    record: list = []
    wide = case.get("wide", False)
    first = train(ec, range(case["steps"]), rank, world, dense=ddp, dense_opt=opt, record=record, wide=wide)
    ec.eval()
    with torch.no_grad():
        out = ec(local_batch(EVAL_STEP, rank, world, wide))
        scored = torch.cat([out.concat().flatten(), out.unpooled["hist"].values.flatten()])
    return {"tables": export_all(ec), "first": first, "eval": scored, "bytes": record,
            "dense": None if dense is None else {k: v.clone() for k, v in dense.state_dict().items()},
            "step": ec.step, "tiers": ec.tier_stats()}


def run_chain_link(rank: int, world: int, group, link: dict) -> dict:
    """Optionally loads a snapshot into this world size and plan, trains some steps, optionally saves (a delta
    with ``"delta": True``), then optionally evicts each rank's dynamic rows down to ``"evict_to"``, trains on
    and saves a delta (``"then_delta": (a, b)``)."""
    ec = build(world, link["plan"], link["opt"], group, tiered=link.get("tiered"), rare=link.get("rare", False))
    out: dict = {}
    if link.get("load"):
        ckpt.load(link["load"], ec, restore_rng=False)
        out["loaded"] = export_all(ec)
        out["loaded_step"] = ec.step
    if link.get("train"):
        a, b = link["train"]
        train(ec, range(a, b), rank, world)
        out["trained"] = export_all(ec)
        out["tiers"] = ec.tier_stats()
    if link.get("save"):
        out["saved"] = str(ckpt.save(link["save"], ec, delta=link.get("delta", False)))
    if link.get("then_delta"):
        a, b = link["then_delta"]
        if link.get("evict_to") is not None:
            ec.evict(max_rows=link["evict_to"])
        train(ec, range(a, b), rank, world)
        out["delta_trained"] = export_all(ec)
        out["delta_saved"] = str(ckpt.save(link["save"], ec, delta=True))
    return out


def failure(rank: int, world: int, group, spec: dict) -> dict:
    """One rank dies (os._exit) or hangs at `step`; the others report the error and how long it took."""
    ec = build(world, spec["plan"], "adagrad", new_embedding_group("cpu", spec["timeout"]), spec["timeout"])
    dense = dense_model(16)
    ddp = DistributedDataParallel(dense)
    opt = torch.optim.Adam(dense.parameters(), lr=0.01)
    train(ec, range(spec["step"]), rank, world, dense=ddp, dense_opt=opt)
    if rank == spec["victim"]:
        if spec["mode"] == "die":
            os._exit(3)
        time.sleep(120)  # hangs: the test kills it once the others are done
    t0 = time.monotonic()
    try:
        train(ec, range(spec["step"], spec["step"] + 3), rank, world, dense=ddp, dense_opt=opt)
    except ShardingError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def held_out_metrics(rank: int, world: int, group, plan: dict, batches_per_rank: list[int]) -> dict:
    """Eval of a sharded DLRM where ranks hold different numbers of batches (aligned + merged)."""
    from hugeembed.training._distributed import aligned, empty_batch, merge_metrics
    from hugeembed.training._trainer import evaluate

    model = metrics_model(functools.partial(ShardedEmbeddingCollection, plan=ShardingPlan(world, plan),
                                            process_group=group))
    mine = [metrics_batch(i) for i in range(sum(batches_per_rank[:rank]), sum(batches_per_rank[: rank + 1]))]
    empty = empty_batch(model.embeddings.feature_names(), 3, torch.device("cpu"))
    return evaluate(model, aligned(mine, model.embeddings, empty), torch.device("cpu"),
                    merge=lambda ms: merge_metrics(model.embeddings, ms))


def weights_grad_refusal(world: int, group) -> str:
    """The sharded collection refuses per-id weights that require grad (every rank, before any exchange)."""
    ec = build(world, {t: "row_wise" for t in ("user", "item", "country", "page", "hist")}, "sgd", group)
    sf = local_batch(0, 0, world)
    sf = SparseFeatures(sf.keys(), sf.values(), offsets=sf.offsets(),
                        weights=torch.ones(sf.values().numel(), requires_grad=True), batch_size=sf.batch_size)
    try:
        ec(sf)
    except NotImplementedError as e:
        return str(e)
    return "no error"


def second_backward_refusal(rank: int, world: int, group) -> str:
    """A retained graph's second backward of a sharded step is refused on every rank, before any exchange."""
    ec = build(world, {t: "row_wise" for t in ("user", "item", "country", "page", "hist")}, "sgd", group)
    out = ec(local_batch(0, rank, world))
    loss = out.concat().sum() + out.unpooled["hist"].values.sum()
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except StoreError as e:
        return str(e)
    return "no error"


def accumulate(rank: int, world: int, group, spec: dict) -> dict:
    """Gradient accumulation (every window's forwards, then one backward) on a table with a capacity."""
    from .common import accumulation_windows, accumulation_tables, train_windows

    ec = ShardedEmbeddingCollection(accumulation_tables(spec["capacity"]), plan=ShardingPlan(world, spec["plan"]),
                                    process_group=group, timeout=30.0)
    train_windows(ec, accumulation_windows(), rank, world)
    return export_all(ec)


def main(rank: int, world: int, workdir: str, cases=(), chain=(), fail=None, broken_group=False,
         metrics=None, probe_weights_grad=False, accumulation=()) -> dict:
    group = new_embedding_group("cpu", 30.0)
    result = {"cases": {c["name"]: run_case(rank, world, group, c) for c in cases},
              "chain": [run_chain_link(rank, world, group, link) for link in chain],
              "accumulation": {a["name"]: accumulate(rank, world, group, a) for a in accumulation}}
    if probe_weights_grad:
        result["weights_grad"] = weights_grad_refusal(world, group)
        result["second_backward"] = second_backward_refusal(rank, world, group)
    if metrics is not None:
        result["metrics"] = held_out_metrics(rank, world, group, **metrics)
    if fail is not None:
        # saved first: the victim dies in failure() and the test still wants its shards
        torch.save(result, Path(workdir) / f"result.{rank}.pt")
        result["fail"] = failure(rank, world, group, fail)
    return result
