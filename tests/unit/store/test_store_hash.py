"""HashStore and ArrayStore on hand-built scenarios with exact expected outcomes:
admission, eviction (ttl, lfu, lru, protect), capacity, export/import, growth,
the sentinel key, errors.  Each runs on every device (native backend on CPU)."""

from __future__ import annotations

import pytest
import torch
from store_helpers import INT64_MAX, INT64_MIN, check_layout, max_ulp_diff

from hugeembed import _native
from hugeembed.errors import CapacityError, ConfigError, InputError
from hugeembed.store import ArrayStore, DictStore, HashStore, RowStore, Uniform

T = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731


def _keys_of(store) -> list[int]:
    return store.export().keys.tolist()


def _scenario(device, **kw) -> HashStore:
    """Six keys with known (count, last step):
    10:(5,0) 20:(2,3) 30:(2,5) 40:(3,0) 50:(1,0) 60:(1,3); slots 0..5 = 10,20,30,40,50,60."""
    s = HashStore("clicks", 4, device=device, **kw)
    s.find_or_insert(T(10, 20, 30, 40, 50).to(device), 0, T(5, 1, 1, 3, 1).to(device))
    s.find_or_insert(T(20, 60).to(device), 3)
    s.find_or_insert(T(30).to(device), 5)
    return s


def test_protocol_and_counters(device):
    s = _scenario(device)
    assert isinstance(s, RowStore) and isinstance(DictStore("t", 2), RowStore)
    e = s.export()
    assert e.keys.tolist() == [10, 20, 30, 40, 50, 60]
    assert e.counts.tolist() == [5, 2, 2, 3, 1, 1] and e.last_step.tolist() == [0, 3, 5, 0, 0, 3]
    assert s.find(T(60, 10, 99).to(device)).tolist() == [5, 0, -1]
    assert len(s) == 6 and s.width == 4 and s.storage().shape[1] == 4


@pytest.mark.parametrize("kw, survivors", [
    (dict(ttl=4), [10, 20, 30, 60]),  # 40, 50 unseen since step 0; 10 protected (slot 0)
    (dict(max_rows=3, policy="lfu"), [10, 30, 40]),  # 50 (1,0), 60 (1,3), 20 (2,3) go
    (dict(max_rows=3, policy="lru"), [20, 30, 60]),  # 50 (0,1), 40 (0,3), 10 (0,5) go
    (dict(ttl=4, max_rows=2, policy="lfu"), [10, 30]),  # ttl: 40, 50; then 60 (1,3), 20 (2,3) go
    (dict(max_rows=0), [10]),  # everything but the protected row
])
def test_eviction_exact_survivors(device, kw, survivors):
    s = _scenario(device)
    protect = T(0).to(device) if kw.get("max_rows") != 3 else None
    gone = s.evict(6, protect=protect, **kw)
    assert _keys_of(s) == survivors and gone == 6 - len(survivors)
    check_layout(s)


def test_lru_protect_and_key_tiebreak(device):
    s = _scenario(device)
    assert s.evict(6, max_rows=3, policy="lru", protect=T(3, -1).to(device)) == 3  # slot 3 = key 40
    assert _keys_of(s) == [20, 30, 40]
    t = HashStore("ties", 2, device=device)
    t.find_or_insert(T(5, -7, 3, 9).to(device), 0)
    t.evict(0, max_rows=2)  # equal count and step: lowest keys go first
    assert _keys_of(t) == [5, 9]


def test_freed_slots_reused_smallest_first(device):
    s = _scenario(device)
    s.evict(6, max_rows=3, policy="lfu")  # frees slots 1 (20), 4 (50), 5 (60)
    assert s.find_or_insert(T(70, 80, 90, 100).to(device), 7).tolist() == [1, 4, 5, 6]


