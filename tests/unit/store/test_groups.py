"""Table groups (store/_static.py, store/_dynamic.py): several tables in one rows tensor and one key
index, against plain oracles written here: per-table dicts and arrays, and ids crafted to collide."""

from __future__ import annotations

import pytest
import torch
from store_helpers import check_layout

from hugeembed import _native
from hugeembed.errors import InputError
from hugeembed.store import ArrayStore, DynamicGroup, HashStore, RowLayout, StaticGroup, TableSettings, Uniform
from hugeembed.store._index import hash_key

BACKENDS = ["torch"] + (["native"] if _native.available() else [])
_M1, _M2, _MASK = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, (1 << 64) - 1


def _unmix(h: int) -> int:
    """The x with mix64(x) == h (MurmurHash3's fmix64 is a bijection: each step undone)."""
    h ^= h >> 33
    h = (h * pow(_M2, -1, 1 << 64)) & _MASK
    h ^= h >> 33
    h = (h * pow(_M1, -1, 1 << 64)) & _MASK
    h ^= h >> 33
    return h - (1 << 64) if h >= 1 << 63 else h


def _probe_cost(group) -> int:
    """Buckets a lookup of every stored key looks at (from each record's home to where it sits)."""
    b = group.buckets
    occupied = (b[:, 1] != -1).nonzero().squeeze(1)
    rec = b[occupied]
    hk = group.tables[:, 4][rec[:, 1]]
    from hugeembed._hashing import mix64, logical_shift_right

    nb = b.shape[0]
    home = logical_shift_right(logical_shift_right(mix64(rec[:, 0] ^ hk), 32) * nb, 32)
    return int(((occupied - home) % nb + 1).sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_crafted_to_collide_under_salt_0_cost_no_more_than_random_ids(backend):
    """24 k ids chosen so that mix64(id ^ hash key) shares its top bits under salt 0 (an attacker who
    knows the hash): the group sees the long chain, draws a new salt for the table and rehashes;
    after it, looking every key up costs no more than random ids under a drawn salt."""
    lay = RowLayout(2, torch.float32)
    hk0 = hash_key(0, 0)
    crafted = torch.tensor([_unmix(i) ^ hk0 for i in range(1, 24_001)], dtype=torch.int64)
    attacked = DynamicGroup([TableSettings("users", lay, salt=0)], backend=backend)
    calm = DynamicGroup([TableSettings("users", lay)], backend=backend)
    randoms = torch.randint(-(2**62), 2**62, (24_000,), generator=torch.Generator().manual_seed(0)).unique()
    for part in range(8):  # batches of 3,000, as a stream would bring them
        a, r = crafted[part * 3000 : (part + 1) * 3000], randoms[part * 3000 : (part + 1) * 3000]
        attacked.find_or_insert(torch.zeros_like(a), a, step=part + 1)
        calm.find_or_insert(torch.zeros_like(r), r, step=part + 1)
    assert attacked.salts[0] != 0  # a long chain made it draw a salt of its own
    assert (attacked.find(torch.zeros_like(crafted), crafted) >= 0).all()
    check_layout(attacked)
    per_key = _probe_cost(attacked) / len(attacked), _probe_cost(calm) / len(calm)
    assert per_key[0] <= 1.5 * per_key[1] and per_key[0] < 4, per_key


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_holds_each_tables_keys_apart_and_equal_to_its_own_store(backend):
    """Equal ids of two tables are two rows; each table's rows are those of the same table alone (a
    HashStore: the oracle of one table's contents), key by key."""
    lay = RowLayout(4, torch.float32)
    g = DynamicGroup([TableSettings(f"t{i}", lay, initializer=Uniform(-1.0, 1.0), seed=i) for i in range(3)],
                     backend=backend)
    alone = [HashStore(f"t{i}", 4, initializer=Uniform(-1.0, 1.0), seed=i, backend=backend) for i in range(3)]
    gen = torch.Generator().manual_seed(5)
    for step in range(1, 6):
        parts = [torch.randint(0, 30, (12,), generator=gen).unique() for _ in range(3)]
        keys = torch.cat(parts)
        tids = torch.cat([torch.full_like(p, i) for i, p in enumerate(parts)])
        slots = g.find_or_insert(tids, keys, step)
        assert slots.unique().numel() == slots.numel()  # table 0's id 7 and table 1's id 7: two rows
        for i, p in enumerate(parts):
            alone[i].find_or_insert(p, step)
    for i in range(3):
        a, b = g.view(i).export(), alone[i].export()
        assert torch.equal(a.keys, b.keys) and torch.equal(a.rows, b.rows) and torch.equal(a.counts, b.counts)
    check_layout(g)


def test_a_static_group_holds_each_table_at_its_rows_and_checks_every_key_first():
    """Static table t's key k at row first[t] + k (row-wise shard: k // shards): against ArrayStores."""
    lay = RowLayout(3, torch.float32)
    tables = [TableSettings("a", lay, num_rows=5, seed=1), TableSettings("b", lay, num_rows=7, seed=2),
              TableSettings("c", lay, num_rows=9, shard=1, num_shards=2, seed=3)]
    g = StaticGroup(tables)
    tids, keys = torch.tensor([0, 1, 2, 2, 1]), torch.tensor([4, 0, 1, 7, 6])
    assert g.touch(tids, keys, step=3).tolist() == [4, 5, 12, 15, 11]
    for t, k in zip(tids.tolist(), keys.tolist()):  # the rows the table alone starts with
        s = tables[t]
        alone = ArrayStore(s.name, s.num_rows, 3, initializer=s.initializer, seed=s.seed, shard=s.shard,
                           num_shards=s.num_shards)
        assert torch.equal(g.view(t).storage()[g.view(t).find(torch.tensor([k]))], alone.gather(alone.find(
            torch.tensor([k]))))
    meta = g.meta.clone()
    with pytest.raises(InputError, match="table 'b': key 7 is outside \\[0, 7\\)"):
        g.touch(torch.tensor([0, 1]), torch.tensor([1, 7]), step=4)
    assert torch.equal(g.meta, meta)  # nothing counted: the bad key was found first


def test_a_static_groups_torch_path_counts_as_the_kernel_and_reads_the_host_once(monkeypatch):
    """The torch path (what a GPU runs): each row's hit count and last step as a plain count over the ids
    (ids without a table, -1, count nowhere), and one read of the device (its key check), not one per
    masked index (an H100 step read 4 times)."""
    from hugeembed.store import _static

    from tests.bench._load import load_bench

    lay = RowLayout(2, torch.float32)
    tables = [TableSettings("a", lay, num_rows=4, seed=1), TableSettings("b", lay, num_rows=6, seed=2)]
    monkeypatch.setattr(_static._native, "available", lambda: False)
    g = StaticGroup(tables)
    tids, keys = torch.tensor([0, 1, -1, 1, 0]), torch.tensor([3, 5, 2, 0, 1])
    counts = torch.tensor([2, 1, 7, 4, 1])
    g.touch(tids, keys, step=2, counts=counts)
    with load_bench("ops").CountOps() as c:
        rows = g.touch(tids, keys, step=5, counts=counts)
    assert c.syncs() == 1, dict(c.ops)
    assert rows.tolist() == [3, 9, -1, 4, 1]
    want = torch.zeros(10, 2, dtype=torch.int64)
    for t, k, n in zip(tids.tolist(), keys.tolist(), counts.tolist()):
        if t >= 0:
            r = [0, 4][t] + k
            want[r, 0] += 2 * n
            want[r, 1] = 5
    assert torch.equal(torch.cat([g.table_meta(0), g.table_meta(1)]), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_bytes_is_every_tensor_the_group_holds(backend):
    g = DynamicGroup([TableSettings(f"t{i}", RowLayout(8, torch.float32, 8)) for i in range(2)], backend=backend)
    g.find_or_insert(torch.tensor([0, 1] * 500), torch.arange(1000), step=1)
    held = sum(v.numel() * v.element_size() for v in vars(g).values() if isinstance(v, torch.Tensor))
    assert g.memory_bytes() == held
    assert sum(g.table_memory_bytes(t) for t in range(2)) == held


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_draws_by_key_so_where_a_row_lives_does_not_matter(backend):
    """Two bf16 tables with stochastic rounding, fed the same ids in different orders (so the ids get
    other slots) and a third one sharing its group: every row ends the same, key by key."""
    from hugeembed.features import SparseFeatures
    from hugeembed.nn import EmbeddingCollection, TableConfig
    from hugeembed.optim import SGD

    def run(order, extra: bool):
        tables = [TableConfig("t", 3, dtype=torch.bfloat16, stochastic_rounding=True, seed=4, combiner="sum")]
        if extra:
            tables.append(TableConfig("u", 3, dtype=torch.bfloat16, stochastic_rounding=True, combiner="sum"))
        ec = EmbeddingCollection(tables, optimizer=SGD(lr=1e-3), backend="auto" if backend == "native" else backend)
        for step in range(4):
            ids = {"t": [[i] for i in order]}
            if extra:
                ids["u"] = [[i + 100] for i in order]
            ec(SparseFeatures.from_lists(ids))["t"].float().sum().backward()
        return ec.store("t").export()

    a, b, c = run([0, 1, 2, 3], False), run([3, 2, 1, 0], False), run([2, 0, 3, 1], True)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.rows, b.rows) and torch.equal(a.rows, c.rows)



def test_the_torch_index_names_the_smallest_pair_given_twice_and_changes_nothing():
    """A batch naming a (table, key) pair twice is refused, naming the smallest repeated pair in
    (table, key) order, keys signed (the triton kernel's rule; the native kernel names the first
    repeat in batch order)."""
    lay = RowLayout(4, torch.float32, 1)
    pairs = [(1, 9), (0, -5), (1, 3), (0, 7), (1, 3), (0, 7), (1, -2), (1, 9), (0, -5), (1, -2), (0, 4)]
    repeated = sorted({p for p in pairs if pairs.count(p) > 1})[0]  # the oracle: plain Python
    g = DynamicGroup([TableSettings(f"t{i}", lay, salt=5 + i) for i in range(2)], backend="torch")
    before = g.buckets.clone()
    tids, keys = (torch.tensor(c, dtype=torch.int64) for c in zip(*pairs))
    out, hits = torch.zeros_like(keys), torch.zeros_like(keys)
    rc, need, _ = g._index.find_or_insert(g, keys, tids, torch.ones_like(keys), None, 0, out, hits, None)
    assert rc.name == "DUPLICATE_KEY" and (vars(need)["dup_table"], vars(need)["dup_key"]) == repeated
    assert torch.equal(g.buckets, before)
