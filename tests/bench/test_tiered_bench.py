"""bench/tiered.py as a correctness check (not timed): its quick case trains the tiered table bit for
bit as the in-memory one, on our file tier and on the RocksDB baseline's tier (rocksdict is not a
CI dependency: that part skips without it), and its id generator is what it claims."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ._load import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("tiered")


def test_zipf_ranks_follow_the_bounded_zipf_law(bench):
    n, a = 1000, 1.05
    got = bench.ZipfRanks(n, a).sample(np.random.default_rng(0), 2_000_000)
    assert got.min() >= 0 and got.max() < n
    emp = np.bincount(got, minlength=n) / got.size
    p = np.arange(1, n + 1, dtype=np.float64) ** -a
    p /= p.sum()
    assert 0.5 * np.abs(emp - p).sum() < 0.01  # total variation (sampling noise alone ~0.006)
    assert np.abs(emp[:5] / p[:5] - 1).max() < 0.02


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 4097, 65_536, 100_003])
def test_id_permutation_is_a_bijection(bench, n):
    perm = bench.IdPermutation(n, seed=7)
    ids = perm(np.arange(n, dtype=np.int64))
    assert np.array_equal(np.sort(ids), np.arange(n))
    if n > 1000:  # hot ranks are not the smallest ids
        assert ids[:100].max() > n // 2


def test_batches_are_a_function_of_the_seed_and_index(bench):
    w = bench.Workload(5000, batch=64, features=26, seed=1)
    a, b = w.batch(3), bench.Workload(5000, batch=64, features=26, seed=1).batch(3)
    assert torch.equal(a[0].values(), b[0].values()) and torch.equal(a[1], b[1])
    assert a[0].batch_size == 64 and a[0].keys() == tuple(f"C{i + 1}" for i in range(26))
    assert not torch.equal(a[0].values(), w.batch(4)[0].values())


@pytest.mark.slow
def test_tiered_table_trains_bit_for_bit_as_in_memory(bench, tmp_path):
    got = bench.parity_exports(tmp_path, ("tiered lfu", "tiered lru", "tiered lfu (no prefill)"))
    ref, step, _ = got.pop("in-memory")
    assert step == 30 and set(got) == {"tiered lfu", "tiered lru", "tiered lfu (no prefill)"}
    for name, (ex, st, stats) in got.items():
        assert st == step, name
        assert bench.same_export(ex, ref), name
        # the run went through the tier: misses read from the file, read ahead, written back
        assert stats["rows_read"] > 0 and stats["rows_prefetched"] > 0 and stats["rows_written"] > 0, name
        assert 0.5 < stats["hit_rate"] < 1.0, name
    assert not any(tmp_path.iterdir())  # every tier's directory removed


@pytest.mark.slow
def test_rocksdb_tier_trains_bit_for_bit_as_in_memory(bench, tmp_path):
    pytest.importorskip("rocksdict")
    got = bench.parity_exports(tmp_path, ("rocksdb lfu",))
    ref, step, _ = got["in-memory"]
    ex, st, stats = got["rocksdb lfu"]
    assert st == step == 30 and bench.same_export(ex, ref)
    assert stats["rows_read"] > 0 and stats["rows_prefetched"] > 0 and stats["rows_written"] > 0


def test_rocks_row_file_reads_what_it_wrote(bench, tmp_path):
    pytest.importorskip("rocksdict")
    f = bench.RocksRowFile(tmp_path / "db", 12, "t")
    rows = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    f.write(torch.arange(0, 20, 2), rows)
    out = torch.empty(4, 3)
    f.read(torch.tensor([2, 4, 18, 0]), out)
    assert torch.equal(out, rows[[1, 2, 9, 0]])
    f.write(torch.tensor([4]), torch.full((1, 3), -1.0))
    f.read(torch.tensor([4]), out[:1])
    assert torch.equal(out[0], torch.full((3,), -1.0))
    with pytest.raises(bench.StoreError, match="record 5"):
        f.read(torch.tensor([5]), out[:1])
    assert f.disk_bytes() > 0
    f.close()
    assert not (tmp_path / "db").exists()