def test_admission_counter_filter(device):
    s = HashStore("ads", 3, device=device, admit_min_count=3)
    assert s.find_or_insert(T(1, 2, INT64_MIN).to(device), 0).tolist() == [-1, -1, -1]
    assert len(s) == 0 and s.num_pending == 3
    assert s.find(T(1, 2).to(device)).tolist() == [-1, -1]  # find counts nothing
    e = s.export()
    assert e.pending_keys.tolist() == [INT64_MIN, 1, 2] and e.pending_counts.tolist() == [1, 1, 1]
    assert s.find_or_insert(T(1, 7).to(device), 1, T(1, 5).to(device)).tolist() == [-1, 0]  # 7 passes at once
    assert s.find_or_insert(T(2, 1, INT64_MIN).to(device), 2, T(2, 1, 1).to(device)).tolist() == [1, 2, -1]
    e = s.export()
    assert e.keys.tolist() == [1, 2, 7] and e.counts.tolist() == [3, 3, 5] and e.last_step.tolist() == [2, 2, 1]
    assert e.pending_keys.tolist() == [INT64_MIN] and e.pending_counts.tolist() == [2]
    assert e.pending_last_step.tolist() == [2]
    assert s.gather(T(-1, 0).to(device))[0].abs().sum() == 0  # a not-admitted key reads zeros
    s.find_or_insert(T(1, 2, 7).to(device), 5)
    assert s.evict(6, ttl=3) == 0 and s.num_pending == 0  # the pending key (seen at 2) expires, rows stay
    check_layout(s)


def test_capacity_error_message(device):
    s = HashStore("user_id", 2, device=device, capacity=4, on_full="error")
    s.find_or_insert(T(1, 2, 3).to(device), 0)
    with pytest.raises(CapacityError, match=r"'user_id'.*capacity 4.*needs 2 new rows"):
        s.find_or_insert(T(3, 4, 5).to(device), 1)
    assert len(s) == 3 and s.export().counts.tolist() == [1, 1, 1]  # nothing changed
    assert s.find_or_insert(T(4).to(device), 1).tolist() == [3]


def test_capacity_evicts_but_never_the_batch(device):
    s = HashStore("user_id", 2, device=device, capacity=4, eviction_policy="lfu")
    s.find_or_insert(T(1, 2, 3, 4).to(device), 0, T(1, 5, 2, 3).to(device))
    # key 1 is the least frequent but is in the batch: 3 (count 2) goes instead
    out = s.find_or_insert(T(1, 9).to(device), 1)
    assert _keys_of(s) == [1, 2, 4, 9] and out.tolist() == [0, 2]
    with pytest.raises(CapacityError, match="needs 5 new rows"):
        s.find_or_insert(T(10, 11, 12, 13, 14).to(device), 2)
    with pytest.raises(CapacityError, match="only 0 could be freed"):
        s.find_or_insert(T(1, 2, 4, 9, 15).to(device), 3)
    lru = HashStore("t", 2, device=device, capacity=3, eviction_policy="lru")
    for step, k in enumerate([5, 6, 7]):
        lru.find_or_insert(T(k).to(device), step, T(10 - step).to(device))
    lru.find_or_insert(T(8).to(device), 3)
    assert _keys_of(lru) == [6, 7, 8]


def test_export_import_roundtrip(device):
    init = Uniform(-1.0, 1.0)
    s = HashStore("t", 3, 2, device=device, admit_min_count=2, initializer=init, init_state=lambda x: x.fill_(0.5))
    keys = torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 5, 2**40], device=device)
    s.find_or_insert(keys, 0, T(2, 1, 3, 1, 2, 2).to(device))
    s.scatter(s.find(keys), torch.arange(18.0, device=device).view(6, 3).repeat(1, 1)[:, :1].expand(6, 5))
    e = s.export()
    other = HashStore("t", 3, 2, device=device, admit_min_count=2)
    other.find_or_insert(T(5, 77).to(device), 9, T(4, 4).to(device))  # 5 gets overwritten, 77 kept
    other.import_(e)
    e2 = other.export()
    assert e2.keys.tolist() == [INT64_MIN, -1, 5, 77, 2**40]
    sel = [0, 1, 2, 4]
    assert torch.equal(e2.rows[sel], e.rows) and e2.counts[sel].tolist() == e.counts.tolist()
    assert e2.pending_keys.tolist() == [0, INT64_MAX] and e2.pending_counts.tolist() == [1, 1]
    fresh = HashStore("t", 3, 2, device=device, admit_min_count=2)
    fresh.import_(e)
    for f in e.__dataclass_fields__:
        assert torch.equal(getattr(fresh.export(), f), getattr(e, f)), f
    with pytest.raises(InputError, match="width 5.*has 4"):
        HashStore("t", 4, device=device).import_(e)
    check_layout(other)


