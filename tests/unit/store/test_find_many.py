"""find_or_insert_many (the collection's one-call fetch) against a plain loop of find_or_insert."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hugeembed import _native
from hugeembed.errors import CapacityError, InputError
from hugeembed.optim import FTRL, Adagrad
from hugeembed.store import ArrayStore, DictStore, FromCallable, HashStore, RowBlock, Uniform, find_or_insert_many

from store_helpers import SPECIAL_KEYS, check_layout

from tests.conftest import DEVICES

native = pytest.mark.skipif(not _native.available(), reason="needs the native kernels")


def make_stores():
    """One of each kind the batched kernel takes or must hand back to the loop."""
    ada, ftrl = Adagrad(lr=0.1, initial_accumulator_value=0.25), FTRL(lr=0.1, initial_accumulator_value=0.5)

    def unmarked(state):  # a user's init_state: not known to fill rows alike -> loop path
        state.fill_(0.75)

    return [
        HashStore("plain", 3, seed=1),
        HashStore("adagrad", 4, ada.state_width(4), init_state=ada.init_state, seed=2, initializer=Uniform(-1, 1)),
        HashStore("ftrl", 2, ftrl.state_width(2), init_state=ftrl.init_state, seed=3, admit_min_count=3),
        HashStore("capped", 2, seed=4, capacity=40, eviction_policy="lru"),
        HashStore("torch", 3, seed=5, backend="torch"),
        HashStore("custom_state", 2, 1, init_state=unmarked, seed=6),
        HashStore("callable_init", 2, seed=7, initializer=FromCallable(lambda k, d: k[:, None].float().expand(-1, d))),
        ArrayStore("static", 50, 3, seed=8),
        ArrayStore("static2", 50, 2, seed=10),
        DictStore("dict", 2, seed=9),
    ]


def batch(g: torch.Generator, store, n: int):
    hi = 50 if isinstance(store, ArrayStore) else 120
    keys = torch.randint(0 if hi == 50 else -hi, hi, (n,), generator=g).unique()
    if store.name == "plain":
        keys = torch.cat([keys, torch.tensor(SPECIAL_KEYS)]).unique()
    if store.name == "capped":  # a batch fits the capacity; across batches the table evicts
        keys = keys[:30]
    counts = torch.randint(1, 4, (keys.numel(),), generator=g)
    return keys[torch.randperm(keys.numel(), generator=g)], counts


@native
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 8), size=st.integers(0, 60), with_counts=st.booleans(),
       into=st.sampled_from(["none", "views", "strided"]))
def test_many_equals_a_loop_of_find_or_insert(seed, steps, size, with_counts, into):
    """`into`: where the slots go (new tensors; views of one buffer, as the collection passes;
    buffers the kernels cannot write, copied into)."""
    ours, loop = make_stores(), make_stores()
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        work = [batch(g, s, size) for s in ours]
        counts = [c for _, c in work] if with_counts else None
        sizes = [k.numel() for k, _ in work]
        out = None
        if into == "views":
            out = list(torch.full((sum(sizes),), -7, dtype=torch.int64).split(sizes))
        elif into == "strided":
            out = [torch.full((2 * n,), -7, dtype=torch.int64)[::2] for n in sizes]
        got = find_or_insert_many(ours, [k for k, _ in work], step, counts=counts, out=out)
        want = [s.find_or_insert(k, step, counts=c if with_counts else None) for s, (k, c) in zip(loop, work)]
        for i, (s, a, b) in enumerate(zip(ours, got, want)):
            assert torch.equal(a, b), s.name
            if out is not None:
                assert a is out[i] and torch.equal(out[i], b), s.name
    for a, b in zip(ours, loop):
        ea, eb = a.export(), b.export()
        for f in ea.__dataclass_fields__:
            assert torch.equal(getattr(ea, f), getattr(eb, f)), (a.name, f)
        if isinstance(a, HashStore):
            check_layout(a)


@native
def test_new_rows_start_with_the_optimizer_state_and_initializer_of_the_loop():
    ada = Adagrad(lr=0.1, initial_accumulator_value=0.25)
    stores = [HashStore(f"t{i}", 4, ada.state_width(4), init_state=ada.init_state, seed=i, initial_rows=64)
              for i in range(3)]
    keys = [torch.arange(10) * (i + 1) for i in range(3)]
    slots = find_or_insert_many(stores, keys, 1)
    for i, (s, sl) in enumerate(zip(stores, slots)):
        rows = s.storage()[sl]
        fresh = HashStore("ref", 4, ada.state_width(4), init_state=ada.init_state, seed=i)
        assert torch.equal(rows, fresh.gather(fresh.find_or_insert(keys[i], 1)))
        assert bool((rows[:, 4:] == 0.25).all())


def test_errors_name_the_table():
    a, b = HashStore("a", 2, initial_rows=16), HashStore("b", 2, initial_rows=16)
    with pytest.raises(InputError, match="'b'.*counts must be >= 1"):
        find_or_insert_many([a, b], [torch.tensor([1, 2]), torch.tensor([3])], 1,
                            counts=[torch.tensor([1, 1]), torch.tensor([0])])
    assert len(a) + len(b) <= 2  # a table before the bad one may have taken its keys, the bad one none
    assert b.find(torch.tensor([3])).item() == -1
    with pytest.raises(InputError, match="'a'.*given twice"):
        find_or_insert_many([a, b], [torch.tensor([5, 5]), torch.tensor([6])], 2)
    with pytest.raises(InputError, match="store is given twice"):
        find_or_insert_many([a, a], [torch.tensor([1]), torch.tensor([2])], 3)
    with pytest.raises(InputError, match="2 stores, 1 key tensors"):
        find_or_insert_many([a, b], [torch.tensor([1])], 3)
    full = HashStore("full", 2, capacity=2, on_full="error", initial_rows=2)
    with pytest.raises(CapacityError, match="'full'"):
        find_or_insert_many([a, full], [torch.tensor([7]), torch.tensor([1, 2, 3])], 4)


@native
def test_a_bad_static_key_names_its_table_and_touches_no_static_table():
    a, b = ArrayStore("a", 10, 2), ArrayStore("b", 10, 2)
    before = [s.export_index() for s in (a, b)]
    with pytest.raises(InputError, match="'b': key 10 is outside"):
        find_or_insert_many([a, b], [torch.tensor([1, 2]), torch.tensor([3, 10])], 1)
    with pytest.raises(InputError, match="'a'.*counts must be >= 1"):
        find_or_insert_many([a, b], [torch.tensor([1]), torch.tensor([3])], 1,
                            counts=[torch.tensor([0]), torch.tensor([1])])
    for s, e in zip((a, b), before):
        after = s.export_index()
        assert torch.equal(after.counts, e.counts) and torch.equal(after.last_step, e.last_step), s.name


@native
def test_settings_changed_after_a_call_take_effect_at_once():
    """capacity and initializer are read per call (no stale copy in the batched path)."""
    a = HashStore("a", 2, capacity=30, on_full="error", initial_rows=64)
    b = HashStore("b", 2, initial_rows=64)
    find_or_insert_many([a, b], [torch.arange(5), torch.arange(5)], 1)
    a.capacity = 6
    with pytest.raises(CapacityError, match="'a'.*capacity 6"):
        find_or_insert_many([a, b], [torch.arange(5, 12), torch.arange(5, 12)], 2)
    b.initializer = FromCallable(lambda k, d: torch.full((k.numel(), d), 7.0))  # no kernel: the loop path
    find_or_insert_many([a, b], [torch.tensor([0]), torch.arange(100, 104)], 3)
    assert bool((b.gather(b.find(torch.arange(100, 104))) == 7.0).all())
    b.initializer = Uniform(5.0, 6.0)  # a kernel initializer again: the batched path reads the new one
    find_or_insert_many([a, b], [torch.tensor([0]), torch.arange(200, 204)], 4)
    rows = b.gather(b.find(torch.arange(200, 204)))
    assert bool(((rows >= 5.0) & (rows <= 6.0)).all())


def test_more_bad_arguments_are_clear_errors():
    import copy

    a = HashStore("a", 2)
    with pytest.raises(InputError, match="shallow copy"):
        find_or_insert_many([a, copy.copy(a)], [torch.tensor([1]), torch.tensor([2])], 1)
    with pytest.raises(InputError, match="int is not a row store"):
        find_or_insert_many([a, 3], [torch.tensor([1]), torch.tensor([2])], 1)
    with pytest.raises(InputError, match="step must be an int"):
        find_or_insert_many([a], [torch.tensor([1])], "x")


def _static_stores(device, blocked=False):
    """Four static tables; `blocked`: the first three keep their rows in one RowBlock."""
    places = RowBlock.for_tables([20, 21, 22], 2, torch.float32, device) if blocked else [None] * 3
    return [ArrayStore(f"s{i}", 20 + i, 2, seed=i, device=device, block=places[i] if i < 3 else None)
            for i in range(4)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocked", [False, True])
def test_static_tables_without_kernels_checked_at_once_and_equal_the_loop(device, blocked, monkeypatch):
    """Static tables the kernels do not take (on a GPU; here the kernels switched off): one
    batched range / count check, then the same slots, hit counts and steps as find_or_insert
    (tables of one RowBlock counted together)."""
    monkeypatch.setattr(_native, "available", lambda: False)
    g = torch.Generator().manual_seed(3)
    keys = [torch.randint(0, 20, (9,), generator=g).unique().to(device) for _ in range(4)]
    counts = [torch.randint(1, 4, (k.numel(),), generator=g).to(device) for k in keys]
    many, loop = _static_stores(device, blocked), _static_stores(device)
    assert all((s.block_rows() is not None) == (blocked and i < 3) for i, s in enumerate(many))
    got = find_or_insert_many(many, keys, 5, counts=counts)
    for s, k, c, out in zip(loop, keys, counts, got):
        assert torch.equal(out.cpu(), s.find_or_insert(k, 5, counts=c).cpu())
    for a, b in zip(many, loop):
        assert torch.equal(a.hit_counts(torch.arange(a.num_rows, device=device)).cpu(),
                           b.hit_counts(torch.arange(b.num_rows, device=device)).cpu())
        assert torch.equal(a.export().last_step.cpu(), b.export().last_step.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["key", "count"])
@pytest.mark.parametrize("blocked", [False, True])
def test_static_tables_without_kernels_bad_input_changes_no_table(device, bad, blocked, monkeypatch):
    monkeypatch.setattr(_native, "available", lambda: False)
    stores = _static_stores(device, blocked)
    keys = [torch.tensor([0, 3, 5], device=device) for _ in stores]
    counts = [torch.ones(3, dtype=torch.int64, device=device) for _ in stores]
    if bad == "key":
        keys[2] = torch.tensor([1, 22, 4], device=device)  # table s2 has 22 rows
        match = r"table 's2': key 22 is outside \[0, 22\)"
    else:
        counts[1] = torch.tensor([1, 0, 1], device=device)
        match = r"table 's1': counts must be >= 1 .* got 0"
    with pytest.raises(InputError, match=match):
        find_or_insert_many(stores, keys, 1, counts=counts)
    for s in stores:  # no table counted a hit
        assert int(s.hit_counts(torch.arange(s.num_rows, device=device)).sum()) == 0
