"""The native C++ hash store against its plain-PyTorch twin: same slots, rows, counts
and evictions over a long seeded workload, and each backend reads the bucket layout
the other one wrote (they share one memory layout)."""

from __future__ import annotations

import pytest
import torch

from hugeembed import _native
from hugeembed.store import HashStore, TruncatedNormal

pytestmark = pytest.mark.skipif(not _native.available(), reason="native kernels not built")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.numel() == 0:
        return 0
    return int((a.contiguous().view(torch.int32).long() - b.contiguous().view(torch.int32).long()).abs().max())


def _workload(seed: int):
    """Batches of unique keys: a hot pool, a long tail, the int64 extremes, fresh keys."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(-(2**63), 2**63 - 1, (30000,), generator=g, dtype=torch.int64)
    pool[:4] = torch.tensor([-(2**63), 2**63 - 1, 0, -1])
    for step in range(12):
        hot = pool[torch.randint(0, 200, (300,), generator=g)]
        tail = pool[torch.randint(0, pool.numel(), (3000,), generator=g)]
        keys = torch.cat([hot, tail, pool[:4]]).unique()
        keys = keys[torch.randperm(keys.numel(), generator=g)]
        counts = torch.randint(1, 4, (keys.numel(),), generator=g)
        yield step, keys, counts


@pytest.mark.parametrize("admit, capacity", [(1, None), (3, None), (2, 2500)])
@pytest.mark.slow
def test_native_equals_torch_over_a_workload(admit, capacity):
    kw = dict(initializer=TruncatedNormal(0.0, 0.1), init_state=lambda s: s.fill_(1.0), admit_min_count=admit,
              capacity=capacity, eviction_policy="lru", seed=5)
    a = HashStore("p", 8, 2, backend="native", **kw)
    b = HashStore("p", 8, 2, backend="torch", **kw)
    for step, keys, counts in _workload(admit):
        sa, sb = a.find_or_insert(keys, step, counts), b.find_or_insert(keys, step, counts)
        assert torch.equal(sa, sb)
        grad = torch.randn(keys.numel(), 10)
        a.scatter(sa, a.gather(sa) - 0.1 * grad)
        b.scatter(sb, b.gather(sb) - 0.1 * grad)
        if step % 4 == 3:
            assert a.evict(step, ttl=2, max_rows=2000, policy="lfu", protect=sa) == \
                b.evict(step, ttl=2, max_rows=2000, policy="lfu", protect=sb)
        probe = keys[: keys.numel() // 2]
        assert torch.equal(a.find(probe), b.find(probe))
    ea, eb = a.export(), b.export()
    for f in ("keys", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step"):
        assert torch.equal(getattr(ea, f), getattr(eb, f)), f
    assert _ulps(ea.rows, eb.rows) <= 1
    assert len(a) == len(b) > 0 and a.num_pending == b.num_pending


def test_each_backend_reads_the_other_layout():
    keys = torch.randint(-(2**63), 2**63 - 1, (20000,), dtype=torch.int64).unique()
    for writer, reader in (("native", "torch"), ("torch", "native")):
        s = HashStore("p", 4, backend=writer)
        slots = torch.cat([s.find_or_insert(part, 0) for part in keys.split(3000)])
        s.evict(1, max_rows=15000, policy="lfu")  # backward-shift (native) or rebuild (torch) deletions
        before = s.find(keys)
        s.use_backend(reader)
        assert torch.equal(s.find(keys), before)
        kept = before >= 0
        assert torch.equal(before[kept], slots[kept]) and int(kept.sum()) == 15000
        fresh = torch.arange(10**6, 10**6 + 2000)
        new_slots = s.find_or_insert(fresh, 2)
        s.use_backend(writer)
        assert torch.equal(s.find(fresh), new_slots)