def test_growth_many_rehashes(device):
    s = HashStore("big", 2, device=device)
    g = torch.Generator().manual_seed(1)
    oracle: dict[int, int] = {}
    for _ in range(12):
        keys = torch.randint(-(2**63), 2**63 - 1, (3000,), generator=g, dtype=torch.int64)
        keys = torch.cat([keys, torch.tensor(list(oracle)[:500], dtype=torch.int64)]).unique()
        keys = keys[torch.randperm(keys.numel(), generator=g)]
        out = s.find_or_insert(keys.to(device), 0).cpu()
        for k, slot in zip(keys.tolist(), out.tolist()):
            assert oracle.setdefault(k, slot) == slot
    assert len(s) == len(oracle) and s.num_buckets >= 2**16  # grew from 64 buckets
    ks = torch.tensor(list(oracle))
    assert s.find(ks.to(device)).cpu().tolist() == list(oracle.values())
    check_layout(s)
    assert 0 < s.index_overhead_bytes() == s.memory_bytes() - len(s) * 2 * 4


def test_every_int64_is_a_key_the_extremes_included(device):
    # an empty bucket is marked by its table word, so no key value is reserved
    s = HashStore("t", 2, device=device)
    assert s.find_or_insert(T(INT64_MIN, 0).to(device), 0).tolist() == [0, 1]
    assert int(s.group.scalars[0]) == 2 and s.find(T(INT64_MIN).to(device)).tolist() == [0]
    assert s.evict(1, max_rows=1, policy="lfu", protect=T(1).to(device)) == 1
    assert s.find(T(INT64_MIN).to(device)).tolist() == [-1]
    assert s.find_or_insert(T(INT64_MIN).to(device), 2).tolist() == [0]


def test_duplicate_new_key_rejected_unchanged(device):
    s = HashStore("t", 2, device=device)
    s.find_or_insert(T(1).to(device), 0)
    with pytest.raises(InputError, match="key 5 is given twice"):
        s.find_or_insert(T(1, 5, 2, 5).to(device), 1)
    assert _keys_of(s) == [1] and s.export().counts.tolist() == [1]


def test_bad_arguments(device):
    with pytest.raises(ConfigError, match="'t': capacity"):
        HashStore("t", 2, capacity=0)
    with pytest.raises(ConfigError, match="on_full"):
        HashStore("t", 2, on_full="drop")
    with pytest.raises(ConfigError, match="dim"):
        HashStore("t", 0)
    s = HashStore("t", 2, device=device)
    with pytest.raises(InputError, match="'t': keys must be an integer"):
        s.find_or_insert(torch.tensor([1.0], device=device), 0)
    with pytest.raises(InputError, match="counts must be >= 1"):
        s.find_or_insert(T(1).to(device), 0, T(0).to(device))
    with pytest.raises(ConfigError, match="policy"):
        s.evict(0, max_rows=1, policy="fifo")
    with pytest.raises(InputError, match=r"slot 7 is outside"):
        s.gather(T(7).to(device))


def test_gather_scatter_skip_missing(device):
    s = HashStore("t", 2, device=device, initializer=Uniform(1.0, 2.0))
    slots = s.find_or_insert(T(4, 8).to(device), 0)
    s.scatter(torch.cat([slots, T(-1).to(device)]), torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]], device=device))
    got = s.gather(torch.cat([T(-1).to(device), slots]))
    assert got.cpu().tolist() == [[0.0, 0.0], [1.0, 2.0], [3.0, 4.0]]


