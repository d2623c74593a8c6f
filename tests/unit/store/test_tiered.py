"""TieredStore: a table on disk with a byte-budgeted memory cache trains exactly as the in-memory table.

Oracles: the same collection without storage_dir (every number equal, bit for bit); a
plain-Python model of the cache policies; the initializer for rows never written.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hugeembed import CapacityError, ConfigError, StoreError, _native
from hugeembed.checkpoint import load, save
from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import FTRL, SGD, Adagrad, Adam, MomentumSGD, RowWiseAdagrad
from hugeembed.store import EXPORT_FIELDS, SLOT_METADATA_BYTES, HashStore, TieredStore, Uniform, cache_rows_for
from hugeembed.store._tier_file import _io_error

D = 4
RULES = {"sgd": lambda: SGD(lr=0.3), "momentum": lambda: MomentumSGD(lr=0.1, momentum=0.9),
         "adagrad": lambda: Adagrad(lr=0.2), "rowwise": lambda: RowWiseAdagrad(lr=0.2),
         "adam": lambda: Adam(lr=0.05), "adam_global": lambda: Adam(lr=0.05, mode="global"),
         "ftrl": lambda: FTRL(lr=0.1)}


def budget(rows: int, cfg: TableConfig, rule) -> int:
    """Bytes that hold exactly `rows` cached rows of this table."""
    row_bytes = cfg.row_layout(rule).row_bytes
    return rows * (row_bytes + SLOT_METADATA_BYTES)


def tables(tmp, cache_rows, rule, *, capacity=None, admit=1, policy="lfu", dtype=torch.float32, sr=False):
    cfgs = [TableConfig("s", dim=D, num_rows=60, combiner="sum", initializer=Uniform(-0.5, 0.5), dtype=dtype,
                        stochastic_rounding=sr),
            TableConfig("d", dim=D, combiner="mean", capacity=capacity, admit_min_count=admit,
                        initializer=Uniform(-0.5, 0.5), dtype=dtype, stochastic_rounding=sr)]
    if tmp is None:
        return cfgs
    return [dataclasses.replace(c, storage_dir=str(tmp), memory_budget=budget(cache_rows, c, rule),
                                cache_policy=policy) for c in cfgs]


def batch(g: torch.Generator, n_bags=6, per=3, hi_s=60, hi_d=90):
    s = torch.randint(0, hi_s, (n_bags * per,), generator=g)
    d = torch.randint(0, hi_d, (n_bags * per,), generator=g)
    return SparseFeatures.from_lists({"s": [s[i : i + per].tolist() for i in range(0, s.numel(), per)],
                                      "d": [d[i : i + per].tolist() for i in range(0, d.numel(), per)]})


def step(ec, f):
    out = ec(f)
    w = torch.arange(1.0, D + 1)
    ((out["s"] * w).sum() + (out["d"] ** 2).sum()).backward()
    return out


def assert_same_tables(a: EmbeddingCollection, b: EmbeddingCollection) -> None:
    for (ca, sa), (_, sb) in zip(a.stores(), b.stores()):
        ea, eb = sa.export(), sb.export()
        for f in EXPORT_FIELDS:
            assert torch.equal(getattr(ea, f), getattr(eb, f)), (ca.name, f)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rule=st.sampled_from(sorted(RULES)), cache_rows=st.integers(18, 40), policy=st.sampled_from(["lfu", "lru"]),
       capacity=st.sampled_from([None, 45]), admit=st.sampled_from([1, 2]), seed=st.integers(0, 10**6))
def test_tiered_training_equals_in_memory_bit_for_bit(tmp_path_factory, rule, cache_rows, policy, capacity, admit,
                                                      seed):
    tmp = tmp_path_factory.mktemp("tier")
    mem = EmbeddingCollection(tables(None, 0, None, capacity=capacity, admit=admit), optimizer=RULES[rule](), seed=seed)
    tier = EmbeddingCollection(tables(tmp, cache_rows, RULES[rule](), capacity=capacity, admit=admit, policy=policy),
                               optimizer=RULES[rule](), seed=seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(8):
        f = batch(g)
        o1, o2 = step(mem, f), step(tier, f)
        assert torch.equal(o1["s"], o2["s"]) and torch.equal(o1["d"], o2["d"])
    assert_same_tables(mem, tier)
    mem.eval()
    tier.eval()
    f = batch(g)
    e1, e2 = mem(f), tier(f)  # eval reads (global Adam: caught-up copies) equal too
    assert torch.equal(e1["s"], e2["s"]) and torch.equal(e1["d"], e2["d"])
    stats = tier.store("s").cache_stats()
    assert stats["rows_read"] > 0 and stats["rows_written"] > 0  # the budget is small: rows went to disk and back


def test_16_bit_tables_with_stochastic_rounding_draw_by_key(tmp_path):
    rule = Adagrad(lr=0.2)
    kw = dict(dtype=torch.float16, sr=True)
    mem = EmbeddingCollection(tables(None, 0, None, **kw), optimizer=Adagrad(lr=0.2), seed=3)
    tier = EmbeddingCollection(tables(tmp_path, 20, rule, **kw), optimizer=Adagrad(lr=0.2), seed=3)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        f = batch(g)
        step(mem, f), step(tier, f)
    assert_same_tables(mem, tier)


def test_pipelined_forwards_pin_their_rows_in_the_cache(tmp_path):
    """Forward i+1 before backward i: batch i's rows stay resident (pinned) and get its gradient."""
    rule = SGD(lr=0.5)
    mem = EmbeddingCollection(tables(None, 0, None), optimizer=SGD(lr=0.5))
    tier = EmbeddingCollection(tables(tmp_path, 40, rule), optimizer=SGD(lr=0.5))
    g = torch.Generator().manual_seed(7)
    fs = [batch(g) for _ in range(6)]
    for ec in (mem, tier):
        prev = step_out = None
        for f in fs:
            step_out = ec(f)
            if prev is not None:
                (prev["s"].sum() + prev["d"].sum()).backward()
            prev = step_out
        (prev["s"].sum() + prev["d"].sum()).backward()
    assert_same_tables(mem, tier)


