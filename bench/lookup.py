"""Fused lookup benchmark: Criteo-26 tables, batch 8192, Zipf ids, forward and training step.

Compares, in the same run:
  * ours      hugeembed FusedEmbeddingLookup (static tables), SGD applied in backward by the row hook
  * coll      hugeembed EmbeddingCollection (static tables, hugeembed.optim.SGD): the module users train,
              whose SGD on triton is fused into the backward (its own tables: twice the memory)
  * ebag      a loop of 26 torch.nn.EmbeddingBag(sparse=True) + torch.optim.SGD
  * fbgemm    FBGEMM SplitTableBatchedEmbeddingBagsCodegen, EXACT_SGD fused into backward (if installed)

Prints samples/s, ids/s and the ratio of ours to each reference (median of --runs runs).

    python bench/lookup.py                      # full: dims 16 64 128, pooling 1 and 20
    python bench/lookup.py --quick              # 1/20 of the rows, d16 only, a few seconds
    python bench/lookup.py --device cuda        # on a GPU: ours (torch backend) vs EmbeddingBag on CUDA
                                                # (FBGEMM's CUDA TBE when fbgemm_gpu with CUDA is installed)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (criteo_batches, criteo_rows, fbgemm_available, fmt_rate, free_memory, measure,  # noqa: E402
                     measure_together, print_table)

from hugeembed._native import tune_malloc  # noqa: E402
from hugeembed.features import SparseFeatures  # noqa: E402
from hugeembed.functional import FeatureSpec, FusedEmbeddingLookup, TableSpec  # noqa: E402
from hugeembed.store import allocate_rows  # noqa: E402

LR = 0.01


def make_tables(rows: list[int], dim: int, huge_pages: bool = True, device: str = "cpu") -> list[torch.Tensor]:
    """Our tables (also wrapped, without a copy, by the EmbeddingBag reference)."""
    if device != "cpu":
        return [torch.empty(n, dim, device=device).uniform_(-0.05, 0.05) for n in rows]
    alloc = allocate_rows if huge_pages else (lambda n, d: torch.empty(n, d))
    return [alloc(n, dim).uniform_(-0.05, 0.05) for n in rows]


def to_features(ids: list[torch.Tensor], batch: int, pooling: int, cls=SparseFeatures) -> SparseFeatures:
    lengths = torch.full((len(ids) * batch,), pooling, dtype=torch.int64, device=ids[0].device)
    return cls([f"C{t + 1}" for t in range(len(ids))], torch.cat(ids), lengths=lengths)


def ours_step(tables, batches, batch, pooling, train: bool, backend: str = "auto", pkg=None):
    """One iteration of ours: step(i) runs batch i (a forward, or a training step).

    `pkg`: another checkout's hugeembed package (bench/ab_lookup.py), whose classes run instead."""
    if pkg is None:
        spec_cls, feat_cls, lookup_cls, sf_cls, sgd = TableSpec, FeatureSpec, FusedEmbeddingLookup, SparseFeatures, None
    else:
        import importlib

        fn, ft = (importlib.import_module(f"{pkg.__name__}.{m}") for m in ("functional", "features"))
        spec_cls, feat_cls, lookup_cls, sf_cls = fn.TableSpec, fn.FeatureSpec, fn.FusedEmbeddingLookup, ft.SparseFeatures
        rule = importlib.import_module(f"{pkg.__name__}.optim").SGD(lr=LR)
        sgd = lambda t, slots, g: rule.apply(tables[t], slots, g, lr=LR, step=1)  # noqa: E731
    dim, device = tables[0].size(1), tables[0].device
    specs = [spec_cls(f"t{t}", dim, num_rows=w.size(0)) for t, w in enumerate(tables)]
    feats = [feat_cls(f"C{t + 1}", f"t{t}", combiner="sum") for t in range(len(tables))]
    lookup = lookup_cls(specs, feats, backend=backend)
    sfs = [to_features(b, batch, pooling, sf_cls) for b in batches]
    grad = torch.randn(batch, len(tables), dim, device=device)
    sgd = sgd or _sgd_hook(tables)
    anchor = torch.zeros(0, requires_grad=True, device=device)

    def step(i):
        sf = sfs[i % len(sfs)]
        if train:
            prep = lookup.prepare(sf, tables)
            out = lookup.lookup(prep, tables, lookup.static_slots(prep), params=[anchor], row_grad_hook=sgd)
            out.stacked().backward(grad)
        else:
            with torch.no_grad():
                lookup(tables, sf)

    return step