def test_to_device_copy_and_backend_switch(device):
    s = _scenario(device, initializer=Uniform(-1.0, 1.0))
    c = s.to(device)
    assert torch.equal(c.export().rows, s.export().rows)
    c.find_or_insert(T(999).to(device), 9)
    assert len(c) == 7 and len(s) == 6
    if device.type == "cpu" and _native.available():
        s.use_backend("torch")  # the layout the native kernels built is read by torch ops
        assert s.find(T(10, 20, 30, 40, 50, 60).to(device)).tolist() == [0, 1, 2, 3, 4, 5]
        s.find_or_insert(T(61).to(device), 7)
        s.use_backend("native")
        assert s.find(T(61, 60).to(device)).tolist() == [6, 5]


def test_array_store(device):
    a = ArrayStore("country", 10, 3, 1, device=device, initializer=Uniform(0.0, 1.0), init_state=lambda x: x.fill_(2))
    assert a.find_or_insert(T(3, 0).to(device), 4, T(2, 1).to(device)).tolist() == [3, 0]
    e = a.export()
    assert e.counts.tolist()[:4] == [1, 0, 0, 2] and e.last_step[3] == 4 and len(a) == 10
    assert (a.storage()[:, 3] == 2).all()
    for bad in (12, -1):
        with pytest.raises(InputError, match=rf"'country': key {bad} is outside \[0, 10\).*num_rows=10"):
            a.find_or_insert(T(1, bad).to(device), 0)
    with pytest.raises(ConfigError, match="static"):
        a.evict(0, ttl=1)
    b = ArrayStore("country", 10, 3, 1, device=device)
    b.import_(e)
    assert torch.equal(b.storage(), a.storage())
    assert a.index_overhead_bytes() == 10 * 16 and a.to(device).export().keys.tolist() == list(range(10))


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_dynamic_on_range_equals_static(backend):
    if backend == "native" and not _native.available():
        pytest.skip("native kernels not built")
    n = 1000
    a = ArrayStore("t", n, 8, seed=3)
    h = HashStore("t", 8, seed=3, backend=backend)
    keys = torch.randperm(n)
    for chunk in keys.split(300):
        h.find_or_insert(chunk, 0)
    rows = h.gather(h.find(torch.arange(n)))
    assert max_ulp_diff(rows, a.storage()) <= (0 if backend == "native" else 1)


def test_auto_evict_frees_slack_like_the_oracle(device):
    kw = dict(capacity=128, eviction_policy="lfu", initializer=Uniform(-1.0, 1.0))
    h, d = HashStore("t", 2, device=device, **kw), DictStore("t", 2, device=device, **kw)
    keys = torch.arange(128, device=device)
    counts = (torch.arange(128, device=device) % 7) + 1
    for s in (h, d):
        s.find_or_insert(keys, 0, counts)
    new = torch.tensor([1000, 7], device=device)  # one new key, one live key (protected)
    assert h.find_or_insert(new, 1).tolist() == d.find_or_insert(new, 1).tolist()
    assert len(h) == len(d) == 128 - 1 - 128 // 64 + 1  # down to capacity - needed - slack, then the new key
    # count 1 = keys 0, 7, 14, 21, ...; 7 is in the batch, so 0, 14 and 21 go
    assert _keys_of(h) == _keys_of(d) == sorted(set(range(128)) - {0, 14, 21}) + [1000]


def test_half_precision_storage_and_state_init(device):
    s = HashStore("t", 3, 2, device=device, dtype=torch.bfloat16, initializer=Uniform(-1.0, 1.0),
                  init_state=lambda st: st.fill_(0.5))
    rows = s.gather(s.find_or_insert(T(5, 6).to(device), 0))
    assert rows.dtype == torch.bfloat16 and rows.shape == (2, 5)
    want = Uniform(-1.0, 1.0).generate(T(5, 6).to(device), 3, 0).to(torch.bfloat16)
    assert torch.equal(rows[:, :3], want) and (rows[:, 3:] == 0.5).all()


def test_meta_device_for_memory_planning():
    h = HashStore("t", 8, 2, device="meta", initial_rows=1000)
    a = ArrayStore("t", 1000, 8, 2, device="meta")
    assert h.storage().shape == (1000, 10) and h.storage().device.type == "meta"
    assert a.memory_bytes() == 1000 * 10 * 4 + 1000 * 16
    assert h.memory_bytes() == h.memory_breakdown()["rows"] + 32 * h.num_buckets + 8 * (3 + 5)
