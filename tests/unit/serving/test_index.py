"""The served tables' private key index (serving/_index.py, csrc/serve_index.h): every key found in its
own table and nothing else (a dict is the oracle), a salt drawn per index, and ids chosen to collide
under a known salt costing no more probes than random ids under a drawn one (issue 31: 24 k chosen ids
made a table 800x slower).  Probes (slots read) are counted by the kernel, not timed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed import _native
from hugeembed.serving import _index, _lookup_ops, _runtime, pooled_lookup, quantize
from hugeembed.serving._index import index_probes, index_salt, is_serving_index, serving_index

pytestmark = pytest.mark.skipif(not _native.available(), reason="the serving index is built by the kernels")
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def _meta(tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.tensor([k for t in tables for k in sorted(t)], dtype=torch.int64)
    n = len(tables)
    return keys, _runtime.table_meta(list(range(n)), [0] * n, [0] * n, [len(t) for t in tables], keys, [1] * n)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-50, 50) | st.integers(I64_MIN, I64_MAX), max_size=40, unique=True),
                min_size=1, max_size=4),
       st.lists(st.integers(-60, 60) | st.integers(I64_MIN, I64_MAX), max_size=40), st.data())
def test_every_key_is_found_in_its_own_table_and_nothing_else(tables, queries, data):
    keys, meta = _meta(tables)
    index = serving_index(keys, meta)
    position = {}
    base = 0
    for t, ks in enumerate(tables):
        for i, k in enumerate(sorted(ks)):
            position[(k, t)] = base + i
        base += len(ks)
    ids = queries + keys.tolist()
    table = data.draw(st.lists(st.integers(0, len(tables) - 1), min_size=len(ids), max_size=len(ids)))
    got, probes = index_probes(index, torch.tensor(ids, dtype=torch.int64), torch.tensor(table), keys, meta)
    assert got.tolist() == [position.get((i, t), -1) for i, t in zip(ids, table)]
    assert bool((probes <= int(index[2])).all())  # never past the longest chain


def test_each_index_draws_its_own_salt():
    keys, meta = _meta([list(range(1000))])
    a, b = serving_index(keys, meta), serving_index(keys, meta)
    assert is_serving_index(a) and int(a[0]) == _index.INDEX_MAGIC
    assert index_salt(a) != index_salt(b)  # 64 random bits each
    c, d = serving_index(keys, meta, salt=(1 << 63) + 5), serving_index(keys, meta, salt=(1 << 63) + 5)
    assert torch.equal(c, d) and index_salt(c) == (1 << 63) + 5  # a given salt: the same index


def _unsplitmix64(z: int) -> int:
    """The inverse of splitmix64's finalizer (it is a bijection of 64-bit words)."""

    def unxorshift(y, s):
        x = y
        for _ in range(64 // s + 1):
            x = y ^ (x >> s)
        return x

    z = unxorshift(z, 31)
    z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & M64
    z = unxorshift(z, 27)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & M64
    return unxorshift(z, 30)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def colliding_ids(n: int, slots: int, table: int = 0, salt: int = 0) -> list[int]:
    """`n` distinct ids whose home slot under `salt` is slot 7: splitmix64 inverted, as anyone who knows
    the salt can (the artifact's own index has salt 0 for good: its hash is public)."""
    return [_signed(((_unsplitmix64(7 + j * slots) ^ salt) - (table + 1) * GOLDEN) & M64) for j in range(n)]


def test_ids_chosen_to_collide_under_salt_0_cost_no_more_than_random_ids_under_a_drawn_salt():
    n = 24_000
    rng = np.random.default_rng(0)
    random_ids = sorted(set(rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64).tolist()))
    keys, meta = _meta([random_ids])
    slots = _index.index_capacity(len(random_ids))
    hostile_keys, hostile_meta = _meta([colliding_ids(len(random_ids), slots)])

    def probes(index, keys, meta):
        misses = keys + 1  # absent ids: each probe runs to its chain's end
        ids = torch.cat([keys, misses])
        pos, p = index_probes(index, ids, torch.zeros_like(ids), keys, meta)
        assert torch.equal(pos[: keys.numel()], torch.arange(keys.numel()))  # every key found
        return float(p.double().mean())

    # the chosen ids are hostile where the salt is known: one chain of 24 000 slots
    known = probes(serving_index(hostile_keys, hostile_meta, salt=0), hostile_keys, hostile_meta)
    assert known > 5000
    # under a drawn salt they cost what random ids cost
    drawn = probes(serving_index(hostile_keys, hostile_meta), hostile_keys, hostile_meta)
    baseline = probes(serving_index(keys, meta), keys, meta)
    assert drawn <= 1.15 * baseline and baseline < 2, (drawn, baseline)
    # the artifact's index, whose hash is public (salt 0 for good), is what the served tables no longer read
    chosen = sorted(colliding_ids(500, 1 << 20))  # one home slot in any index of up to 2^20 slots
    _, art_probes = _index.build_index(torch.tensor(chosen), torch.zeros(500, dtype=torch.int64), 1)
    assert art_probes[0] == 500


