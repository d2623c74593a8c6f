"""Sharded embedding tables over gloo: bytes exchanged, 2-rank overhead, TorchRec DMP; all in this run.

Workload: DLRM (bottom 512-256-D, top 512-512-256-1) on Criteo-26 batches, ids Zipf(1.05)
per table over Criteo-Kaggle row counts (capped; hot ids scattered), pooling factor 1,
SGD in backward for the tables and for the dense part.

  ours-1     one process, the global batch, 2 threads (dynamic tables: rows created on first sight)
  ours-2     2 gloo ranks, 1 thread each, each rank its half of the same global batch; tables
             sharded (plan "row_wise": every table row-wise; "planned": propose_plan with the
             row counts as expected_rows: small ones replicated, big ones row-wise, the rest
             table-wise); dense part under DDP
  torchrec-2 TorchRec DLRM under DistributedModelParallel, 2 gloo ranks, default planner,
             fused in-backward SGD (when torchrec + fbgemm-gpu-cpu are installed)

Bytes: what the 2 ranks send each other per step (keys + hit counts, rows back, row
gradients), measured by Comm, against what the same exchange would send without the
per-rank dedup (one key, one row and one gradient per id instead of per unique id).

    python bench/distributed.py            # d64, global batch 2048 and 8192, full Criteo-26 (33.6 M rows)
    python bench/distributed.py --quick    # d16, batch 2048, tables scaled to 5%
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import criteo_batches, criteo_rows, fmt_rate, measure, print_table  # noqa: E402

from hugeembed.distributed._row_wise import owner_index  # noqa: E402
from hugeembed._native import tune_malloc  # noqa: E402
from hugeembed.data import Batch  # noqa: E402
from hugeembed.features import SparseFeatures  # noqa: E402

LR = 0.01
NAMES = [f"C{i + 1}" for i in range(26)]


def make_batches(rows: list[int], batch: int, n: int, seed: int = 0) -> list[Batch]:
    """`n` global batches: Zipf ids per table, random dense features and labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for ids in criteo_batches(rows, batch, 1, n, a=1.05, seed=seed):
        sparse = SparseFeatures(NAMES, torch.cat(ids), offsets=torch.arange(26 * batch + 1), batch_size=batch)
        out.append(Batch(torch.rand(batch, 13, generator=g), sparse, (torch.rand(batch, generator=g) < 0.25).float()))
    return out


def local(b: Batch, rank: int, world: int) -> Batch:
    if world == 1:
        return b
    B = b.batch_size // world
    return Batch(b.dense[rank * B:(rank + 1) * B], b.sparse.split(B)[rank], b.labels[rank * B:(rank + 1) * B])


# -- the runs -----------------------------------------------------------------------------------------------


