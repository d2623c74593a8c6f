"""The tiered cache's per-id loops: the native ones (he_tier_plan / he_tier_admit / he_tier_dirty_rows /
he_tier_release / he_tier_read_rows, csrc/) against their torch twins and a plain-Python model.

Two stores take the same calls, one through the native loops, one through the torch twins: after
every call their maps, cache metadata, record maps and rows must be equal.  The model (plain Python,
written here) says what each call must leave: every id's slot holds its key, the last value written
for a key reads back (through write-back and read-in), each key's accesses are the sum of its
counts in training calls, hits are the occurrences whose row was resident before the call.
Ids repeat (eval reads: the key index refuses repeated keys to find_or_insert), batches are
empty, victims are all dirty (training) or all clean (after a flush, eval
reads), and the file grows and is cleaned (small segments)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hugeembed import _native
from hugeembed.store import SLOT_METADATA_BYTES, ArrayStore, HashStore, TieredStore
from hugeembed.store._tier_space import RecordSpace

pytestmark = pytest.mark.skipif(not _native.available(), reason="compares the native loops with the torch twins")

DIM = 2
ROW_BYTES = DIM * 4


def make(tmp, name: str, cap: int, policy: str, native: bool, static: bool = False) -> TieredStore:
    """A dynamic table (keys get rows when trained), or a static one of 51 rows (an eval read of a
    row never written creates it: dirty, not on disk)."""
    index = ArrayStore("t", 51, DIM, rows=False) if static else HashStore("t", DIM, 0, rows=False)
    store = TieredStore(index, initializer=index.initializer, init_state=None, seed=0,
                        memory_budget=cap * (ROW_BYTES + SLOT_METADATA_BYTES), storage_dir=str(tmp / name),
                        cache_policy=policy)
    store._space = RecordSpace(ROW_BYTES, "t", segment_bytes=16 * ROW_BYTES)  # 16 records a segment: cleaning
    store._bind_map(store._map)
    store.native_loops = native
    return store


def state(s: TieredStore) -> dict:
    s._fit_map()
    sp = s._space
    return {"map": s._map.clone(), "owner": s._owner.clone(), "keys": s._keys.clone(), "tick": s._tick.clone(),
            "dirty": s._dirty.clone(), "slot_freq": s._slot_freq.clone(), "free": s._free[: s._nfree].clone(),
            "rows": s._rows[s._owner >= 0].clone(),  # free slots hold garbage
            "live": sp.live.clone(), "n_live": sp.n_live, "seg_free": list(sp.free),
            "open": (list(sp.open_seg), list(sp.open_next)), "stats": dict(s.stats)}


def assert_same(a: dict, b: dict) -> None:
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


ops = st.lists(st.one_of(
    st.tuples(st.just("train"), st.lists(st.integers(0, 40), max_size=12, unique=True), st.booleans()),
    st.tuples(st.just("eval"), st.lists(st.integers(0, 50), max_size=12), st.just(False)),  # ids repeat
    st.tuples(st.just("write"), st.lists(st.integers(0, 40), max_size=6, unique=True), st.just(False)),
    st.tuples(st.just("flush"), st.just([]), st.just(False))), min_size=1, max_size=25)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cap=st.integers(12, 30), policy=st.sampled_from(["lfu", "lru"]), static=st.booleans(), calls=ops,
       seed=st.integers(0, 2**16))
def test_native_loops_equal_the_torch_twins_and_the_model(tmp_path_factory, cap, policy, static, calls, seed):
    tmp = tmp_path_factory.mktemp("loops")
    nat, tw = make(tmp, "n", cap, policy, True, static), make(tmp, "t", cap, policy, False, static)
    g = torch.Generator().manual_seed(seed)
    value: dict[int, torch.Tensor] = {}  # key -> its row as last written (the model)
    freq: dict[int, int] = {}  # key -> accesses in training calls
    try:
        for step, (op, keys, with_counts) in enumerate(calls, start=1):
            k = torch.tensor(keys, dtype=torch.int64)
            before = {int(x) for x in nat._keys[nat._owner >= 0]}
            acc0, hits0 = nat.stats["accesses"], nat.stats["hits"]
            if op == "train":
                counts = torch.randint(1, 4, (k.numel(),), generator=g) if with_counts else None
                got = [s.find_or_insert(k, step, counts=counts) for s in (nat, tw)]
                c = [1] * len(keys) if counts is None else counts.tolist()
                for key, n in zip(keys, c):
                    freq[key] = freq.get(key, 0) + n
                assert nat.stats["accesses"] - acc0 == sum(c)
                assert nat.stats["hits"] - hits0 == sum(n for key, n in zip(keys, c) if key in before)
            elif op == "eval":
                got = [s.find(k) for s in (nat, tw)]
                known = [static or key in value or key in freq for key in keys]
                assert (got[0] >= 0).tolist() == known
            elif op == "write":
                slots = [s.find_or_insert(k, step) for s in (nat, tw)]
                rows = torch.randn(k.numel(), DIM, generator=g)
                for s, sl in zip((nat, tw), slots):
                    s.scatter(sl, rows)
                for key, r in zip(keys, rows):
                    value[key] = r.clone()
                    freq[key] = freq.get(key, 0) + 1
                got = slots
            else:
                for s in (nat, tw):
                    s.flush()
                got = [torch.zeros(0, dtype=torch.int64)] * 2
            assert torch.equal(got[0], got[1])
            assert_same(state(nat), state(tw))
            hit = got[0][got[0] >= 0]
            assert nat._keys[hit].tolist() == [key for key, sl in zip(keys, got[0].tolist()) if sl >= 0]
            for key, sl in zip(keys, got[0].tolist()):
                if sl >= 0 and key in value:  # written back and read in again: the value last written
                    assert torch.equal(nat._rows[sl], value[key])
        for key, n in freq.items():  # accesses: on the cache slot while resident, in the map when not
            lg = int(nat.index.find(torch.tensor([key]))[0])
            cs = int(nat._where[lg])
            assert (int(nat._slot_freq[cs]) if cs >= 0 else int(nat._freq[lg])) == n, key
    finally:
        nat.close()
        tw.close()


def test_an_empty_batch_changes_nothing_but_the_clock(tmp_path):
    s = make(tmp_path, "e", 8, "lfu", True)
    try:
        s.find_or_insert(torch.tensor([1, 2, 3]), 1)
        before = state(s)
        assert s.find_or_insert(torch.zeros(0, dtype=torch.int64), 2).numel() == 0
        assert s.find(torch.zeros(0, dtype=torch.int64)).numel() == 0
        assert_same(before, state(s))
    finally:
        s.close()


def test_every_victim_dirty_then_every_victim_clean_round_trips_rows(tmp_path):
    """Training dirties every resident row, so the victims of the next misses are all written back;
    after a flush, eval reads evict only clean rows (nothing written).  Every row reads back."""
    s = make(tmp_path, "d", 10, "lru", True)
    try:
        keys = torch.arange(40)
        want = {}
        for a in range(0, 40, 8):
            sl = s.find_or_insert(keys[a : a + 8], a + 1)
            rows = torch.arange(a, a + 8, dtype=torch.float32).repeat_interleave(DIM).reshape(8, DIM)
            s.scatter(sl, rows)
            want.update({a + i: rows[i] for i in range(8)})
        assert s.stats["rows_written"] >= 30  # every victim was dirty
        s.flush()
        written = s.stats["rows_written"]
        for a in range(0, 40, 5):
            sl = s.find(keys[a : a + 5])
            for i, x in enumerate(sl.tolist()):
                assert torch.equal(s._rows[x], want[a + i])
        assert s.stats["rows_written"] == written  # clean victims: nothing written
        assert s._space.records >= 40  # the file grew to hold them all
    finally:
        s.close()


def test_the_kernels_refuse_a_logical_row_outside_the_map(tmp_path):
    s = make(tmp_path, "r", 8, "lfu", True)
    try:
        s.find_or_insert(torch.tensor([1, 2]), 1)
        bad = torch.tensor([0, s._map.shape[0]], dtype=torch.int64)
        out = torch.empty((3, 2), dtype=torch.int64)
        with pytest.raises(_native.KernelError, match="is not a row of the tier map") as e:
            _native.call("he_tier_plan", [s._map, bad, out[0], out[1], out[2]])
        assert e.value.status == _native.Status.BAD_VALUE and e.value.detail[:2] == (1, s._map.shape[0])
    finally:
        s.close()


def test_a_fetch_plans_once_and_plans_again_when_a_slot_was_freed(tmp_path):
    """reserve + find_or_insert of keys the table holds run he_tier_plan once (the plan is carried
    through the reads and the bring-in; new keys get logical slots in the index call, so their fetch
    plans again for the bring-in); a key removed between reserve and the fetch frees a slot: the fetch plans afresh, and
    the native store still equals its torch twin."""
    nat, tw = make(tmp_path, "n", 12, "lfu", True), make(tmp_path, "t", 12, "lfu", False)
    kernels: list[str] = []
    real = nat._native_call
    nat._native_call = lambda k, *a: (kernels.append(k), real(k, *a))[1]
    try:
        for step, (keys, plans) in enumerate([(range(0, 10), 2), (range(10, 20), 2), (range(0, 10), 1)], start=1):
            k = torch.tensor(list(keys))
            kernels.clear()
            got = []
            for s in (nat, tw):
                s.reserve(k)
                got.append(s.find_or_insert(k, step))
            assert kernels.count("he_tier_plan") == plans, kernels
            assert torch.equal(got[0], got[1])
            assert_same(state(nat), state(tw))
        assert nat.stats["rows_read"] > 0  # the last fetch read rows written back
        k = torch.tensor([3, 12, 4])
        kernels.clear()
        for s in (nat, tw):
            s.reserve(k)
            s.remove(torch.tensor([5]))  # between reserve and the fetch: the plan no longer holds
        got = [s.find_or_insert(k, 9) for s in (nat, tw)]
        assert kernels.count("he_tier_plan") == 2, kernels  # reserve's, and the fetch's own
        assert torch.equal(got[0], got[1])
        assert_same(state(nat), state(tw))
    finally:
        nat.close()
        tw.close()
