"""What each rank runs in the staleness tests (tests/dist/test_staleness.py)."""

from __future__ import annotations

import torch

from hugeembed.distributed import ShardedEmbeddingCollection, ShardingPlan, new_embedding_group
from hugeembed.nn import TableConfig
from hugeembed.optim import SGD

from .common import export_all, tables, train

PLAN = {"user": "row_wise", "item": "data_parallel", "country": "table_wise@1", "page": "row_wise",
        "hist": "row_wise"}


def linear_tables() -> list[TableConfig]:
    """Static SGD tables, one per sharding kind: their row gradients do not depend on the rows, so the
    test can compute what every staleness reads (its oracle)."""
    return [TableConfig(n, 4, num_rows=20, combiner="sum", optimizer=SGD(lr=0.5)) for n in ("a", "b", "c")]


LINEAR_PLAN = {"a": "row_wise", "b": "data_parallel", "c": "table_wise@1"}


def linear_batch(step: int, rank: int, world: int, batch: int = 8):
    from hugeembed.features import SparseFeatures

    g = torch.Generator().manual_seed(100 + step)
    feats = {n: [torch.randint(0, 20, (int(k),), generator=g).tolist()
                 for k in torch.randint(0, 4, (batch,), generator=g)] for n in ("a", "b", "c")}
    sf = SparseFeatures.from_lists(feats)
    return sf if world == 1 else sf.split(batch // world)[rank]


def linear_coef(step: int, batch: int = 8) -> torch.Tensor:
    return torch.randn(batch, 12, generator=torch.Generator().manual_seed(200 + step))


def train_linear(ec, steps: int, rank: int, world: int, ahead: int) -> list[torch.Tensor]:
    B = 8 // world
    batches = [linear_batch(s, rank, world) for s in range(steps)]
    outs, nxt = [], 0
    for i in range(steps):
        while nxt < steps and nxt <= i + ahead:
            ec.enqueue(batches[nxt])
            nxt += 1
        x = ec(batches[i]).concat()
        outs.append(x.detach().clone())
        (x * linear_coef(i)[rank * B : (rank + 1) * B]).sum().div(B).backward()
    ec.drain()
    return outs


def main(rank: int, world: int, workdir: str, steps: int = 6, stale: tuple = (2, 3),
         compensated: tuple = (), replicated: tuple = ()) -> dict:
    group = new_embedding_group("cpu", 30.0)

    def build(ts, plan, k, **kw):
        return ShardedEmbeddingCollection(ts, plan=ShardingPlan(world, plan), process_group=group, timeout=30.0,
                                          staleness=k, **kw)

    out: dict = {"full": {}, "linear": {}}
    # every table kind, admission, ttl eviction, max_norm, sequences: synchronous vs pipelined
    for k in (None, 0, 2, 2):
        ec = build(tables("adagrad"), PLAN, k)
        outputs: list = []
        train(ec, range(steps), rank, world, ahead=k, outputs=outputs)
        out["full"].setdefault(str(k), []).append({"tables": export_all(ec), "outputs": outputs, "step": ec.step})
    for k in stale:
        ec = build(linear_tables(), LINEAR_PLAN, k)
        outs = train_linear(ec, steps, rank, world, k)
        out["linear"][k] = {"outputs": outs, "tables": export_all(ec)}
    for k, r in replicated:  # the data-parallel table read R < K steps stale, twice (reproducible)
        for _ in range(2):
            ec = build(linear_tables(), LINEAR_PLAN, k, replicated_staleness=r)
            outs = train_linear(ec, steps, rank, world, k)
            out["linear"].setdefault(("R", k, r), []).append({"outputs": outs, "tables": export_all(ec)})
    for item in compensated:  # delay-compensated row gradients alone (no 1 / (1 + n) scale): (K, lambda[, R])
        k, lam, r = (*item, None)[:3]
        ec = build(linear_tables(), LINEAR_PLAN, k, stale_row_scale=False, stale_compensation=lam,
                   replicated_staleness=r)
        outs = train_linear(ec, steps, rank, world, k)
        out["linear"][tuple(item)] = {"outputs": outs, "tables": export_all(ec)}
    return out


def die(rank: int, world: int, workdir: str, victim: int = 1, at: int = 3, timeout: float = 5.0,
        broken_group: bool = True, staleness: int = 2) -> dict:
    """Rank `victim` dies after `at` steps of a run with `staleness`; the others report the error and its delay."""
    import os
    import time

    from hugeembed import ShardingError

    ec = ShardedEmbeddingCollection(tables("adagrad"), plan=ShardingPlan(world, PLAN),
                                    process_group=new_embedding_group("cpu", timeout), timeout=timeout,
                                    staleness=staleness)
    train(ec, range(at), rank, world, ahead=staleness)
    if rank == victim:
        os._exit(3)
    t0 = time.monotonic()
    try:
        train(ec, range(at, at + 6), rank, world, ahead=staleness)
    except ShardingError as e:
        out = {"error": str(e), "seconds": time.monotonic() - t0}
        if rank == 0 and world > 2:  # rank 0 hosts the store under tcp:// init: up while the others look
            time.sleep(4.0)
        return out
    return {"error": None, "seconds": time.monotonic() - t0}
