"""The triton key index (store/_index_triton.py, kernels in hugeembed/_triton/hash_index.py) against
the torch reference (store/_index_torch.py, the specification): the same buckets, codes, row slots,
counts and needs after every call, over sequences of find-or-insert / find / remove / import on every table
of a group, with keys crowding a tiny bucket array, admission, the shared row's key, full tables
and duplicates; the same results whatever order the kernels' programs run in; and an
EmbeddingCollection whose dynamic groups run on it trains to the torch twin's state_dict.

Under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py sets it without CUDA): tiny shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from hugeembed import SparseFeatures
from hugeembed._triton import hash_index, interpreting
from hugeembed.errors import CapacityError, ConfigError, InputError
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.nn._rare import SHARED_ROW_KEY
from hugeembed.optim import Adagrad
from hugeembed.store import DynamicGroup, RowLayout, TableSettings, Uniform
from hugeembed.store._dynamic import pick_backend
from hugeembed.store._index import EMPTY_TABLE, PENDING, Outcome, home, need_length, new_buckets
from hugeembed.store._index_torch import TorchIndex
from hugeembed.store import _index_triton
from hugeembed.store._index_triton import TritonIndex

pytestmark = pytest.mark.triton

LAY = RowLayout(4, torch.float32, 1)
POOL = list(range(-3, 30)) + [SHARED_ROW_KEY, 2**62 + 5, -(2**63)]
# CUDA where present (bench/gpu_check.sh tests selects ids naming cuda); else CPU tensors under the interpreter
on_device = pytest.mark.parametrize("device", ["cuda" if torch.cuda.is_available() else "cpu"])


def _group(backend: str, device: str, buckets: int = 16) -> DynamicGroup:
    """Three tables of one group: rows at once (capacity 8: full tables evict), admission after 2
    hits, the probability filter; a tiny bucket array so keys crowd and the index must grow."""
    tables = [TableSettings("plain", LAY, salt=11, capacity=8, initializer=Uniform(-1, 1), seed=1),
              TableSettings("counted", LAY, salt=12, admit_min_count=2, initializer=Uniform(-1, 1), seed=2),
              TableSettings("sampled", LAY, salt=13, admit_probability=0.5, initializer=Uniform(-1, 1), seed=3)]
    g = DynamicGroup(tables, backend=backend, device=device)
    g.buckets = new_buckets(buckets, device)
    return g


def _state(g: DynamicGroup) -> dict:
    return {"buckets": g.buckets, "free_rows": g.free_rows, "scalars": g.scalars, "tables": g.tables, "rows": g.rows}


def _assert_same(a: DynamicGroup, b: DynamicGroup) -> None:
    for name, x in _state(a).items():
        y = _state(b)[name]
        assert x.shape == y.shape and torch.equal(x, y), f"{name} differ"


def _batch(entries: list[tuple[int, int, int]], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, k, c = zip(*entries) if entries else ((), (), ())
    return tuple(torch.tensor(x, dtype=torch.int64, device=device) for x in (t, k, c))


def _unique(entries):
    seen, out = set(), []
    for t, k, c in entries:
        if t < 0 or (t, k) not in seen:
            seen.add((t, k))
            out.append((t, k, c))
    return out


def _fetch_both(a: DynamicGroup, b: DynamicGroup, tids, keys, counts, step: int) -> tuple:
    """One find-or-insert on both groups' indexes (the raw call: outcome, need, new rows compared);
    a refusal is then settled by each group as a step would (growth, eviction, an error).  Returns
    the raw call's (outcome, vars(need))."""
    admit = a._admission(tids, keys, step)
    got = []
    for g in (a, b):
        out, hits = torch.full_like(keys, 7), torch.full_like(keys, 7)
        rc, need, made = g._index.find_or_insert(g, keys, tids, counts, admit, step, out, hits, None)
        got.append((rc, vars(need), [x.tolist() for x in made], out.tolist(), hits.tolist()))
    assert got[0] == got[1]
    _assert_same(a, b)
    if got[0][0] == Outcome.DONE:
        return got[0][:2]
    errors = []
    for g in (a, b):
        try:
            g.find_or_insert(tids, keys, step, counts)
            errors.append(None)
        except (InputError, CapacityError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    assert errors[0] == errors[1]
    _assert_same(a, b)
    return got[0][:2]


def test_the_kernels_constants_are_the_layouts():
    from hugeembed._triton import hash_need
    from hugeembed.store._index import NEED_HEAD, PROBE_LIMIT

    assert (hash_index.EMPTY_TABLE, hash_index.PENDING) == (EMPTY_TABLE, PENDING)
    assert (hash_need.NEED_HEAD, hash_need.PROBE_LIMIT) == (NEED_HEAD, PROBE_LIMIT)
    assert (hash_need._GROW, hash_need._OVER, hash_need._DUP, hash_need._LONG) == (
        Outcome.MUST_GROW, Outcome.OVER_LIMIT, Outcome.DUPLICATE_KEY, Outcome.LONG_PROBE)


op = st.one_of(
    st.tuples(st.just("fetch"), st.lists(st.tuples(st.integers(-1, 2), st.sampled_from(POOL), st.integers(1, 3)),
                                         max_size=22), st.sampled_from([False, False, False, True])),
    st.tuples(st.just("find"), st.lists(st.tuples(st.integers(-1, 2), st.sampled_from(POOL)), max_size=12)),
    st.tuples(st.just("remove"), st.integers(0, 2), st.integers(1, 4)),
    st.tuples(st.just("reload"), st.integers(0, 2)),
)


@on_device
@settings(max_examples=30)
@given(ops=st.lists(op, min_size=1, max_size=6))
@pytest.mark.slow
def test_triton_index_equals_the_torch_index_call_for_call(device, ops):
    a, b = _group("torch", device), _group("triton", device)
    for step, (kind, *args) in enumerate(ops):
        if kind == "fetch":
            entries, twin = args
            entries = _unique(entries)
            if twin and entries:  # a key given twice: refused (if new) or counted, alike
                entries.append(entries[len(entries) // 2])
            _fetch_both(a, b, *_batch(entries, device), step)
        elif kind == "find":
            t, k, _ = _batch([(t, k, 1) for t, k in args[0]], device)
            found = [(g.find(t, k), g.codes(t, k), g.hit_counts(t, k)) for g in (a, b)]
            assert all(torch.equal(x, y) for x, y in zip(*found))
        elif kind == "remove":
            t, most = args
            keys = a.entries(t)[0][:most]
            assert a.remove(t, keys) == b.remove(t, keys)
        else:  # a table's export loaded back: its keys dropped, then inserted (TritonIndex.insert)
            exported = a.view(args[0]).export()
            for g in (a, b):
                g.import_(args[0], exported)
        _assert_same(a, b)
        b.check_layout()


@on_device
def test_a_tables_export_loads_back_into_the_triton_index_as_into_the_torch_one(device):
    """TritonIndex.insert (a snapshot's keys loaded back) places, counts and codes as the reference does."""
    a, b = _group("torch", device), _group("triton", device)
    _fetch_both(a, b, *_batch(_unique([(0, 5, 1), (1, 6, 1), (0, 7, 2), (0, 9, 3), (2, 4, 1)]), device), 0)
    exported = a.view(0).export()
    assert exported.keys.numel() >= 1
    for g in (a, b):
        g.import_(0, exported)
    _assert_same(a, b)
    b.check_layout()


@on_device
def test_the_shared_rows_key_new_keys_promotions_and_full_tables_in_one_call(device):
    a, b = _group("torch", device, buckets=64), _group("triton", device, buckets=64)
    batches = [[(1, 5, 1), (1, 6, 1), (0, 1, 1), (1, SHARED_ROW_KEY, 2), (2, 9, 1)],
               [(1, 5, 1), (1, 6, 3), (0, 1, 2), (0, 2, 1), (1, SHARED_ROW_KEY, 2), (-1, 4, 1)],
               [(0, k, 1) for k in range(10, 17)] + [(1, 5, 1)]]  # table 0 past its capacity of 8: evicts
    for step, entries in enumerate(batches):
        _fetch_both(a, b, *_batch(entries, device), step)
    assert a.table_rows(0) <= 8 and int((a.buckets[:, 1] != EMPTY_TABLE).sum()) == int(a.scalars[0])


@on_device
def test_a_count_below_one_is_refused_alike_and_changes_nothing(device):
    a, b = _group("torch", device), _group("triton", device)
    _fetch_both(a, b, *_batch([(0, 1, 1), (1, 2, 1)], device), 0)
    t, k, c = _batch([(0, 1, 1), (1, 3, 0)], device)
    messages = []
    for g in (a, b):
        with pytest.raises(InputError) as e:
            g.find_or_insert(t, k, 1, c)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and "counts must be >= 1" in messages[0]
    _assert_same(a, b)


def _crowded(g: DynamicGroup, n: int, t: int = 0) -> list[int]:
    """n keys of table t whose homes in g's buckets fall on two neighbouring buckets."""
    keys = torch.arange(200_000, dtype=torch.int64, device=g.device)
    h = home(keys, torch.full_like(keys, int(g.tables[t, 4])), g.buckets.shape[0])
    return keys[(h == 3) | (h == 4)][:n].tolist()


@pytest.mark.parametrize("one_program", [1024, 0], ids=["claims-in-one-program", "launched-rounds"])
@pytest.mark.parametrize("seed", [3])
@on_device
def test_results_do_not_depend_on_the_order_programs_run_in(device, seed, one_program, monkeypatch):
    """Both ways to place new keys (one program, or launched rounds then that program) under shuffled programs."""
    monkeypatch.setattr(_index_triton, "_ONE_PROGRAM", one_program)
    ref, one_grid = _group("torch", device, buckets=64), _group("triton", device, buckets=64)
    shuffled = _group("triton", device, buckets=64)
    shuffled._index = TritonIndex(block=4, claim_block=4, shuffle=torch.Generator().manual_seed(seed))
    crowd = _crowded(ref, 12)  # crowds on two homes: ranks, clashes and losers in every round
    rng = torch.Generator().manual_seed(seed)
    for step in range(2):
        extra = torch.randint(0, 40, (8,), generator=rng).tolist()
        entries = _unique([(0, k, 1) for k in crowd[step * 6 : step * 6 + 8]] + [(1, k, 1) for k in extra])
        t, k, c = _batch(entries, device)
        order = torch.randperm(len(entries), generator=rng).to(device)  # the batch in another order each step
        t, k, c = t[order], k[order], c[order]
        outs = [g.find_or_insert(t, k, step, c) for g in (ref, one_grid, shuffled)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        _assert_same(ref, one_grid)
        _assert_same(ref, shuffled)
        assert torch.equal(shuffled.codes(t, k), ref.codes(t, k))


@pytest.mark.parametrize("one_program", [1024, 0], ids=["claims-in-one-program", "launched-rounds"])
@on_device
def test_a_crowd_longer_than_the_launched_rounds_is_placed_on_the_device_as_the_reference_places_it(device,
                                                                                                     monkeypatch,
                                                                                                     one_program):
    """What the three rounds leave (or every new key, at most _ONE_PROGRAM of them), the one-program kernel
    places in rounds on the device (no read), bucket for bucket as the reference; the next call's report
    says nothing was left unplaced."""
    monkeypatch.setattr(_index_triton, "_ONE_PROGRAM", one_program)
    a, b = _group("torch", device, buckets=640), _group("triton", device, buckets=640)
    left_before = []
    finish = TritonIndex._finish
    monkeypatch.setattr(TritonIndex, "_finish",
                        lambda self, *args: left_before.append(int(args[-2][0])) or finish(self, *args))
    reads, calls = [], []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, _f=torch.Tensor.tolist: reads.append(t.shape) or _f(t))
    call = TritonIndex.find_or_insert
    monkeypatch.setattr(TritonIndex, "find_or_insert", lambda self, *args: calls.append(1) or call(self, *args))
    crowd = _crowded(a, 300, t=1)  # 300 keys on two homes: past the 32 + 64 + 128 buckets of the first rounds
    batch = _batch([(0, k, 1) for k in crowd[:4]] + [(1, k, 2) for k in crowd], device)
    reads.clear()
    _fetch_both(a, b, *batch, 0)  # (refused: the group grows, then the call again)
    assert left_before  # the kernel had records to place: all 304, or what the launched rounds left
    assert (0 < left_before[0] < 304) if one_program == 0 else (left_before[0] == 304)
    assert int(b.scalars[0]) == 304 and int(b._index._stuck[0]) == 0
    assert reads.count(torch.Size([need_length(3) + 8])) == len(calls) == 2  # each call's one read
    _fetch_both(a, b, *_batch([(2, 5, 1), (0, 7, 1)], device), 1)  # (its report: nothing left unplaced)


@pytest.mark.parametrize("key32", [True, False], ids=["int32-sort-key", "int64-sort-key"])
@on_device
def test_duplicates_and_crowds_are_reported_as_the_reference_reports_them(device, key32, monkeypatch):
    """The need kernel's checks from the sort by home: the smallest (table, key) given twice among new
    keys and among promotions (twins of other tables and keys around), and the new keys' own crowding
    (their longest probe alone in an empty index, with its table), need[] for need[]."""
    if not key32:  # (int64 above 2^30 buckets)
        monkeypatch.setattr(_index_triton, "_SORT_KEY_32", 0)
    a, b = _group("torch", device, buckets=256), _group("triton", device, buckets=256)
    crowd = _crowded(a, 9, t=1)  # nine new keys on two homes: a crowd longer than any probe
    rc, need = _fetch_both(a, b, *_batch([(0, 40, 1)] + [(1, k, 2) for k in crowd], device), 0)
    assert need["longest"] >= 5 and need["long_table"] == 1 and a.tables[1, 0] == 9  # (after growing: rows)
    rc, need = _fetch_both(a, b, *_batch([(1, 50, 1), (2, 7, 1), (0, 9, 1), (1, 50, 1), (2, 7, 1), (0, 9, 1),
                                          (0, 8, 1)], device), 1)
    assert rc == Outcome.DUPLICATE_KEY and (need["dup_table"], need["dup_key"]) == (0, 9)
    p, q = 300_000, 300_001  # (not among the crowd's keys)
    _fetch_both(a, b, *_batch([(1, p, 1), (1, q, 1)], device), 2)  # pending in "counted"
    rc, need = _fetch_both(a, b, *_batch([(1, q, 1), (0, 70, 1), (1, p, 1), (1, q, 1), (1, p, 1)], device), 3)
    assert rc == Outcome.DUPLICATE_KEY and (need["dup_table"], need["dup_key"]) == (1, p)  # among promotions


class _ScalarReads(TorchDispatchMode):
    """Counts reads of one element to the host (item(), int(t), bool(t), t[i] with a 0-d index i)
    outside the kernels' launches (the interpreter's own work is not the index's)."""

    def __init__(self):
        super().__init__()
        self.reads, self.paused = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and func.overloadpacket.__name__ == "_local_scalar_dense":
            self.reads += 1
        return func(*args, **(kwargs or {}))


@on_device
def test_a_find_or_insert_reads_the_host_only_for_its_need(device, monkeypatch):
    g = _group("triton", device, buckets=256)
    g.find_or_insert(*_batch([(0, 99, 1)], device)[:2], 0)  # rows to hand out
    launch = TritonIndex._launch
    spy = _ScalarReads()

    def launch_unwatched(self, *args, **kwargs):
        spy.paused = True
        try:
            launch(self, *args, **kwargs)
        finally:
            spy.paused = False

    monkeypatch.setattr(TritonIndex, "_launch", launch_unwatched)
    needs = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, _f=torch.Tensor.tolist: needs.append(t.shape) or _f(t))
    t, k, c = _batch([(0, 1, 1), (1, 2, 1), (1, 3, 2), (2, 4, 1), (0, 5, 1), (-1, 6, 1)], device)
    with spy:
        rc, need, made = g._index.find_or_insert(g, k, t, c, None, 0, torch.empty_like(k), None, None)
    assert rc == Outcome.DONE and need.made == 4
    assert spy.reads == 0
    report = torch.Size([need_length(3) + 8])  # need[] and the extras (hugeembed/_triton/hash_need.py)
    assert needs == [report]  # new keys: the one read (the claims launched after it read nothing)
    needs.clear()
    with spy:  # no new key (a step's steady state), one promotion: the one read
        rc, need, made = g._index.find_or_insert(g, k, t, c, None, 1, torch.empty_like(k), None, None)
    assert rc == Outcome.DONE and need.made == 1 and need.entries == 0  # (1, 2) promoted: its second hit
    assert spy.reads == 0 and needs == [report]
    needs.clear()
    with spy:  # one new key: its first claim round places it, no second read
        rc, need, made = g._index.find_or_insert(g, k[:1] + 100, t[:1], c[:1], None, 2, torch.empty_like(k[:1]),
                                                 None, None)
    assert rc == Outcome.DONE and need.made == 1 and need.entries == 1
    assert spy.reads == 0 and needs == [report]
    assert g.find(t[:1], k[:1] + 100).tolist() == made[0].tolist()


def _collection(backend: str, device: str) -> EmbeddingCollection:
    tables = [TableConfig("user", 4, initializer=Uniform(-0.1, 0.1), seed=1, admit_min_count=2, shared_row=True),
              TableConfig("item", 4, initializer=Uniform(-0.1, 0.1), seed=2, combiner="mean")]
    ec = EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1), backend="torch", device=device)
    for g in ec.groups:
        if g.kind == "dynamic":
            g.use_backend(backend)
    return ec


