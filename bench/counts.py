"""The click counts' share of a DLRM training step (hugeembed/models/_counts.py ClickCountUpdater.add).

One process, tables in memory, the schema default (first-order biases on, click counts on): F sparse
features, a third of them bags of 0-5 ids (a bag may hold an id twice), the rest one zipf id per row, string-
hashed ids (any int64).  Each step is timed whole (forward, backward, the optimizers, the counts) and its
``add`` apart; the figures are medians over the timed steps.  Prints one JSON line.

    python bench/counts.py --batch 2048 --features 26 --steps 60

For an A/B, run it in two trees in turn (the other's copy of this file) and compare the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from hugeembed import SparseFeatures
from hugeembed.models import ClickCountUpdater, make_model
from hugeembed.optim import Adam


def batches(n: int, batch: int, features: int, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        values, lengths = [], []
        for f in range(features):
            lens = rng.integers(0, 6, batch) if f % 3 == 2 else np.ones(batch, dtype=np.int64)
            ids = rng.zipf(1.2, int(lens.sum())) % (10 ** (2 + f % 5))
            values.append(((ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(f)) >> np.uint64(1)).astype(np.int64))  # hashed-looking ids
            lengths.append(lens)
        sparse = SparseFeatures([f"c{f}" for f in range(features)], torch.from_numpy(np.concatenate(values)),
                                lengths=torch.from_numpy(np.concatenate(lengths)))
        out.append((torch.from_numpy(rng.standard_normal((batch, 8)).astype(np.float32)), sparse,
                    torch.from_numpy((rng.random(batch) < 0.3).astype(np.float32))))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--steps", type=int, default=60, help="timed steps (after 10 untimed)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, dense = make_model("dlrm", embedding_dim=16, sparse_optimizer=Adam(lr=0.01),
                              features=[f"c{f}" for f in range(args.features)], num_dense=8, combiner="mean",
                              click_counts=True, first_order=True, bottom_mlp=(64, 16), top_mlp=(64,))
    opt = torch.optim.Adam(dense, lr=1e-3)
    counts = ClickCountUpdater(model)
    data = batches(10 + args.steps, args.batch, args.features)
    step_s, add_s = [], []
    for i, (x, sparse, y) in enumerate(data):
        t0 = time.perf_counter()
        logits = model(x, sparse)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        model.embeddings.optimizer.step()
        t1 = time.perf_counter()
        counts.add(sparse, y, logits.detach())
        t2 = time.perf_counter()
        if i >= 10:
            step_s.append(t2 - t0)
            add_s.append(t2 - t1)
    step, add = statistics.median(step_s), statistics.median(add_s)
    print(json.dumps({"tree": os.getcwd(), "batch": args.batch, "features": args.features,
                      "step_ms": round(step * 1e3, 2), "add_ms": round(add * 1e3, 2),
                      "add_share": round(add / step, 3), "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