def test_a_budget_the_pinned_rows_fill_is_a_clear_error_and_changes_nothing(tmp_path):
    rule = SGD(lr=0.5)
    tier = EmbeddingCollection(tables(tmp_path, 18, rule), optimizer=SGD(lr=0.5))
    g = torch.Generator().manual_seed(2)
    first = tier(batch(g))  # 18 distinct ids at most per table: fits, and stays pinned
    before = {t.name: s.export() for t, s in tier.stores()}
    step_before = tier.step
    f2 = batch(g, hi_s=60)
    with pytest.raises(CapacityError, match=r"table '(s|d)': the memory budget holds 18 rows.*pinned"):
        tier(f2)
    assert tier.step == step_before
    for t, s in tier.stores():
        after = s.export()
        for fld in EXPORT_FIELDS:
            assert torch.equal(getattr(before[t.name], fld), getattr(after, fld)), (t.name, fld)
    (first["s"].sum() + first["d"].sum()).backward()
    tier(f2)  # released: fits now


def test_unique_ids_beyond_the_budget_are_refused_naming_the_table(tmp_path):
    tier = EmbeddingCollection(tables(tmp_path, 5, SGD(lr=1.0)), optimizer=SGD(lr=1.0))
    with pytest.raises(CapacityError, match="table 's': the memory budget holds 5 rows"):
        tier(SparseFeatures.from_lists({"s": [list(range(8))], "d": [[1]]}))


# ---------------------------------------------------------------- cache policy model

class CacheModel:
    """The documented policy in plain Python: on a miss with the cache full, evict the
    needed rows plus capacity // 16 among unpinned rows the call does not read, smallest by
    (last access, accesses, key) for LRU, (accesses, last access, key) for LFU (the dynamic store's
    orders, store/_evict.py)."""

    def __init__(self, cap: int, policy: str) -> None:
        self.cap, self.policy = cap, policy
        self.resident: dict[int, int] = {}  # key -> last access (call number)
        self.freq: dict[int, int] = {}
        self.clock = 0

    def call(self, keys: list[int]) -> None:
        need = [k for k in keys if k not in self.resident]
        free = self.cap - len(self.resident)
        if len(need) > free:
            cand = [k for k in self.resident if k not in keys]
            take = min(len(cand), len(need) - free + self.cap // 16)
            if self.policy == "lru":
                order = sorted(cand, key=lambda k: (self.resident[k], self.freq.get(k, 0), k))
            else:
                order = sorted(cand, key=lambda k: (self.freq.get(k, 0), self.resident[k], k))
            for k in order[:take]:
                del self.resident[k]
        self.clock += 1
        for k in keys:
            self.resident[k] = self.clock
            self.freq[k] = self.freq.get(k, 0) + 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=st.sampled_from(["lru", "lfu"]), cap=st.integers(8, 140),
       calls=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=8, unique=True), min_size=1, max_size=40))
