"""Torch-backend hash tables fetched together (store/_hash_group.py: one probe loop, one host
read, one write of counts and records for all of them) against a plain loop of find_or_insert
on twin stores: the same slots, and afterwards the same buckets, rows, scalars and free lists."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hugeembed.errors import CapacityError, InputError
from hugeembed.optim import Adagrad
from hugeembed.store import FromCallable, HashStore, Uniform, find_many, find_or_insert_many
from hugeembed.store._hash_group import BucketGroup

from store_helpers import SPECIAL_KEYS, check_layout

from tests.conftest import DEVICES


def make_stores(device):
    """Each way a table can take the shared pass, or leave it for its own call."""
    ada = Adagrad(lr=0.1, initial_accumulator_value=0.25)
    return [
        HashStore("plain", 3, seed=1, backend="torch", device=device),
        HashStore("adagrad", 4, ada.state_width(4), init_state=ada.init_state, seed=2, backend="torch",
                  device=device, initial_rows=8),  # grows (rehash: leaves the group, joins again)
        HashStore("admit3", 2, seed=3, admit_min_count=3, max_pending=20, backend="torch", device=device),
        HashStore("capped", 2, seed=4, capacity=40, eviction_policy="lru", backend="torch", device=device),
        HashStore("special", 2, seed=5, backend="torch", device=device),  # the sentinel key: its own path
        HashStore("lfu", 3, seed=6, capacity=60, backend="torch", device=device, admit_min_count=2),
    ]


def batch(g: torch.Generator, store, n: int, device):
    keys = torch.randint(-120, 120, (n,), generator=g).unique()
    if store.name == "special":
        keys = torch.cat([keys, torch.tensor(SPECIAL_KEYS)]).unique()
    if store.name == "capped":
        keys = keys[:30]
    counts = torch.randint(1, 4, (keys.numel(),), generator=g)
    perm = torch.randperm(keys.numel(), generator=g)
    return keys[perm].to(device), counts[perm].to(device)


def assert_same_store(a: HashStore, b: HashStore) -> None:
    """The same keys, rows, counts and steps, in the same slots and the same buckets."""
    ea, eb = a.export(), b.export()  # (keys ascending)
    for f in ea.__dataclass_fields__:
        assert torch.equal(getattr(ea, f).cpu(), getattr(eb, f).cpu()), (a.name, f)
    assert torch.equal(a.find(ea.keys), b.find(ea.keys)), a.name
    assert torch.equal(a._buckets.cpu(), b._buckets.cpu()), a.name  # the very same probe layout
    assert a._st.tolist() == b._st.tolist(), a.name
    nf = a._st_get("num_free")
    assert torch.equal(a._free[:nf].cpu(), b._free[:nf].cpu()), a.name
    hwm = a._st_get("row_hwm")
    assert torch.equal(a._storage[:hwm].cpu(), b._storage[:hwm].cpu()), a.name
    check_layout(a)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 7), size=st.integers(0, 50), with_counts=st.booleans())
def test_tables_fetched_together_equal_a_loop_of_find_or_insert(device, seed, steps, size, with_counts):
    ours, loop = make_stores(device), make_stores(device)
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        work = [batch(g, s, size, device) for s in ours]
        counts = [c for _, c in work] if with_counts else None
        sizes = [k.numel() for k, _ in work]
        out = list(torch.full((sum(sizes),), -7, dtype=torch.int64, device=device).split(sizes))
        got = find_or_insert_many(ours, [k for k, _ in work], step, counts=counts, out=out)
        for s, (k, c), a, o in zip(loop, work, got, out):
            want = s.find_or_insert(k, step, counts=c if with_counts else None)
            assert a is o and torch.equal(a, want), s.name
    for a, b in zip(ours, loop):
        assert_same_store(a, b)


def test_the_group_is_joined_once_and_rejoined_after_a_rehash():
    stores = [HashStore(f"t{i}", 2, backend="torch", initial_rows=32) for i in range(3)]
    find_or_insert_many(stores, [torch.arange(4) + i for i in range(3)], 1)
    group, rows = BucketGroup.of(stores)
    assert rows == [0, 1, 2] and all(s._buckets.untyped_storage().data_ptr() ==
                                     group.buckets.untyped_storage().data_ptr() for s in stores)
    find_or_insert_many(stores, [torch.arange(4, 8) for _ in range(3)], 2)
    assert BucketGroup.of(stores)[0] is group  # still joined: no copy
    stores[1].find_or_insert(torch.arange(1000, 1400), 3)  # grows its buckets alone: it leaves the group
    assert group.index_of(stores[1]) is None
    find_or_insert_many(stores, [torch.arange(8, 12) for _ in range(3)], 4)
    again, _ = BucketGroup.of(stores)
    assert again is not group and all(again.index_of(s) is not None for s in stores)
    for s, first, extra in zip(stores, (0, 1, 2), (0, 400, 0)):
        assert len(s) == 12 - first + extra, s.name
        assert bool((s.find(torch.arange(first, 12)) >= 0).all()), s.name
        check_layout(s)


def test_a_bad_table_takes_its_own_path_and_raises_naming_itself():
    a, b = (HashStore(n, 2, backend="torch", initial_rows=16) for n in "ab")
    with pytest.raises(InputError, match="'b': key 5 is given twice"):
        find_or_insert_many([a, b], [torch.tensor([1, 2]), torch.tensor([5, 5])], 1)
    assert len(b) == 0 and b._st_get("entries") == 0  # the refused table changed nothing
    with pytest.raises(InputError, match="'a'.*counts must be >= 1"):
        find_or_insert_many([a, b], [torch.tensor([3]), torch.tensor([6])], 2,
                            counts=[torch.tensor([0]), torch.tensor([1])])
    assert a.find(torch.tensor([3])).item() == -1
    full = HashStore("full", 2, capacity=2, on_full="error", backend="torch", initial_rows=2)
    with pytest.raises(CapacityError, match="'full'"):
        find_or_insert_many([a, full], [torch.tensor([7]), torch.tensor([1, 2, 3])], 3)
    assert len(full) == 0


def test_a_failing_call_changes_no_table_it_refuses_and_no_table_after_a_failing_initializer():
    """A table that raises is left exactly as it was (not even its index grown), and an
    initializer that raises does so before any table's keys are written."""
    a, b = (HashStore(n, 2, backend="torch") for n in "ab")
    nb = a.num_buckets
    with pytest.raises(InputError, match="'a': key 1 is given twice"):
        find_or_insert_many([a, b], [torch.tensor([1, 1] + list(range(2, 100))), torch.tensor([7])], 1)
    assert a.num_buckets == nb and len(a) == 0
    bad = {"on": False}

    def wrong_shape(keys, dim):
        return torch.zeros(keys.numel() + bad["on"], dim)

    c = HashStore("c", 2, backend="torch", initializer=FromCallable(wrong_shape))
    d = HashStore("d", 2, backend="torch")
    d.find_or_insert(torch.tensor([100]), 1)
    d.scatter(d.find(torch.tensor([100])), torch.full((1, 2), 42.0))
    d.remove(torch.tensor([100]))  # its slot (and its trained values) wait in the free list
    bad["on"] = True
    before = [s._buckets.clone() for s in (c, d)]
    with pytest.raises(InputError, match="FromCallable"):
        find_or_insert_many([c, d], [torch.tensor([1]), torch.tensor([7])], 2)
    assert len(c) == len(d) == 0 and d.find(torch.tensor([7])).item() == -1
    # not a bucket changed: the new keys' buckets, claimed before the group's read, are emptied again
    assert all(torch.equal(s._buckets, b) for s, b in zip((c, d), before))