def coll_step(tables, batches, batch, pooling, train: bool):
    """One iteration of the EmbeddingCollection (tables of the same shapes, its own rows), as ours_step."""
    from hugeembed.nn import EmbeddingCollection, TableConfig
    from hugeembed.optim import SGD

    dim, device = tables[0].size(1), tables[0].device
    coll = EmbeddingCollection([TableConfig(f"C{t + 1}", dim, num_rows=w.size(0), combiner="sum")
                                for t, w in enumerate(tables)], optimizer=SGD(lr=LR), device=device)
    sfs = [to_features(b, batch, pooling) for b in batches]
    grad = torch.randn(batch, len(tables), dim, device=device)

    def step(i):
        sf = sfs[i % len(sfs)]
        if train:
            coll(sf).stacked().backward(grad)
        else:
            with torch.no_grad():
                coll(sf)

    return step


def _step_of(impl, tables, batches, batch, pooling, train):
    if impl == "ebag":
        return ebag_step(tables, batches, batch, pooling, train)
    if impl == "coll":
        return coll_step(tables, batches, batch, pooling, train)
    return ours_step(tables, batches, batch, pooling, train, backend="torch" if impl == "ours-torch" else "auto")


def _sgd_hook(tables):
    try:
        from hugeembed.optim import SGD

        rule = SGD(lr=LR)
        return lambda t, slots, g: rule.apply(tables[t], slots, g, lr=LR, step=1)
    except ImportError:  # before the optim package exists: the same update with torch
        return lambda t, slots, g: tables[t].index_add_(0, slots, g, alpha=-LR)