def test_what_each_policy_keeps_matches_a_simple_model(tmp_path_factory, policy, cap, calls):
    tmp = tmp_path_factory.mktemp("pol")
    index = HashStore("t", 2, 0, rows=False)
    store = TieredStore(index, initializer=index.initializer, init_state=None, seed=0,
                        memory_budget=cap * (2 * 4 + SLOT_METADATA_BYTES), storage_dir=str(tmp), cache_policy=policy)
    assert store.capacity_rows == cap == cache_rows_for(cap * (8 + SLOT_METADATA_BYTES), 8)
    model = CacheModel(cap, policy)
    for i, keys in enumerate(calls):
        store.find_or_insert(torch.tensor(keys), step=i + 1)
        model.call(keys)
        resident = store._keys[store._owner >= 0].sort().values.tolist()
        assert resident == sorted(model.resident), (i, keys)
    store.close()


def test_lfu_keeps_more_hot_rows_than_lru_on_a_skewed_stream(tmp_path):
    """At Zipf-like skew LFU holds more of the hottest ids than LRU, and serves more accesses."""
    probs = 1.0 / torch.arange(1, 1001, dtype=torch.float64) ** 1.05
    hot, rate = {}, {}
    for policy in ("lfu", "lru"):
        g = torch.Generator().manual_seed(0)
        index = HashStore("t", 2, 0, rows=False)
        store = TieredStore(index, initializer=index.initializer, init_state=None, seed=0,
                            memory_budget=100 * (8 + SLOT_METADATA_BYTES), storage_dir=str(tmp_path / policy), cache_policy=policy)
        for s in range(200):
            ids, counts = torch.multinomial(probs, 64, replacement=True, generator=g).unique(return_counts=True)
            store.find_or_insert(ids, step=s + 1, counts=counts)
        hot[policy] = len(set(store._keys[store._owner >= 0].tolist()) & set(range(100)))
        rate[policy] = store.cache_stats()["hit_rate"]
        store.close()
    assert hot["lfu"] > hot["lru"] and rate["lfu"] > rate["lru"], (hot, rate)


# ------------------------------------------------------------------- rows and files

def test_a_static_tables_rows_never_written_read_as_their_initial_value(tmp_path):
    cfg = TableConfig("s", dim=D, num_rows=1000, initializer=Uniform(-1, 1), storage_dir=str(tmp_path),
                      memory_budget=10 * (D * 4 + SLOT_METADATA_BYTES))
    tier = EmbeddingCollection([dataclasses.replace(cfg, trainable=False)], seed=5)
    mem = EmbeddingCollection([dataclasses.replace(cfg, storage_dir=None, memory_budget=None, trainable=False)],
                              seed=5)
    assert tier.store("s").stored_rows == 0  # nothing written up front: the file is sparse
    e1, e2 = mem.store("s").export(), tier.store("s").export()
    assert torch.equal(e1.rows, e2.rows)
    assert tier.store("s").stored_bytes() == 0


def test_snapshot_of_a_tiered_table_resumes_bit_identically(tmp_path):
    rule = Adagrad(lr=0.2)
    mem = EmbeddingCollection(tables(None, 0, None, capacity=45), optimizer=Adagrad(lr=0.2), seed=4)
    tier = EmbeddingCollection(tables(tmp_path / "tier", 20, rule, capacity=45), optimizer=Adagrad(lr=0.2), seed=4)
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        f = batch(g)
        step(mem, f), step(tier, f)
    snap = save(tmp_path / "ck", tier)
    # into a fresh tiered collection (another directory) and into an in-memory one
    back = EmbeddingCollection(tables(tmp_path / "tier2", 20, rule, capacity=45), optimizer=Adagrad(lr=0.2), seed=4)
    load(snap, back)
    plain = EmbeddingCollection(tables(None, 0, None, capacity=45), optimizer=Adagrad(lr=0.2), seed=4)
    load(snap, plain)
    assert_same_tables(mem, back)
    assert_same_tables(mem, plain)
    for _ in range(4):
        f = batch(g)
        step(mem, f), step(back, f), step(plain, f)
    assert_same_tables(mem, back)
    assert_same_tables(mem, plain)


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
def test_a_victim_choice_the_kernel_refuses_is_an_internal_store_error(tmp_path, monkeypatch):
    """he_choose_victims refuses a pinned slot outside the cache (KernelError BAD_VALUE): the store
    says so as a StoreError naming the table, as it did for the kernel's error code."""
    tier = EmbeddingCollection(tables(tmp_path, 18, SGD(lr=0.5)), optimizer=SGD(lr=0.5))
    g = torch.Generator().manual_seed(9)
    store = tier.store("s")
    monkeypatch.setattr(store._pins, "slots", lambda: torch.tensor([store.capacity_rows + 5]))
    with pytest.raises(StoreError, match=r"table 's': the victim choice \(he_choose_victims\) failed: "
                                         r".*not an index of the"
                                         r".*\(internal error\)"):
        for _ in range(10):
            step(tier, batch(g))