def test_a_table_given_no_keys_forgets_no_pending_keys():
    """As its own call (which returns at once for no keys): pending keys beyond max_pending stay
    until the table is given keys (here: after an import from a run with a larger max_pending)."""
    src = HashStore("src", 2, backend="torch", admit_min_count=3, max_pending=100)
    src.find_or_insert(torch.arange(10), 1)
    a = HashStore("a", 2, backend="torch", admit_min_count=3, max_pending=4)
    a.import_(src.export())
    b = HashStore("b", 2, backend="torch")
    find_or_insert_many([a, b], [torch.zeros(0, dtype=torch.int64), torch.tensor([5, 6])], 2)
    assert a.num_pending == 10


def test_a_subclass_of_a_built_in_initializer_keeps_its_own_generate(monkeypatch):
    from hugeembed import _native

    monkeypatch.setattr(_native, "available", lambda: False)  # the GPU path, where generate runs

    class Sevens(Uniform):
        def generate(self, keys, dim, seed):
            return torch.full((keys.numel(), dim), 7.0)

    a, b = HashStore("a", 2, backend="torch", initializer=Sevens()), HashStore("b", 2, backend="torch")
    got = find_or_insert_many([a, b], [torch.tensor([1, 2]), torch.tensor([3])], 1)
    assert bool((a.gather(got[0]) == 7.0).all())
    ref = HashStore("b", 2, backend="torch")
    assert torch.equal(b.gather(got[1]), ref.gather(ref.find_or_insert(torch.tensor([3]), 1)))


