"""Where one training step's time goes: torch.profiler over DLRM steps on synthetic Criteo data.

Trains a DLRM (dynamic tables by default) for some warm-up steps, then profiles a few steps
and prints the ops with the most self time on the host and, on a GPU, on the device, plus the
step time with and without the embedding layer's work.

    python bench/step_profile.py                       # cpu
    python bench/step_profile.py --device cuda --static
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import sync  # noqa: E402

from hugeembed.data import Batch, SyntheticConfig, SyntheticCriteo  # noqa: E402
from hugeembed.features import SparseFeatures  # noqa: E402
from hugeembed.models import make_model  # noqa: E402
from hugeembed.optim import Adagrad  # noqa: E402


def _fold(sf: SparseFeatures, cards: list[int]) -> SparseFeatures:
    values = torch.cat([sf.feature(k).values % c for k, c in zip(sf.keys(), cards)])
    return SparseFeatures(list(sf.keys()), values, offsets=sf.offsets(), batch_size=sf.batch_size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--static", action="store_true", help="static tables of the data's cardinalities")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    gen = SyntheticCriteo(SyntheticConfig(seed=0, max_cardinality=1_000_000))
    n = args.warmup + args.steps
    batches = [Batch.from_block(gen.rows(i * args.batch, args.batch)) for i in range(n)]
    kw = {}
    if args.static:  # the raw ids are hashes: fold them into each feature's cardinality
        cards = list(gen.cardinalities)
        kw = {"dynamic": False, "cardinalities": cards}
        batches = [dataclasses.replace(b, sparse=_fold(b.sparse, cards)) for b in batches]
    batches = [b.to(args.device) for b in batches]
    model, dense = make_model("dlrm", embedding_dim=args.dim, sparse_optimizer=Adagrad(lr=0.05), seed=0,
                              device=args.device, **kw)
    opt = torch.optim.Adagrad(dense, lr=0.01)

    def step(b):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def lookup_only(b):
        model.embeddings(b.sparse).stacked().sum().backward()

    for b in batches[: args.warmup]:
        step(b)
    times = {}
    for name, fn in (("step", step), ("embeddings fwd+bwd", lookup_only)):
        ts = []
        for b in batches[args.warmup:]:
            sync()
            t0 = time.perf_counter()
            fn(b)
            sync()
            ts.append(time.perf_counter() - t0)
        times[name] = statistics.median(ts)
    kind = "static" if args.static else "dynamic"
    print(f"# DLRM d{args.dim}, batch {args.batch}, {kind} tables, {args.device}, torch {torch.__version__}")
    for name, t in times.items():
        print(f"{name}: {t * 1e3:.2f} ms median ({args.batch / t / 1e3:.0f} k samples/s)", flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device != "cpu" else [])
    with profile(activities=acts) as prof:
        for b in batches[args.warmup:]:
            step(b)
        sync()
    sort = "self_cuda_time_total" if args.device != "cpu" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top))
    if args.device != "cpu":
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