def test_a_chain_past_the_cap_draws_another_salt(monkeypatch):
    n = 2000
    keys, meta = _meta([colliding_ids(n, _index.index_capacity(n))])
    drawn = iter([0, 0, 12345])  # the first two draws: the salt the ids were chosen for
    monkeypatch.setattr(_index.secrets, "randbits", lambda bits: next(drawn))
    index = serving_index(keys, meta)
    assert index_salt(index) == 12345 and int(index[2]) <= _index.PROBE_CAP


def test_loaded_tables_read_the_private_index_and_an_artifacts_runtime_refuses_it():
    keys, meta = _meta([[3, 10, 20], [10, 40]])
    rows = quantize(torch.arange(6 * 4, dtype=torch.float32).view(6, 4), "fp32")  # 5 rows and the zero row
    slots, probes = _index.build_index(keys, torch.tensor([0, 0, 0, 1, 1]), 2)
    meta = _runtime.table_meta([0, 1], [0, 0], [0, 0], [3, 2], keys, probes)
    tables = _runtime.Tables([rows], [keys], [slots], [meta])
    assert is_serving_index(tables.lookup_index[0]) and tables.index[0] is slots
    values = torch.tensor([10, 40, 10, 99])
    offsets = torch.tensor([0, 1, 2, 3, 4])  # 2 features x 2 rows, one id a bag
    args = (values, offsets, rows, keys, tables.lookup_index[0], meta, [0, 1], [0, 1], [0, 0], 2, 4, "fp32")
    got = pooled_lookup(*args)
    want = pooled_lookup(values, offsets, rows, keys, slots, meta, [0, 1], [0, 1], [0, 0], 2, 4, "fp32")
    assert torch.equal(got, want) and torch.equal(got[0, 0], rows[1]) and torch.equal(got[1, 1], rows[5])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_lookup_ops, "bags_accelerator", None)
        with pytest.raises(_runtime.ArtifactError, match="power of two"):
            pooled_lookup(*args)


def test_a_key_twice_in_a_table_is_refused():
    keys = torch.tensor([5, 5], dtype=torch.int64)
    meta = torch.tensor([[0, 2, 0, 2, 1]], dtype=torch.int64)
    with pytest.raises(_runtime.ArtifactError, match="key 5 twice"):
        serving_index(keys, meta)


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists() or
                    "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="no transparent huge pages here")
def test_the_index_asks_for_huge_pages():
    """The slots are read at random: the build advises 2 MiB pages before writing them (MADV_HUGEPAGE: the
    mapping holding them carries the 'hg' flag)."""
    keys, meta = _meta([list(range(0, 300_000, 3))])  # 2^18 slots: 4 MiB
    index = serving_index(keys, meta)
    start = index.data_ptr() + 8 * _index.HEADER
    middle = start + 16 * (1 << int(index[1])) // 2
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            inside = lo <= middle < hi
        elif inside and line.startswith("VmFlags:"):
            assert "hg" in line.split()[1:]
            return
    raise AssertionError("the index's mapping is not in /proc/self/smaps")