def ebag_step(tables, batches, batch, pooling, train: bool):
    """One iteration of the EmbeddingBag loop, as ours_step."""
    bags = [torch.nn.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum", sparse=True) for w in tables]
    opt = torch.optim.SGD([b.weight for b in bags], lr=LR)
    device = tables[0].device
    offsets = torch.arange(0, batch * pooling, pooling, device=device)
    grad = torch.randn(batch, len(tables) * tables[0].size(1), device=device)

    def step(i):
        ids = batches[i % len(batches)]
        if train:
            out = torch.cat([bag(x, offsets) for bag, x in zip(bags, ids)], dim=1)
            opt.zero_grad(set_to_none=True)
            out.backward(grad)
            opt.step()
        else:
            with torch.no_grad():
                torch.cat([bag(x, offsets) for bag, x in zip(bags, ids)], dim=1)

    return step


def bench_fbgemm(rows, dim, batches, batch, pooling, iters, runs, train: bool, seconds: float = 1.0):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                        SplitTableBatchedEmbeddingBagsCodegen)

    device = batches[0][0].device
    where = ((EmbeddingLocation.HOST, ComputeDevice.CPU) if device.type == "cpu"
             else (EmbeddingLocation.DEVICE, ComputeDevice.CUDA))
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, dim, *where) for n in rows],
        optimizer=OptimType.EXACT_SGD, learning_rate=LR, pooling_mode=PoolingMode.SUM,
        **({} if device.type == "cpu" else {"device": device}))
    indices = [torch.cat(b) for b in batches]
    offsets = torch.arange(0, len(rows) * batch * pooling + 1, pooling, device=device)
    grad = torch.randn(batch, len(rows) * dim, device=device)

    def step(i):
        idx = indices[i % len(indices)]
        if train:
            tbe(idx, offsets).backward(grad)
        else:
            with torch.no_grad():
                tbe(idx, offsets)

    return measure(step, iters, runs, seconds=seconds)  # the TBE and its tables are freed on return


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--pooling", type=int, nargs="+", default=[1, 20])
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--row-scale", type=float, default=1.0, help="scale the Criteo row counts (quick runs)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--iters", type=int, default=0,
                   help="iterations per run (default: as many as take --seconds, after a warm-up as long)")
    p.add_argument("--seconds", type=float, default=1.0, help="length of a run and of the warm-up (default 1)")
    p.add_argument("--impls", nargs="+", default=["ours", "ebag", "fbgemm"],
                   choices=["ours", "coll", "ours-torch", "ebag", "fbgemm"],
                   help="ours-torch: ours on the torch reference backend (on a GPU: the path before triton)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--quick", action="store_true", help="d16 P1, 1/20 of the rows, 3 runs")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: every implementation on the GPU")
    p.add_argument("--no-hugepages", action="store_true",
                   help="plain 4 KiB pages for our tables (and the EmbeddingBag loop, which shares them)")
    args = p.parse_args(argv)
    if args.quick:
        args.dims, args.pooling, args.row_scale, args.runs = [16], [1], 0.05, 3
        args.seconds = min(args.seconds, 0.2)
    torch.set_num_threads(args.threads)
    tuned = tune_malloc()  # for every implementation alike: they share this process
    gpu = args.device != "cpu"
    impls = [i for i in args.impls if i != "fbgemm" or fbgemm_available(cuda=gpu)]
    rows = criteo_rows(scale=args.row_scale)
    where = torch.cuda.get_device_name(args.device) if gpu else f"threads {args.threads}"
    print(f"# Criteo-26: {sum(rows) / 1e6:.1f} M rows, batch {args.batch}, {where}, "
          f"torch {torch.__version__}, runs {args.runs} (median), malloc tuned: {tuned}, "
          f"huge pages for ours+ebag tables: {not args.no_hugepages and not gpu}, "
          f"FBGEMM TBE: {'fbgemm' in impls}")
    results = []
    for pooling in args.pooling:
        batches = criteo_batches(rows, args.batch, pooling, n_batches=4)
        batches = [[ids.to(args.device) for ids in b] for b in batches]
        ids_per_batch = args.batch * pooling * len(rows)
        for dim in args.dims:
            iters = args.iters  # 0: about --seconds per run, after as long a warm-up (_common.measure)
            rates = {}
            tables = (make_tables(rows, dim, not args.no_hugepages, args.device)
                      if set(impls) - {"fbgemm"} else None)
            for train in (False, True):
                # ours and the EmbeddingBag loop share the tables: their runs interleave
                steps = {impl: _step_of(impl, tables, batches, args.batch, pooling, train)
                         for impl in impls if impl != "fbgemm"}
                for impl, t in measure_together(steps, iters, args.runs, seconds=args.seconds).items():
                    rates[(impl, train)] = t.rate(args.batch)
                del steps
            del tables
            free_memory()
            if "fbgemm" in impls:
                for train in (False, True):
                    t = bench_fbgemm(rows, dim, batches, args.batch, pooling, iters, args.runs, train, args.seconds)
                    rates[("fbgemm", train)] = t.rate(args.batch)
            for train in (False, True):
                ours = rates.get(("ours", train))
                row = [f"d{dim} P{pooling}", "fwd+bwd+SGD" if train else "fwd"]
                for impl in ("ours", "coll", "ours-torch", "ebag", "fbgemm"):
                    r = rates.get((impl, train))
                    row.append(f"{fmt_rate(r)}/s ({fmt_rate(r * ids_per_batch / args.batch)}ids/s)" if r else "-")
                for ref in ("ours-torch", "ebag", "fbgemm"):
                    r = rates.get((ref, train))
                    row.append(f"{ours / r:.2f}x" if (r and ours) else "-")
                coll, r = rates.get(("coll", train)), rates.get(("ebag", train))
                row.append(f"{coll / r:.2f}x" if (r and coll) else "-")
                results.append(row)
            print_table(["case", "mode", "ours samples/s", "EmbeddingCollection", "ours (torch backend)",
                         "EmbeddingBag loop", "FBGEMM TBE", "ours/torch-backend", "ours/ebag", "ours/fbgemm",
                         "collection/ebag"], results)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