def test_a_full_disk_during_training_is_a_clear_error_and_loses_no_row(tmp_path, monkeypatch):
    """The write-back of evicted rows fails: the step is refused before anything changed; after the
    disk has room again, training goes on exactly as the in-memory run."""
    mem = EmbeddingCollection(tables(None, 0, None), optimizer=SGD(lr=0.5))
    tier = EmbeddingCollection(tables(tmp_path, 18, SGD(lr=0.5)), optimizer=SGD(lr=0.5))
    g = torch.Generator().manual_seed(9)
    fs = [batch(g) for _ in range(10)]
    for f in fs[:2]:
        step(mem, f), step(tier, f)
    store = tier.store("s")

    def full(records, *rows):  # write (rows) and write_rows (cache, slots) alike
        raise _io_error("s", f"writing {records.numel()} rows", errno.ENOSPC, store.file.path)

    monkeypatch.setattr(store.file, "write", full)
    monkeypatch.setattr(store.file, "write_rows", full)
    k = 2
    with pytest.raises(StoreError, match=r"table 's'.*ENOSPC"):
        while k < len(fs):
            step(tier, fs[k])
            step(mem, fs[k])
            k += 1
    monkeypatch.undo()
    assert tier.step == mem.step == k
    for f in fs[k:]:  # the refused batch again, then the rest
        step(mem, f), step(tier, f)
    assert_same_tables(mem, tier)


def test_a_failing_read_of_missed_rows_is_a_clear_error_and_changes_nothing(tmp_path, monkeypatch):
    """Reading the missed rows in fails (an I/O error): the step is refused with every table as it
    was (keys, rows, counts, last steps); once reads work again, training goes on as in memory."""
    mem = EmbeddingCollection(tables(None, 0, None), optimizer=SGD(lr=0.5))
    tier = EmbeddingCollection(tables(tmp_path, 18, SGD(lr=0.5)), optimizer=SGD(lr=0.5))
    g = torch.Generator().manual_seed(11)
    fs = [batch(g) for _ in range(12)]
    stores = [tier.store(n) for n in ("s", "d")]

    def broken(records, rows, slots):
        raise _io_error("s", f"reading {records.numel()} rows", errno.EIO, stores[0].file.path)

    k, failed = 0, False
    while k < len(fs) and not failed:
        before = [s.export() for s in stores]
        for s in stores:
            monkeypatch.setattr(s.file, "read_rows", broken)
        try:
            step(tier, fs[k])
        except StoreError as e:
            assert "EIO" in str(e)
            failed = True
            for s, b in zip(stores, before):
                a = s.export()
                for f in EXPORT_FIELDS:
                    assert torch.equal(getattr(a, f), getattr(b, f)), (s.name, f)
        monkeypatch.undo()
        if not failed:
            step(mem, fs[k])
            k += 1
    assert failed, "no step read a row from the tier"
    for f in fs[k:]:  # the refused batch again, then the rest
        step(mem, f), step(tier, f)
    assert_same_tables(mem, tier)