def run_ours(rank: int, world: int, cfg: dict) -> dict:
    from hugeembed.distributed import ShardedEmbeddingCollection, propose_plan
    from hugeembed.models import make_model
    from hugeembed.nn import TableConfig
    from hugeembed.optim import SGD

    rows, dim = cfg["rows"], cfg["dim"]
    static = cfg.get("static", False)
    factory = None
    if world > 1:
        tables = [TableConfig(n, dim, combiner="sum", num_rows=r if static else None) for n, r in zip(NAMES, rows)]
        if cfg["plan"] == "planned":
            plan = propose_plan(tables, world, optimizer=SGD(lr=LR), batch_size=cfg["batch"] // world,
                                expected_rows=dict(zip(NAMES, rows)))
        else:
            plan = propose_plan(tables, world, optimizer=SGD(lr=LR), overrides={n: "row_wise" for n in NAMES})
        factory = functools.partial(ShardedEmbeddingCollection, plan=plan)
    model, dense = make_model("dlrm", embedding_dim=dim, sparse_optimizer=SGD(lr=LR), seed=0,
                              collection_factory=factory, dynamic=not static,
                              cardinalities=dict(zip(NAMES, rows)) if static else None)
    step_model = torch.nn.parallel.DistributedDataParallel(model) if world > 1 and cfg["model"] == "dlrm" else model
    opt = torch.optim.SGD(dense, lr=LR)
    batches = [local(b, rank, world) for b in make_batches(rows, cfg["batch"], cfg["n_batches"])]
    ec = model.embeddings
    coef = torch.randn(cfg["batch"] // world, 26 * dim)
    stats = []

    def step(i: int) -> None:
        b = batches[i % len(batches)]
        if cfg["model"] == "dlrm":
            loss = torch.nn.functional.binary_cross_entropy_with_logits(step_model(b.dense, b.sparse), b.labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        else:  # the embedding step alone: lookup, a linear loss, backward (tables updated in it)
            (ec(b.sparse).concat() * coef).sum().backward()
        if world > 1:
            stats.append(_bytes_of_step(ec, b, rank, world, dim))

    t = measure(step, cfg["iters"], cfg["runs"])
    out = {"median_s": t.median_s, "runs": t.runs}
    if world > 1:
        out["bytes"] = stats[-len(batches):]
        secs = ec.comm.stats.seconds
        out["comm_s_per_step"] = sum(secs.values()) / len(stats)
        out["plan"] = ec.plan.describe()
    return out


def _bytes_of_step(ec, b: Batch, rank: int, world: int, dim: int) -> dict:
    """Measured bytes this rank sent to others; for row-wise tables also the same exchange without dedup."""
    sent = ec.comm.stats.remote_bytes(rank=rank)
    no_dedup = 0
    for name in NAMES:
        if ec.plan[name].kind.value != "row_wise":
            return {"sent": sent, "no_dedup": None}
        ids = b.sparse.feature(name).values
        owner = owner_index(ids, world, ec.tables[0].num_rows is not None)  # the collection's own rule
        remote = int((owner != rank).sum())
        # per id sent away: a key record (8 + 4 B) and a gradient row; and, summed over the ranks,
        # one row sent back per id another rank asked for
        no_dedup += remote * (12 + 4 * dim) + remote * 4 * dim
    return {"sent": sent, "no_dedup": no_dedup}


def run_torchrec(rank: int, world: int, cfg: dict) -> dict:
    from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    rows, dim = cfg["rows"], cfg["dim"]
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=r,
                                                            feature_names=[n]) for n, r in zip(NAMES, rows)],
                                 device=torch.device("meta"))
    if cfg["model"] == "dlrm":
        model = DLRM(ebc, dense_in_features=13, dense_arch_layer_sizes=[512, 256, dim],
                     over_arch_layer_sizes=[512, 512, 256, 1])
        apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": LR})
    else:
        model = ebc
        apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": LR})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    opt = torch.optim.SGD(dense, lr=LR) if dense else None
    coef = torch.randn(cfg["batch"] // world, 26 * dim)
    kjts = []
    for b in make_batches(rows, cfg["batch"], cfg["n_batches"]):
        lb = local(b, rank, world)
        kjts.append((lb.dense, KeyedJaggedTensor.from_lengths_sync(NAMES, lb.sparse.values(), lb.sparse.lengths()),
                     lb.labels))

    def step(i: int) -> None:
        dense, kjt, labels = kjts[i % len(kjts)]
        if cfg["model"] == "dlrm":
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(1), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        else:
            (dmp(kjt).values() * coef).sum().backward()

    t = measure(step, cfg["iters"], cfg["runs"])
    return {"median_s": t.median_s, "runs": t.runs}


def _rank_main(rank: int, world: int, port: int, job: str, cfg: dict, out: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.get("threads", 1))
    tune_malloc()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    res = {"ours": run_ours, "torchrec": run_torchrec, "costs": run_costs}[job](rank, world, cfg)
    torch.save(res, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def spawn(job: str, world: int, cfg: dict) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "res")
        mp.spawn(_rank_main, args=(world, port, job, cfg, out), nprocs=world, join=True)
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def in_process(job: str, cfg: dict) -> dict:
    """One rank in this process (gloo world of 1 for TorchRec; ours needs no group)."""
    torch.set_num_threads(cfg["threads"])
    if job == "ours":
        return run_ours(0, 1, cfg)
    return spawn(job, 1, cfg)[0]


def run_costs(rank: int, world: int, cfg: dict) -> dict:
    """The per-collective costs of the cost model: all-to-all latency and bandwidth, DDP's all-reduce."""
    import torch.distributed as dist

    from hugeembed.distributed import Comm, new_embedding_group

    comm = Comm(new_embedding_group("cpu"))
    small = torch.zeros(8 * world, dtype=torch.uint8)
    big = torch.zeros(cfg["big_bytes"] * world, dtype=torch.uint8)
    grads = torch.zeros(cfg["dense_params"])

    def a2a(buf):
        n = buf.numel() // world
        return lambda i: comm.all_to_all_bytes("cost", buf, [n] * world, [n] * world)

    lat = measure(a2a(small), 50, 5).median_s
    bw = measure(a2a(big), 2, 5).median_s
    ar = measure(lambda i: dist.all_reduce(grads), 3, 5).median_s
    return {"alpha_s": lat, "beta_Bps": cfg["big_bytes"] * (world - 1) / world * world / bw, "allreduce_s": ar}


def unique_per_rank(batches: list[Batch], world: int) -> float:
    """Mean over ranks and batches of the unique ids (summed over tables) in a rank's slice."""
    tot = 0
    for b in batches:
        for r in range(world):
            lb = local(b, r, world)
            tot += sum(lb.sparse.feature(n).values.unique().numel() for n in NAMES)
    return tot / (len(batches) * world)


def cost_model(args, rows: list[int], batch: int, measured: dict[int, float]) -> None:
    """Step time vs world size from measured per-sample, per-byte and per-collective costs."""
    from hugeembed.models import make_model
    from hugeembed.optim import SGD

    dim = args.dim
    model, dense = make_model("dlrm", embedding_dim=dim, sparse_optimizer=SGD(lr=LR), seed=0)
    n_dense = sum(p.numel() for p in dense)
    costs = spawn("costs", 2, {"threads": 1, "big_bytes": 8 << 20, "dense_params": n_dense})[0]
    batches = make_batches(rows, batch, 3, seed=1)
    torch.set_num_threads(1)
    out = []
    for W in (1, 2, 4, 8):
        B = batch // W
        cfg = dict(rows=rows, dim=dim, batch=B, n_batches=args.runs * args.iters + 3, runs=args.runs,
                   iters=args.iters, threads=1, plan="row_wise", model="dlrm")
        compute = run_ours(0, 1, cfg)["median_s"]  # one rank's own work: its slice, its keys
        u = unique_per_rank(batches, W)
        # a rank sends, per unique id of another rank's shard: key + count (12 B) and its gradient (4D);
        # and one row (4D) for each id another rank asks it for (as many, on average)
        nbytes = u * (W - 1) / W * (12 + 8 * dim)
        comm = (4 * costs["alpha_s"] + nbytes / costs["beta_Bps"] + costs["allreduce_s"]) if W > 1 else 0.0
        t = compute + comm
        seen = measured.get(W)
        out.append([str(W), str(B), f"{u:,.0f}", f"{nbytes / 1e6:.2f} MB", f"{compute * 1e3:.1f} ms",
                    f"{comm * 1e3:.1f} ms", f"{t * 1e3:.1f} ms", f"{fmt_rate(batch / t)}/s",
                    f"{seen * 1e3:.1f} ms" if seen else "-"])
    print(f"# cost model, DLRM d{dim}, global batch {batch}, one core per rank: gloo all-to-all latency "
          f"alpha = {costs['alpha_s'] * 1e6:.0f} us, bandwidth beta = {costs['beta_Bps'] / 1e9:.2f} GB/s, "
          f"DDP all-reduce of {n_dense / 1e6:.2f} M dense params = {costs['allreduce_s'] * 1e3:.1f} ms")
    print("# T(W) = compute(B/W, 1 core) + 4 alpha + bytes(W)/beta + allreduce")
    print_table(["W", "batch/rank", "unique ids/rank", "bytes sent/rank", "compute", "comm", "T(W) model",
                 "global samples/s", "T measured (2 ranks here share 2 cores)"], out)
    print()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[2048, 8192], help="global batch sizes")
    p.add_argument("--cap", type=int, default=10_000_000, help="rows per table at most")
    p.add_argument("--scale", type=float, default=1.0, help="scale every table's rows (quick runs)")
    p.add_argument("--plans", nargs="+", default=["row_wise", "planned"])
    p.add_argument("--models", nargs="+", default=["emb", "dlrm"], help="emb: the embedding step alone")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--static", action="store_true", help="static tables of the row counts (as TorchRec's), "
                   "not dynamic hash tables")
    p.add_argument("--no-torchrec", action="store_true")
    p.add_argument("--no-cost-model", action="store_true")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.batches, args.scale, args.runs, args.iters = 16, [2048], 0.05, 3, 2
    rows = criteo_rows(args.cap, args.scale)
    cores = os.cpu_count() or 2
    print(f"# {'static' if args.static else 'dynamic'} tables d{args.dim}, Criteo-26 ({sum(rows) / 1e6:.1f} M rows), Zipf(1.05), pooling 1, SGD; {cores} cores: "
          f"1 process x {cores} threads vs 2 gloo ranks x {max(1, cores // 2)} thread(s); medians of {args.runs} runs")
    try:
        import torchrec  # noqa: F401

        have_torchrec = not args.no_torchrec
    except Exception as e:  # not installed / not loadable here: reported, not fatal
        print(f"# torchrec not usable: {type(e).__name__}: {e}", file=sys.stderr)
        have_torchrec = False
    table = []
    measured: dict[int, float] = {}
    for model in args.models:
        for batch in args.batches:
            cfg = dict(rows=rows, dim=args.dim, batch=batch, n_batches=args.runs * args.iters + 3, runs=args.runs,
                       iters=args.iters, threads=cores, plan="row_wise", model=model, static=args.static)
            cfg2 = {**cfg, "threads": max(1, cores // 2)}
            rate = {"ours-1": batch / in_process("ours", cfg)["median_s"]}
            tag = f"{model} b{batch}"
            for plan in args.plans:
                res = spawn("ours", 2, {**cfg2, "plan": plan})
                t2 = max(r["median_s"] for r in res)
                if model == "dlrm" and plan == "row_wise" and batch == args.batches[0]:
                    measured[2] = t2
                rate[plan] = batch / t2
                steps = range(len(res[0]["bytes"]))
                sent = [sum(r["bytes"][i]["sent"] for r in res) for i in steps]
                nod_txt = saves = "-"
                if res[0]["bytes"][0]["no_dedup"] is not None:
                    nod = [sum(r["bytes"][i]["no_dedup"] for r in res) for i in steps]
                    nod_txt = f"{statistics.median(nod) / 1e6:.2f} MB"
                    saves = f"{statistics.median(n / x for n, x in zip(nod, sent)):.2f}x"
                comm = statistics.median(r["comm_s_per_step"] for r in res)
                table.append([tag, f"ours-2 {plan}", f"{fmt_rate(rate[plan])}/s",
                              f"{rate['ours-1'] / rate[plan]:.2f}x", f"{statistics.median(sent) / 1e6:.2f} MB",
                              nod_txt, saves, f"{comm * 1e3:.1f} ms"])
            table.append([tag, "ours-1", f"{fmt_rate(rate['ours-1'])}/s", "1.00x", "", "", "", ""])
            for world in (1, 2) if have_torchrec else ():
                try:
                    tr = spawn("torchrec", world, cfg if world == 1 else cfg2)
                    r_tr = batch / max(r["median_s"] for r in tr)
                    ours = rate["ours-1"] if world == 1 else max(rate[p] for p in args.plans)
                    table.append([tag, f"torchrec-{world}", f"{fmt_rate(r_tr)}/s", "", "", "", "",
                                  f"ours-{world} / torchrec-{world} = {ours / r_tr:.2f}x"])
                except Exception as e:
                    print(f"# torchrec-{world} {tag} failed: {type(e).__name__}: {e}", file=sys.stderr)
            print_table(["workload", "case", "samples/s", "step time vs ours-1", "bytes/step (dedup)",
                         "bytes/step (no dedup)", "dedup saves", "in collectives/step (or ratio)"], table)
            print(flush=True)
    if not args.no_cost_model:
        cost_model(args, rows, args.batches[0], measured)
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"# {time.perf_counter() - t0:.0f} s")
    sys.exit(rc)