@on_device
def test_a_collection_on_the_triton_index_trains_to_the_torch_twins_state(device):
    twins = [_collection("torch", device), _collection("triton", device)]
    assert [g.backend for g in twins[1].groups] == ["triton"]
    rng = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = {name: [torch.randint(0, 12, (int(torch.randint(0, 3, (1,), generator=rng)),), generator=rng).tolist()
                      for _ in range(6)] for name in ("user", "item")}
        coef = torch.randn(6, 4, generator=rng)
        for ec in twins:
            out = ec(SparseFeatures.from_lists(ids).to(device))
            (sum(out[name] for name in ("user", "item")) * coef.to(device)).sum().backward()
    sa, sb = (ec.state_dict() for ec in twins)
    assert sa.keys() == sb.keys()
    for name in sa:
        x, y = sa[name], sb[name]
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name


def test_cuda_groups_choose_the_triton_index_and_cpu_tensors_only_under_the_interpreter(monkeypatch):
    assert pick_backend(None, torch.device("cuda")) == "triton"
    if interpreting():
        assert pick_backend("triton", torch.device("cpu")) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="triton backend runs on CUDA"):
        pick_backend("triton", torch.device("cpu"))
    assert isinstance(_group("torch", "cpu")._index, TorchIndex)


@on_device
def test_records_a_call_left_unplaced_fail_the_next_call_before_it_changes_anything(device):
    """claim_finish_kernel cannot place a record only when the index has no empty bucket (an internal error); it
    leaves the count where the next call's report reads it: that call raises and changes nothing."""
    from hugeembed.errors import StoreError

    g = _group("triton", device, buckets=64)
    g.find_or_insert(*_batch([(0, 1, 1), (0, 2, 1)], device)[:2], 0)
    g._index._stuck = torch.ones(1, dtype=torch.int64, device=device)  # (as the kernel leaves one record unplaced)
    before = {name: x.clone() for name, x in _state(g).items()}
    with pytest.raises(StoreError, match="1 new keys of the call before found no empty bucket"):
        g.find_or_insert(*_batch([(0, 1, 1), (0, 3, 1), (1, 4, 1)], device)[:2], 1)  # a known key, two new
    assert all(torch.equal(x, _state(g)[name]) for name, x in before.items())
