"""A small model whose training uses every piece a snapshot must restore."""

from __future__ import annotations

import torch

from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adagrad, Adam


def build(dim: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    ec = EmbeddingCollection([
        TableConfig("user", dim, combiner="sum", admit_min_count=2, ttl=3, evict_interval=2,
                    optimizer=Adam(lr=0.01, mode="global")),
        TableConfig("item", dim, combiner="mean"),
        TableConfig("country", dim, num_rows=7, combiner="sum"),
    ], optimizer=Adagrad(lr=0.05), seed=seed)
    model = torch.nn.Sequential(torch.nn.Linear(3 * dim, 8), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(8, 1))
    whole = torch.nn.ModuleDict({"ec": ec, "mlp": model})
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(ec.optimizer, step_size=2, gamma=0.7)
    return ec, whole, opt, sched


def batch_for(step: int, B: int = 8) -> SparseFeatures:
    g = torch.Generator().manual_seed(1000 + step)
    rand = lambda hi: [torch.randint(0, hi, (int(k),), generator=g).tolist()
                       for k in torch.randint(1, 3, (B,), generator=g)]
    return SparseFeatures.from_lists({"user": rand(30), "item": rand(50), "country": rand(7)})


def train(ec, whole, opt, sched, steps: range) -> None:
    for step in steps:
        out = ec(batch_for(step)).concat()
        y = (torch.rand(out.shape[0]) > 0.5).float()  # uses the global RNG: resume must restore it
        logits = whole["mlp"](out).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ec.optimizer.step()
        sched.step()


def tables_equal(a, b) -> bool:
    for (_, sa), (_, sb) in zip(a.stores(), b.stores()):
        ea, eb = sa.export(), sb.export()
        for f in ("keys", "rows", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step"):
            if not torch.equal(getattr(ea, f), getattr(eb, f)):
                return False
    return True
