"""Batching and the Loader: batches equal direct reading, shuffling, rank slices, errors, shutdown."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hugeembed.data import (CAT_NAMES, Batch, CriteoBlock, Loader, SyntheticConfig, SyntheticCriteo, convert,
                            read_criteo, rebatch, sparse_from_ids, write_criteo_tsv)
from hugeembed.errors import ConfigError, InputError
from hugeembed.features import SparseFeatures

N_ROWS = 5003
CFG = SyntheticConfig(seed=3, max_cardinality=50_000)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    write_criteo_tsv(root / "a.txt", N_ROWS, config=CFG)
    write_criteo_tsv(root / "a.txt.gz", N_ROWS, config=CFG)
    convert(root / "a.txt", root / "shards", rows_per_shard=1200)
    return root, read_criteo(root / "a.txt")


def rows_of(batches) -> CriteoBlock:
    """Batches back to sample-major numpy rows (the oracle's layout)."""
    dense = torch.cat([b.dense for b in batches]).numpy()
    cats = torch.cat([b.sparse.values().view(len(CAT_NAMES), b.batch_size).t() for b in batches]).numpy()
    labels = torch.cat([b.labels for b in batches]).numpy()
    return CriteoBlock(dense, np.ascontiguousarray(cats), labels)


def test_sparse_from_ids_matches_a_per_sample_oracle(device):
    ids = torch.randint(0, 1 << 40, (7, 5), device=device)
    sf = sparse_from_ids(ids, ["a", "b", "c", "d", "e"])
    expected = SparseFeatures.from_lists({k: [[int(ids[b, f])] for b in range(7)] for f, k in enumerate("abcde")})
    assert sf.keys() == expected.keys() and sf.batch_size == 7
    assert sf.values().tolist() == expected.values().tolist()
    assert sf.offsets().tolist() == expected.offsets().tolist()
    assert sf.device == ids.device
    with pytest.raises(InputError, match="int64"):
        sparse_from_ids(ids.int(), list("abcde"))
    with pytest.raises(InputError, match="feature names"):
        sparse_from_ids(ids, list("abc"))


def test_batch_accepts_multi_hot_and_moves_devices(device):
    sf = SparseFeatures.from_lists({"x": [[1, 2], [], [3]], "y": [[4], [5, 6, 7], []]})
    b = Batch(torch.zeros(3, 2), sf, torch.tensor([0.0, 1.0, 0.0])).to(device)
    assert b.batch_size == 3 and b.dense.device.type == device.type and b.sparse.device.type == device.type
    with pytest.raises(InputError, match="agree on B"):
        Batch(torch.zeros(2, 2), sf, torch.zeros(3))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("source", ["a.txt", "a.txt.gz", "shards"])
def test_batches_equal_direct_reading(data, source, drop_last):
    root, ref = data
    batches = list(Loader(root / source, 512, drop_last=drop_last, chunk_rows=700, chunk_bytes=64 << 10))
    sizes = [b.batch_size for b in batches]
    assert sizes == [512] * (N_ROWS // 512) + ([] if drop_last else [N_ROWS % 512])
    got = rows_of(batches)
    assert got.equals(ref.slice(0, len(got)))
    b = batches[0]
    assert b.dense.dtype == torch.float32 and b.labels.dtype == torch.float32 and b.sparse.keys() == CAT_NAMES
    assert b.sparse.lengths().eq(1).all()


def test_len_matches_iteration(data):
    root, _ = data
    for drop_last in (False, True):
        for rank in range(3):
            loader = Loader(root / "shards", 300, drop_last=drop_last, rank=rank, world_size=3)
            assert len(loader) == len(list(loader))
    with pytest.raises(TypeError, match="text source"):
        len(Loader(root / "a.txt", 300))


def test_shuffle_is_seeded_and_a_permutation(data):
    root, ref = data

    def order(seed, epoch):
        loader = Loader(root / "shards", 1000, shuffle=True, seed=seed, chunk_rows=500, shuffle_window=1500)
        loader.set_epoch(epoch)
        return rows_of(list(loader))

    a, again, other_epoch, other_seed = order(1, 0), order(1, 0), order(1, 1), order(2, 0)
    assert a.equals(again)
    assert not a.equals(other_epoch) and not a.equals(other_seed)
    assert not a.equals(ref)
    key = lambda blk: np.lexsort(blk.cats.T[::-1])  # noqa: E731  rows sorted by their ids
    for blk in (a, other_epoch):
        assert blk.take(key(blk)).equals(ref.take(key(ref)))  # the same rows, reordered


@pytest.mark.parametrize("shuffle", [False, True])
def test_shard_rank_slices_cover_every_row_once(data, shuffle):
    root, ref = data
    parts = []
    for rank in range(4):
        loader = Loader(root / "shards", 256, shuffle=shuffle, seed=5, rank=rank, world_size=4, chunk_rows=900)
        parts.append(rows_of(list(loader)))
    assert sorted(len(p) for p in parts) == [1250, 1251, 1251, 1251]
    whole = CriteoBlock.concat(parts)
    if not shuffle:
        assert whole.equals(ref)  # contiguous slices in rank order
    key = np.lexsort(whole.cats.T[::-1])
    assert whole.take(key).equals(ref.take(np.lexsort(ref.cats.T[::-1])))


def test_drop_last_gives_every_rank_the_same_rows(data):
    root, _ = data
    counts = [Loader(root / "shards", 100, drop_last=True, rank=r, world_size=4).rows() for r in range(4)]
    assert counts == [N_ROWS // 4] * 4
    assert len({len(Loader(root / "shards", 100, drop_last=True, rank=r, world_size=4)) for r in range(4)}) == 1


def test_text_rank_slices_cover_every_row_once(data):
    root, ref = data
    parts = [rows_of(list(Loader(root / "a.txt.gz", 128, rank=r, world_size=3))) for r in range(3)]
    for r, p in enumerate(parts):
        assert p.equals(ref.take(np.arange(r, N_ROWS, 3)))


def test_worker_exception_reaches_the_consumer(tmp_path, data):
    root, _ = data
    text = (root / "a.txt").read_text().splitlines()
    text.insert(3000, "1\tbroken")
    (tmp_path / "bad.txt").write_text("\n".join(text) + "\n")
    loader = Loader(tmp_path / "bad.txt", 256, prefetch=2, chunk_bytes=32 << 10)
    got = 0
    with pytest.raises(InputError, match=r"bad\.txt:3001: expected 40"):
        for batch in loader:
            got += batch.batch_size
    assert 0 < got < 3000  # the batches before the bad line arrived first
    skip = Loader(tmp_path / "bad.txt", 256, on_error="skip")
    assert sum(b.batch_size for b in skip) == N_ROWS and skip.summary.skipped == 1


def _loader_threads():
    return [t for t in threading.enumerate() if t.name == "hugeembed-loader"]


def test_early_break_shuts_the_thread_down(data):
    root, _ = data
    before = len(_loader_threads())
    it = iter(Loader(root / "shards", 64, prefetch=1))
    next(it)
    it.close()
    assert len(_loader_threads()) == before
    with iter(Loader(root / "a.txt", 64, prefetch=3)) as it:
        next(it)
    assert len(_loader_threads()) == before
    for _ in Loader(root / "shards", 64, prefetch=0):  # no thread at all
        assert len(_loader_threads()) == before
        break


def test_bad_options(data, tmp_path):
    root, _ = data
    with pytest.raises(ConfigError, match="shuffle=True needs converted shards"):
        Loader(root / "a.txt", 10, shuffle=True)
    with pytest.raises(ConfigError, match="batch_size"):
        Loader(root / "shards", 0)
    with pytest.raises(ConfigError, match="rank"):
        Loader(root / "shards", 10, rank=1, world_size=1)
    with pytest.raises(InputError, match="no manifest.json"):
        Loader(tmp_path, 10)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="pin_memory"):
            Loader(root / "shards", 10, pin_memory=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pin_memory(data):
    root, _ = data
    batch = next(iter(Loader(root / "shards", 64, pin_memory=True)))
    assert batch.is_pinned()


def test_rebatch_oracle():
    sizes = [3, 0, 10, 1, 1, 7]
    rng = np.random.default_rng(0)
    blocks = []
    for n in sizes:
        blocks.append(CriteoBlock(rng.random((n, 13), dtype=np.float32), rng.integers(0, 9, (n, 26)),
                                  rng.integers(0, 2, n).astype(np.float32)))
    whole = CriteoBlock.concat(blocks)
    for bs in (1, 4, 22, 50):
        for drop_last in (False, True):
            out = list(rebatch(iter(blocks), bs, drop_last))
            expect = [whole.slice(a, a + bs) for a in range(0, len(whole), bs)]
            if drop_last:
                expect = [e for e in expect if len(e) == bs]
            assert len(out) == len(expect) and all(o.equals(e) for o, e in zip(out, expect))


def test_synthetic_batches_are_loader_batches():
    gen = SyntheticCriteo(CFG)
    batches = list(gen.batches(300, 4, start=100))
    assert rows_of(batches).equals(gen.rows(100, 1200))