def test_storage_dir_of_another_layout_or_run_is_refused(tmp_path):
    cfg = TableConfig("t", dim=4, storage_dir=str(tmp_path), memory_budget=4096)
    a = EmbeddingCollection([cfg], optimizer=SGD(lr=1), storage_owner="run-a")
    # same process, another layout for the same directory: refused
    with pytest.raises(ConfigError, match="open in this process for the layout"):
        EmbeddingCollection([dataclasses.replace(cfg, dim=8)], optimizer=SGD(lr=1))
    # a crash leaves tier.json behind: simulate by keeping a copy of it after a clean close
    info = (tmp_path / "t" / "tier.json").read_text()
    del a
    import gc
    gc.collect()
    assert not (tmp_path / "t" / "tier.json").exists()  # a clean close leaves the directory empty
    assert list((tmp_path / "t").glob("rows-*.bin")) == []
    (tmp_path / "t" / "tier.json").write_text(info)
    with pytest.raises(ConfigError, match="left by another run"):
        EmbeddingCollection([cfg], optimizer=SGD(lr=1), storage_owner="run-b")
    with pytest.raises(ConfigError, match="another table layout"):
        EmbeddingCollection([dataclasses.replace(cfg, dim=8)], optimizer=SGD(lr=1), storage_owner="run-a")
    EmbeddingCollection([cfg], optimizer=SGD(lr=1), storage_owner="run-a")  # the same run resumes


