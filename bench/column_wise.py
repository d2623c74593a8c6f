"""Column-wise vs row-wise vs table-wise for one wide multi-hot table on 2 gloo ranks: bytes and step time.

Workload: one static table (--rows x --dim, SGD), each sample one bag of L ids (Zipf(1.05) over
the rows, hot ids scattered), a loss linear in the pooled vectors; each rank its half of the
same global batch.  Per pooling factor L and plan, this run measures:

  bytes/step  what one rank sends the other per training step (Comm's count: every stage), and
              the planner's estimate for the table (TableEstimate.exchange_bytes / 2 ranks)
  ms/step     median over --runs runs of --iters training steps, the plans' runs interleaved
              (run r of each plan in turn, the order reversed every other run)

    python bench/column_wise.py                    # D 128, 200 k rows, global batch 2048, L = 1, 8, 32
    python bench/column_wise.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import on_gloo_ranks, print_table  # noqa: E402

from hugeembed.features import SparseFeatures  # noqa: E402
from hugeembed.types import ShardKind  # noqa: E402

PLANS = ("row_wise", "column_wise", "table_wise@0")


def batches(rows: int, batch: int, pooling: int, n: int) -> list[SparseFeatures]:
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    probs = ranks.pow(-1.05)
    scatter = torch.randperm(rows, generator=g)  # hot ids spread over the key space
    out = []
    for _ in range(n):
        ids = scatter[torch.multinomial(probs, batch * pooling, replacement=True, generator=g)]
        out.append(SparseFeatures(["f"], ids, offsets=torch.arange(0, batch * pooling + 1, pooling), batch_size=batch))
    return out


def run(rank: int, world: int, cfg: dict) -> dict:
    from hugeembed.distributed import ShardedEmbeddingCollection, ShardingPlan, estimate_table
    from hugeembed.nn import TableConfig
    from hugeembed.optim import SGD

    torch.set_num_threads(1)
    table = TableConfig("wide", cfg["dim"], num_rows=cfg["rows"], features=("f",), combiner="sum",
                        optimizer=SGD(lr=0.01))
    colls = {p: ShardedEmbeddingCollection([table], plan=ShardingPlan(world, {"wide": p}), timeout=600)
             for p in PLANS}
    out = {}
    for L in cfg["pooling"]:
        glob = batches(cfg["rows"], cfg["batch"], L, cfg["iters"])
        mine = [b.split(cfg["batch"] // world)[rank] for b in glob]
        coef = torch.randn(cfg["batch"] // world, cfg["dim"], generator=torch.Generator().manual_seed(rank))

        def steps(ec) -> float:
            ec.comm.stats.total_remote.clear()
            t0 = time.perf_counter()
            for b in mine:
                (ec(b)["f"] * coef).sum().backward()
            return (time.perf_counter() - t0) / len(mine)

        for ec in colls.values():
            steps(ec)  # warm-up: rows touched, buffers sized
        times: dict[str, list[float]] = {p: [] for p in PLANS}
        sent = {}
        for r in range(cfg["runs"]):
            for p in (PLANS if r % 2 == 0 else PLANS[::-1]):
                times[p].append(steps(colls[p]))
                sent[p] = sum(colls[p].comm.stats.total_remote.values()) / len(mine)
        est = estimate_table(table, batch_size=cfg["batch"] // world, world_size=world,
                             ids_per_step={"wide": cfg["batch"] * L})
        out[L] = {"ms": {p: statistics.median(v) * 1e3 for p, v in times.items()}, "bytes": sent,
                  "estimate": {k.value: est.exchange_bytes(k, world) / world
                                                     for k in (ShardKind.ROW_WISE, ShardKind.COLUMN_WISE)}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=2048, help="global batch")
    p.add_argument("--pooling", type=int, nargs="+", default=[1, 8, 32], help="ids per bag")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.rows, a.batch, a.runs, a.iters = 20_000, 512, 3, 3
    cfg = {"dim": a.dim, "rows": a.rows, "batch": a.batch, "pooling": a.pooling, "runs": a.runs, "iters": a.iters}
    res = on_gloo_ranks(run, 2, cfg)
    print(f"one table D={a.dim}, {a.rows:,} rows, SGD; global batch {a.batch}, 2 gloo ranks, 1 thread each; "
          f"{os.cpu_count()} cores (load {os.getloadavg()[0]:.1f})")
    rows = []
    for L in a.pooling:
        r0 = res[0][L]
        for plan in PLANS:
            est = r0["estimate"].get(plan)
            ms = max(r[L]["ms"][plan] for r in res)  # a collective step: the slower rank's
            sent = sum(r[L]["bytes"][plan] for r in res) / 2
            rows.append([str(L), plan, f"{sent / 1e6:.3f}", f"{est / 1e6:.3f}" if est is not None else "-",
                         f"{ms:.1f}"])
    print_table(["ids/bag", "plan", "MB sent/rank/step", "planner estimate", "ms/step"], rows)


if __name__ == "__main__":
    main()
