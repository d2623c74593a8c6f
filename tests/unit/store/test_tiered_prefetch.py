"""TieredStore.prefetch used as documented (batch t+1 before step t): the rows it reads serve the
step they were read for, and training stays bit-identical to the in-memory table."""

from __future__ import annotations

import torch

from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import RowWiseAdagrad
from hugeembed.store import SLOT_METADATA_BYTES

ROWS, D, B = 4000, 4, 64


def _batch(g: torch.Generator) -> SparseFeatures:
    ids = (torch.rand(2 * B, generator=g) ** 3 * ROWS).long()  # skewed: a hot head, a long tail
    return SparseFeatures(["a", "b"], ids, lengths=torch.ones(2 * B, dtype=torch.int64))


def _collection(**tier) -> EmbeddingCollection:
    cfg = TableConfig("t", dim=D, num_rows=ROWS, features=("a", "b"), combiner="sum", **tier)
    return EmbeddingCollection([cfg], optimizer=RowWiseAdagrad(lr=0.1))


def test_prefetch_of_the_next_batch_serves_that_batch(tmp_path):
    g = torch.Generator().manual_seed(0)
    batches = [_batch(g) for _ in range(60)]
    mem = _collection()
    tier = _collection(storage_dir=str(tmp_path), memory_budget=300 * ((D + 1) * 4 + SLOT_METADATA_BYTES))
    store = tier.store("t")
    for t, b in enumerate(batches):
        if t + 1 < len(batches):
            tier.prefetch(batches[t + 1])
        for ec in (mem, tier):
            ec(b)["a"].sum().backward()
    st = store.cache_stats()
    assert st["rows_read"] + st["rows_prefetched"] > 500  # misses of rows on disk
    assert st["rows_prefetched"] > 3 * st["rows_read"], st  # most of them read ahead, for their own step
    a, e = store.export(), mem.store("t").export()
    assert torch.equal(a.rows, e.rows) and torch.equal(a.counts, e.counts) and torch.equal(a.last_step, e.last_step)
    store.close()