def test_storage_dir_locked_by_another_process_is_refused(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    fd = os.open(d / "LOCK", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: as another process holds it
        with pytest.raises(ConfigError, match="in use by another process"):
            EmbeddingCollection([TableConfig("t", dim=4, storage_dir=str(tmp_path), memory_budget=4096)],
                                optimizer=SGD(lr=1))
    finally:
        os.close(fd)


@pytest.mark.parametrize("kw, match", [
    (dict(storage_dir="/x"), "storage_dir and memory_budget go together"),
    (dict(memory_budget=100), "storage_dir and memory_budget go together"),
    (dict(storage_dir="/x", memory_budget=0), "memory_budget must be a positive int"),
    (dict(storage_dir="/x", memory_budget=10, cache_policy="fifo"), "cache_policy must be 'lfu' or 'lru'"),
])
def test_bad_tier_options_name_the_table(kw, match):
    with pytest.raises(ConfigError, match=f"table 't'.*{match}"):
        TableConfig("t", dim=4, **kw)


def test_a_budget_that_holds_no_row_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="table 't': memory_budget 10 B holds no row"):
        EmbeddingCollection([TableConfig("t", dim=4, storage_dir=str(tmp_path), memory_budget=10)],
                            optimizer=SGD(lr=1))


def test_memory_is_reported_by_part(tmp_path):
    ec = EmbeddingCollection([TableConfig("t", dim=4, storage_dir=str(tmp_path), memory_budget=(16 + SLOT_METADATA_BYTES) * 100)],
                             optimizer=SGD(lr=1))
    store = ec.store("t")
    ec(SparseFeatures.from_lists({"t": [[1, 2, 3]]}))
    parts = store.memory_breakdown()
    assert parts["resident_rows"] + parts["cache_metadata"] <= (16 + SLOT_METADATA_BYTES) * 100
    assert parts["index"] > 0 and store.memory_bytes() == sum(parts.values())


@pytest.mark.parametrize("kw", [dict(ttl=2, evict_interval=2), dict(evict_norm_below=0.6, evict_interval=3)])
def test_ttl_and_norm_eviction_of_a_tiered_table_equal_the_in_memory_table(tmp_path, kw):
    """ttl and L2-norm eviction read counts / rows through the tier (norms of rows on disk too)."""
    cfg = TableConfig("d", dim=D, combiner="sum", initializer=Uniform(-0.5, 0.5), **kw)
    mem = EmbeddingCollection([cfg], optimizer=SGD(lr=0.3))
    tier = EmbeddingCollection([dataclasses.replace(cfg, storage_dir=str(tmp_path),
                                                    memory_budget=budget(20, cfg, SGD(lr=0.3)))],
                               optimizer=SGD(lr=0.3))
    g = torch.Generator().manual_seed(5)
    for _ in range(12):
        ids = torch.randint(0, 80, (18,), generator=g)
        f = SparseFeatures.from_lists({"d": [ids[i : i + 3].tolist() for i in range(0, 18, 3)]})
        for ec in (mem, tier):
            (ec(f)["d"] ** 2).sum().backward()
    assert len(mem.store("d")) < 80  # something was evicted
    assert_same_tables(mem, tier)


def test_delta_snapshots_of_tiered_tables_load_bit_for_bit(tmp_path):
    """A base + deltas (rows seen since, keys evicted since) of a tiered collection loads as the live one."""
    rule = Adagrad(lr=0.2)
    tier = EmbeddingCollection(tables(tmp_path / "tier", 20, rule, capacity=45), optimizer=Adagrad(lr=0.2), seed=6)
    g = torch.Generator().manual_seed(6)
    for i in range(9):
        step(tier, batch(g))
        if i % 3 == 2:
            save(tmp_path / "ck", tier, delta=i > 2)
    back = EmbeddingCollection(tables(tmp_path / "tier2", 20, rule, capacity=45), optimizer=Adagrad(lr=0.2), seed=6)
    load(tmp_path / "ck", back)
    assert_same_tables(tier, back)


def test_a_table_dirs_finalizer_run_while_its_lock_is_held_does_not_deadlock(tmp_path):
    """The garbage collector may finalize a dead TableDir (releasing its directory) on a thread that
    holds the directories' lock: any allocation under it can collect.  It once deadlocked there."""
    import threading

    from hugeembed.store import _tier_file

    d = _tier_file.TableDir(tmp_path, "t", {"dim": 2}, owner="me")
    done = threading.Event()

    def under_the_lock():
        with _tier_file._held_lock:
            d.close()  # what a collection run under the lock does
        done.set()

    t = threading.Thread(target=under_the_lock, daemon=True)
    t.start()
    t.join(20)
    assert done.is_set()
    assert not (tmp_path / "t" / "tier.json").exists()  # released: the directory is left empty


@pytest.mark.parametrize("rule, chunk", [("rowwise", None), ("adam", None), ("rowwise", 1)])
def test_cleaning_the_tier_file_keeps_training_bit_for_bit(tmp_path, monkeypatch, rule, chunk):
    """Segments of 16 records: the write-backs soon have to clean (move live rows out of the emptiest
    segments; `chunk`: segments moved per part, 1: a cleaning is many parts, and the failing write
    below may be one of them); training equals the in-memory table, a snapshot too, and a write that
    fails while cleaning changes nothing."""
    import hugeembed.store._tier_cache as cache_mod
    import hugeembed.store._tier_space as space_mod

    monkeypatch.setattr(space_mod, "_SEGMENT_BYTES", 1)  # the minimum: 16 records a segment
    if chunk is not None:
        monkeypatch.setattr(cache_mod, "_CLEAN_SEGMENTS", chunk)
    mem = EmbeddingCollection(tables(None, 0, None), optimizer=RULES[rule](), seed=3)
    tier = EmbeddingCollection(tables(tmp_path, 18, RULES[rule]()), optimizer=RULES[rule](), seed=3)
    g = torch.Generator().manual_seed(5)
    fs = [batch(g, hi_d=200) for _ in range(40)]
    for f in fs[:30]:
        step(mem, f), step(tier, f)
    assert_same_tables(mem, tier)
    moved = {t: tier.store(t).cache_stats()["rows_relocated"] for t in ("s", "d")}
    assert all(v > 0 for v in moved.values()), moved
    for t in ("s", "d"):  # the file stays bounded: live rows, garbage beside them
        sp = tier.store(t)._space
        assert sp.records <= 2 * max(sp.n_live, 1) + 8 * sp.S
    store = tier.store("d")
    real_write, real_write_rows, calls = store.file.write, store.file.write_rows, []

    def second_fails(records, *rows):  # the move succeeds, the write of the evicted rows fails
        calls.append(records.numel())
        if len(calls) > 1:
            raise _io_error("d", f"writing {records.numel()} rows", errno.ENOSPC, store.file.path)
        (real_write if len(rows) == 1 else real_write_rows)(records, *rows)

    k, failed = 30, False
    monkeypatch.setattr(store.file, "write", second_fails)  # the moves
    monkeypatch.setattr(store.file, "write_rows", second_fails)  # the evicted rows, from their slots
    try:
        while k < len(fs):
            calls.clear()
            step(tier, fs[k])
            step(mem, fs[k])
            k += 1
    except StoreError as e:
        assert "ENOSPC" in str(e) and "table 'd'" in str(e)
        failed = True
    assert failed, "no write-back moved rows in the last steps: the case did not run"
    monkeypatch.setattr(store.file, "write", real_write)
    monkeypatch.setattr(store.file, "write_rows", real_write_rows)
    assert tier.step == mem.step == k
    for f in fs[k:]:
        step(mem, f), step(tier, f)
    assert_same_tables(mem, tier)
    snap = save(tmp_path / "snap", tier)
    back = EmbeddingCollection(tables(None, 0, None), optimizer=RULES[rule](), seed=3)
    load(snap, back)
    assert_same_tables(mem, back)
