"""Tiny collections and workloads for the snapshot-delta tests: dynamic tables that evict (capacity, ttl),
admit after two sightings (pending keys) or by chance, a static table, and every optimizer family."""

from __future__ import annotations

import torch

from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import FTRL, SGD, Adagrad, Adam

FIELDS = ("keys", "rows", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step")

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1),
    "adam_lazy": lambda: Adam(lr=0.01),
    "adam_global": lambda: Adam(lr=0.01, mode="global"),
    "ftrl": lambda: FTRL(lr=0.1, l1=0.01),
}
POOL = 12  # ids of the dynamic tables: few, so evicted ids come back
BATCH = 3


def make(opt: str, seed: int = 0, cap: int = 6) -> EmbeddingCollection:
    return EmbeddingCollection([
        TableConfig("cap", 3, combiner="sum", capacity=cap, admit_min_count=2, max_pending=5),
        TableConfig("ttl", 3, combiner="mean", ttl=2, evict_interval=1),
        TableConfig("prob", 3, combiner="sum", admit_probability=0.5),  # unsampled sightings change nothing
        TableConfig("fixed", 3, num_rows=5, combiner="sum"),
    ], optimizer=OPTIMIZERS[opt](), seed=seed)


def batch(ids: dict[str, list[list[int]]]) -> SparseFeatures:
    return SparseFeatures.from_lists(ids)


def step(ec: EmbeddingCollection, ids: dict[str, list[list[int]]]) -> None:
    """One training step; the loss weighs every output differently, so rows get different gradients."""
    out = ec(batch(ids)).concat()
    weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    (out * weights).sum().backward()
    ec.optimizer.step()


def seeded_ids(seed: int, hi: int = POOL) -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    bags = lambda top: [torch.randint(0, top, (int(n),), generator=g).tolist()  # noqa: E731
                        for n in torch.randint(1, 3, (BATCH,), generator=g)]
    return {"cap": bags(hi), "ttl": bags(hi), "prob": bags(hi), "fixed": bags(5)}


def exports(ec: EmbeddingCollection) -> dict[str, dict[str, torch.Tensor]]:
    """Every table's contents (copies), keys ascending."""
    out = {}
    for cfg, store in ec.stores():
        e = store.export()
        out[cfg.name] = {f: getattr(e, f).clone() for f in FIELDS}
    return out


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for table in a:
        for f in FIELDS:
            x, y = a[table][f], b[table][f]
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{what}: table {table!r} {f}"
