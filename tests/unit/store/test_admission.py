"""Admission (bounded pending keys, probability filter) and L2-norm eviction, HashStore vs the DictStore oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed import ConfigError
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD
from hugeembed.store import DictStore, HashStore


def same_export(a, b) -> None:
    ea, eb = a.export(), b.export()
    for f in ("keys", "rows", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step"):
        assert torch.equal(getattr(ea, f), getattr(eb, f)), f


@pytest.mark.slow
def test_pending_keys_are_bounded_and_their_bytes_counted():
    def stream(max_pending):
        s = HashStore("t", 4, capacity=1000, admit_min_count=2, max_pending=max_pending)
        for b in range(30):  # 120k ids, each seen once
            s.find_or_insert(torch.arange(b * 4096, (b + 1) * 4096), step=b + 1)
        return s

    bounded, unbounded = stream(4096), stream(10**9)
    assert bounded.num_pending <= 4096 and unbounded.num_pending == 30 * 4096
    assert len(bounded) == 0  # nothing was seen twice
    # the index of the unbounded store grew with every id; the bounded one stays small
    assert unbounded.memory_bytes() > 10 * bounded.memory_bytes()
    assert bounded.memory_bytes() < 1 << 20
    # what remains are the newest ids (fewest hits tie, then the oldest go first)
    assert int(bounded.export().pending_keys.min()) >= 30 * 4096 - 4096


def test_an_id_seen_twice_within_the_window_is_admitted():
    s = HashStore("t", 4, admit_min_count=2, max_pending=100)
    s.find_or_insert(torch.tensor([7]), step=1)
    for b in range(3):  # 3 x 30 other ids: id 7 stays within the newest 100 pending keys
        s.find_or_insert(torch.arange(1000 + 30 * b, 1030 + 30 * b), step=2 + b)
    assert int(s.find_or_insert(torch.tensor([7]), step=9)) >= 0


batches = st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=25, unique=True), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(batches, st.integers(1, 20), st.integers(1, 3))
def test_bounded_pending_matches_the_dict_oracle(bs, max_pending, k):
    h = HashStore("t", 2, admit_min_count=k, max_pending=max_pending, capacity=30)
    d = DictStore("t", 2, admit_min_count=k, max_pending=max_pending, capacity=30)
    for step, b in enumerate(bs, 1):
        keys = torch.tensor(b)
        assert torch.equal(h.find_or_insert(keys, step), d.find_or_insert(keys, step))
        assert h.num_pending <= max_pending
    same_export(h, d)


@settings(max_examples=40, deadline=None)
@given(batches, st.sampled_from([0.1, 0.5, 0.9]), st.integers(0, 3))
def test_probability_admission_matches_the_dict_oracle(bs, p, seed):
    h = HashStore("t", 2, admit_probability=p, seed=seed)
    d = DictStore("t", 2, admit_probability=p, seed=seed)
    for step, b in enumerate(bs, 1):
        keys = torch.tensor(b)
        assert torch.equal(h.find_or_insert(keys, step), d.find_or_insert(keys, step))
    same_export(h, d)
    assert h.num_pending == 0  # a key not admitted leaves no trace


def test_probability_admission_admits_p_of_new_ids_and_keeps_admitted_ones():
    s = HashStore("t", 2, admit_probability=0.3, seed=5)
    n = 20_000
    got = s.find_or_insert(torch.arange(n), step=1)
    frac = float((got >= 0).float().mean())
    assert abs(frac - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)
    again = s.find_or_insert(torch.arange(n), step=2)  # admitted ids keep their rows
    assert torch.equal(again[got >= 0], got[got >= 0])
    # an id not admitted at step 1 gets a fresh draw at step 2, independent of the first
    second = float((again[got < 0] >= 0).float().mean())
    assert abs(second - 0.3) < 4 * math.sqrt(0.3 * 0.7 / int((got < 0).sum()))
    # reproducible: the same seed admits the same ids
    t = HashStore("t", 2, admit_probability=0.3, seed=5)
    assert torch.equal(t.find_or_insert(torch.arange(n), step=1), got)


@pytest.mark.parametrize("kwargs, match", [
    (dict(admit_probability=0.5, admit_min_count=2), "choose one"),
    (dict(admit_probability=0.0), "admit_probability"),
    (dict(admit_probability=1.5), "admit_probability"),
    (dict(admit_probability=float("nan")), "admit_probability"),
    (dict(admit_probability=True), "admit_probability"),
    (dict(max_pending=0), "max_pending"),
    (dict(max_pending=2.5), "max_pending"),
])
def test_bad_admission_settings_are_refused_naming_the_table(kwargs, match):
    for make in (lambda: HashStore("clicks", 2, **kwargs), lambda: DictStore("clicks", 2, **kwargs),
                 lambda: TableConfig("clicks", dim=2, **kwargs)):
        with pytest.raises(ConfigError, match=match) as e:
            make()
        assert "clicks" in str(e.value)


def test_l2_norm_eviction_removes_small_rows_and_spares_pinned_ones():
    for make in (HashStore, DictStore):
        s = make("t", 3, state_width=1)
        slots = s.find_or_insert(torch.arange(10), step=1)
        rows = torch.zeros(10, 4)
        rows[:, :3] = torch.arange(10, dtype=torch.float32)[:, None] * 0.1  # norms 0, 0.17, 0.35, ...
        s.scatter(slots, rows)
        norms = rows[:, :3].norm(dim=1)
        pinned = s.pin(slots[:2])
        gone = s.evict(step=2, min_norm=0.5)
        expect = [k for k in range(10) if norms[k] < 0.5 and k >= 2]
        assert gone == len(expect)
        kept = s.find(torch.arange(10)) >= 0
        assert [k for k in range(10) if not kept[k]] == expect
        s.unpin(pinned)
        assert s.evict(step=3, min_norm=0.5) == 2  # now ids 0 and 1 go too


def test_table_config_norm_eviction_runs_at_the_interval():
    ec = EmbeddingCollection([TableConfig("u", dim=2, evict_norm_below=1e-3, evict_interval=2, combiner="sum")],
                             optimizer=SGD(lr=0.0))
    from hugeembed.features import SparseFeatures
    b = SparseFeatures.from_lists({"u": [[1, 2]]})
    ec(b)
    store = ec.store("u")
    store.scatter(store.find(torch.tensor([1])), torch.zeros(1, 2))  # id 1's row is ~0
    ec(SparseFeatures.from_lists({"u": [[3]]}))  # step 2: the check runs
    assert store.find(torch.tensor([1, 2, 3])).tolist()[0] == -1
    assert (store.find(torch.tensor([2, 3])) >= 0).all()


def test_evict_follows_the_table_policy():
    from hugeembed.features import SparseFeatures
    ec = EmbeddingCollection([TableConfig("u", dim=2, eviction_policy="lru", combiner="sum")],
                             optimizer=SGD(lr=0.1))
    ec(SparseFeatures.from_lists({"u": [[1], [1], [1], [2]]}))  # id 1: 3 hits; id 2: 1 hit
    ec(SparseFeatures.from_lists({"u": [[1]]}))
    ec(SparseFeatures.from_lists({"u": [[2]]}))  # id 2 seen last
    # LFU would keep id 1 (4 hits vs 2); LRU keeps id 2 (seen last)
    assert ec.evict(max_rows=1) == {"u": 1}
    assert ec.store("u").find(torch.tensor([1, 2])).tolist()[0] == -1
    assert ec.evict(max_rows=0, policy="lfu") == {"u": 1}  # an explicit policy still wins


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_norm_eviction_reads_the_weights_through_the_layout(dtype):
    # 16-bit weights are packed into float32 columns beside float32 state: the norm must be
    # the weights' own (oracle: the typed weights view), never the raw columns'
    from hugeembed.optim import Adagrad
    from hugeembed.store import Constant

    ec = EmbeddingCollection([TableConfig("u", dim=4, dtype=dtype, combiner="sum", initializer=Constant(1.0))],
                             optimizer=Adagrad(lr=0.1))
    from hugeembed.features import SparseFeatures
    (ec(SparseFeatures.from_lists({"u": [[1], [2]]}))["u"].sum() * 0.5).backward()
    store = ec.store("u")
    norms = store.weights()[store.find(torch.tensor([1, 2]))].float().norm(dim=1)
    assert bool((norms > 1.5).all())  # ~1.8: far from 0.5
    assert ec.evict(min_norm=0.5) == {"u": 0}
    assert ec.evict(min_norm=float(norms.max()) + 0.01) == {"u": 2}