def test_ops_of_the_shared_pass_do_not_grow_with_the_tables():
    """The probe, the checks and the writes are one op each for all tables: only the per-table
    row initialisation (new ids) and argument checks grow with them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    from ops import CountOps

    def ops_for(tables: int) -> tuple[int, int]:
        stores = [HashStore(f"t{i}", 4, backend="torch", initial_rows=256) for i in range(tables)]
        keys = [torch.arange(100) * (i + 1) for i in range(tables)]
        find_or_insert_many(stores, keys, 1)  # rows exist: the steady state (hits, no new rows)
        with CountOps() as c:
            find_or_insert_many(stores, keys, 2)
        return sum(c.ops.values()), c.syncs()

    (o2, s2), (o32, s32) = ops_for(2), ops_for(32)
    assert s32 == s2, (s2, s32)
    assert o32 <= 1.2 * o2 + 4 * 30, (o2, o32)  # a few per-table argument checks


@pytest.mark.parametrize("device", DEVICES)
def test_find_many_equals_a_loop_of_find_and_changes_nothing(device):
    """The eval path: torch tables probed together read the same slots as each alone (rows,
    pending keys -1, unknown -1, the sentinel key's side record), and insert or count nothing."""
    stores, twins = make_stores(device), make_stores(device)
    g = torch.Generator().manual_seed(7)
    for step in (1, 2, 3):
        work = [batch(g, s, 40, device) for s in stores]
        find_or_insert_many(stores, [k for k, _ in work], step, counts=[c for _, c in work])
        for t, (k, c) in zip(twins, work):
            t.find_or_insert(k, step, counts=c)
    before = [s.export() for s in stores]
    probe_keys = [torch.cat([batch(g, s, 60, device)[0], torch.tensor(SPECIAL_KEYS, device=device)]).unique()
                  for s in stores]
    got = find_many(stores, probe_keys)
    for s, t, k, a in zip(stores, twins, probe_keys, got):
        assert torch.equal(a, t.find(k)), s.name
        assert bool((a >= -1).all()), s.name  # pending keys read -1
    for s, e in zip(stores, before):
        after = s.export()
        for f in e.__dataclass_fields__:
            assert torch.equal(getattr(e, f), getattr(after, f)), (s.name, f)
    with pytest.raises(InputError, match="2 stores, 1 key tensors"):
        find_many(stores[:2], probe_keys[:1])
    with pytest.raises(InputError, match="int is not a row store"):
        find_many([stores[0], 3], probe_keys[:2])
    with pytest.raises(InputError, match="'plain'"):  # keys of a wrong dtype name the table
        find_many(stores[:2], [probe_keys[0].float(), probe_keys[1]])


def test_tables_whose_index_grows_are_rehashed_together_into_the_buckets_they_get_alone(monkeypatch):
    from hugeembed.store import _hash as hash_mod
    from hugeembed.store import _hash_group

    passes = []
    inner = _hash_group.find_or_insert_group

    def spy(*args, **kwargs):
        passes.append(kwargs.get("regrown", False))
        return inner(*args, **kwargs)

    monkeypatch.setattr(_hash_group, "find_or_insert_group", spy)
    monkeypatch.setattr(hash_mod, "find_or_insert_group", spy)
    ours = [HashStore(f"t{i}", 2, backend="torch") for i in range(3)]
    loop = [HashStore(f"t{i}", 2, backend="torch") for i in range(3)]
    for step in range(1, 6):
        keys = [torch.arange(step * 30) * (i + 1) for i in range(3)]
        find_or_insert_many(ours, keys, step)
        for s, k in zip(loop, keys):
            s.find_or_insert(k, step)
    assert passes.count(True) >= 2  # grown (64 -> ... buckets) in the shared pass, several times
    for a, b in zip(ours, loop):
        assert a.num_buckets == b.num_buckets > 64
        assert_same_store(a, b)


def test_keys_far_from_home_are_found_past_the_window_and_widen_it():
    """A group probes each key's first `window` buckets with no read of the device; keys farther
    from home (here 40 keys of one home bucket, the last 39 buckets on) are probed to the end:
    the same slots and buckets as each table alone, nothing inserted twice, and the window
    widened (16 -> 32) for the batches after."""
    from hugeembed.store._hash_torch import _home

    ours = [HashStore(f"t{i}", 2, seed=i, backend="torch", initial_rows=400) for i in range(2)]
    twins = [HashStore(f"t{i}", 2, seed=i, backend="torch", initial_rows=400) for i in range(2)]
    nb = ours[0].num_buckets
    cand = torch.arange(1, 200_000)
    homes = _home(cand, nb)
    crowd = [cand[homes == h][:40] for h in (5, nb - 3)]  # the second wraps past the end
    assert all(c.numel() == 40 for c in crowd)
    for step, part in ((1, slice(0, 10)), (2, slice(10, 40)), (3, slice(0, 40))):
        keys = [c[part] for c in crowd]
        got = find_or_insert_many(ours, keys, step)
        for s, t, k, a in zip(ours, twins, keys, got):
            assert torch.equal(a, t.find_or_insert(k, step)), (s.name, step)
    group, _ = BucketGroup.of(ours)
    assert group.window == 32
    for s, t, c in zip(ours, twins, crowd):
        assert len(s) == 40
        assert_same_store(s, t)
    assert all(torch.equal(a, t.find(c)) for a, t, c in zip(find_many(ours, crowd), twins, crowd))


def test_a_big_batch_probes_a_narrower_window_and_finds_every_key(monkeypatch):
    """probe_window bounds keys x window (memory): with the bound lowered to one bucket per key
    here, every key off its home bucket is probed to the end, and every slot is as each table
    alone."""
    from hugeembed.store import _hash_group, _hash_torch

    monkeypatch.setattr(_hash_torch, "_WINDOW_ELEMENTS", 120)
    rounds = []
    probe = _hash_torch.probe
    monkeypatch.setattr(_hash_group, "probe", lambda *a: rounds.append(1) or probe(*a))
    ours = [HashStore(f"t{i}", 2, seed=i, backend="torch", initial_rows=64) for i in range(2)]
    twins = [HashStore(f"t{i}", 2, seed=i, backend="torch", initial_rows=64) for i in range(2)]
    g = torch.Generator().manual_seed(11)
    for step in (1, 2, 3):
        keys = [torch.randint(0, 500, (60,), generator=g).unique() for _ in ours]
        for s, t, k, a in zip(ours, twins, keys, find_or_insert_many(ours, keys, step)):
            assert torch.equal(a, t.find_or_insert(k, step)), (s.name, step)
    for s, t in zip(ours, twins):
        assert_same_store(s, t)
    assert rounds  # the fallback ran


def test_a_claim_with_a_sink_leaves_it_empty_and_needs_the_tables_bounds():
    """claim(sink=...) lands masked writes in a bucket of no table, left holding no record;
    without base and size the one table covers every bucket, so a sink is refused."""
    from hugeembed.store._hash_torch import EMPTY, claim, new_buckets

    b = new_buckets(9, torch.device("cpu"))
    rec = torch.tensor([[101, 1, 1], [102, 2, 1], [103, 3, 1]])
    claim(b, rec, torch.tensor([0, 0, 0]), torch.zeros(3, dtype=torch.int64), torch.full((3,), 8), sink=8)
    assert b[:3, 0].tolist() == [101, 102, 103] and b[8, 0] == EMPTY and (b[3:8, 0] == EMPTY).all()
    with pytest.raises(ValueError, match="sink needs the tables' base and size"):
        claim(new_buckets(8, torch.device("cpu")), rec, torch.tensor([0, 0, 0]), sink=7)


def test_a_claim_that_raises_half_way_leaves_every_bucket_as_it_was(monkeypatch):
    """New keys claim their buckets before the group's read (_Speculation); a claim that fails
    after some rounds have written (here: a simulated out-of-memory in its third round) is
    undone, every bucket it wrote emptied again."""
    import hugeembed.store._hash_torch as hash_torch

    stores = [HashStore(n, 2, backend="torch") for n in "ab"]
    find_or_insert_many(stores, [torch.arange(10), torch.arange(10)], 1)  # joined; the next call speculates
    before = [s._buckets.clone() for s in stores]
    rounds = {"n": 0}
    real = hash_torch._claim_round

    def failing(*args, **kwargs):
        rounds["n"] += 1
        if rounds["n"] == 3:
            raise RuntimeError("out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(hash_torch, "_claim_round", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        find_or_insert_many(stores, [torch.arange(100, 160), torch.arange(200, 260)], 2)
    assert rounds["n"] == 3
    assert all(torch.equal(s._buckets, b) for s, b in zip(stores, before))
    monkeypatch.setattr(hash_torch, "_claim_round", real)
    assert find_or_insert_many(stores, [torch.arange(100, 160), torch.arange(200, 260)], 2)[0].min() >= 0
