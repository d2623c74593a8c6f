"""Rows of batches whose backward has not run stay in place (issue: gradients landing on other ids).

Oracle: the same training with no capacity limit (nothing is ever evicted), where the
accumulated or pipelined run and the plain run are equal where the math allows it.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed import CapacityError, InputError, StoreError
from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD, Adagrad
from hugeembed.store import Uniform


def sf(bags):
    return SparseFeatures.from_lists({"u": bags})


def collection(capacity=None, *, ttl=None, policy="lfu", optimizer=None, backend="auto"):
    return EmbeddingCollection(
        [TableConfig("u", dim=3, capacity=capacity, on_full="evict", eviction_policy=policy, combiner="sum",
                     ttl=ttl, evict_interval=1, initializer=Uniform(-0.5, 0.5))],
        optimizer=optimizer or SGD(lr=1.0), backend=backend)


def rows_of(ec, ids):
    store = ec.store("u")
    slots = store.find(torch.tensor(ids, dtype=torch.int64))
    assert bool((slots >= 0).all()), f"ids {ids} should all have rows"
    return store.storage()[slots, :3].clone()


def coef(i: int) -> torch.Tensor:
    """A fixed, distinct gradient direction per forward, so every bag's gradient differs."""
    return torch.tensor([1.0 + i, -0.5 * i, 0.25]) / (1 + i)


def test_the_reported_case_no_longer_moves_other_ids():
    ec = collection(capacity=2)
    o1 = ec(sf([[1], [2]]))
    before = rows_of(ec, [1, 2])
    with pytest.raises(CapacityError, match="pinned"):
        ec(sf([[3], [4]]))  # would have to evict ids 1, 2, whose backward has not run
    assert ec.step == 1 and len(ec.store("u")) == 2  # the failed forward changed nothing
    (o1["u"].sum() * 100).backward()
    assert torch.equal(rows_of(ec, [1, 2]), before - 100.0)  # SGD lr 1, gradient 100 per element
    ec(sf([[3], [4]]))  # now ids 1, 2 may go
    assert ec.store("u").find(torch.tensor([1, 2])).tolist() == [-1, -1]


def run_windows(windows, capacity, optimizer):
    """Gradient accumulation: every window's forwards, then one backward of their summed loss."""
    ec = collection(capacity, optimizer=optimizer)
    outs = []
    for window in windows:
        got = [ec(sf(b)) for b in window]
        loss = sum((o["u"] * coef(i)).sum() for i, o in enumerate(got))
        loss.backward()
        outs.append([o["u"].detach() for o in got])
    return ec, outs


# windows of 2-4 forwards; each window reads fresh ids (so an evicted row is never read
# again and the capacity run must equal the unlimited one), repeating ids inside it so
# that older rows have more hits than the current window's and LFU would pick the latter
window_ids = st.lists(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=3),
                      min_size=2, max_size=4)


@settings(max_examples=40, deadline=None)
@given(st.lists(window_ids, min_size=2, max_size=5), st.sampled_from(["sgd", "adagrad"]))
def test_accumulation_under_eviction_pressure_equals_the_unlimited_run(raw, opt):
    windows = [[[[w * 10 + i for i in bag] for bag in batch] for batch in window] for w, window in enumerate(raw)]
    capacity = max(len({i for batch in window for bag in batch for i in bag}) for window in windows)
    make = (lambda: SGD(lr=0.5)) if opt == "sgd" else (lambda: Adagrad(lr=0.5))
    ec, outs = run_windows(windows, capacity, make())
    ref, ref_outs = run_windows(windows, None, make())
    for a, b in zip(outs, ref_outs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    last = sorted({i for batch in windows[-1] for bag in batch for i in bag})
    assert torch.equal(rows_of(ec, last), rows_of(ref, last))
    assert len(ec.store("u")) <= capacity


def test_accumulation_regression_lfu_prefers_the_in_flight_rows():
    # window 1 touches ids 0..2 three times each (count 3); window 2's first forward reads
    # ids 10, 11 (count 1): LFU would evict them to make room for window 2's second forward.
    windows = [[[[0, 1, 2]], [[0, 1, 2]], [[0, 1, 2]]], [[[10], [11]], [[12], [13], [14]]]]
    ec, outs = run_windows(windows, 5, SGD(lr=0.5))
    ref, ref_outs = run_windows(windows, None, SGD(lr=0.5))
    assert torch.equal(rows_of(ec, [10, 11, 12, 13, 14]), rows_of(ref, [10, 11, 12, 13, 14]))


def run_pipelined(batches, capacity, pipelined: bool):
    """Train on `batches`; pipelined: the forward of batch i+1 runs before the backward of batch i."""
    ec = collection(capacity, optimizer=Adagrad(lr=0.3))
    outs, pending = [], None
    for i, b in enumerate(batches):
        if not pipelined:
            o = ec(sf(b))
            (o["u"] * coef(i)).sum().backward()
            outs.append(o["u"].detach())
            continue
        o = ec(sf(b))
        if pending is not None:
            j, p = pending
            (p["u"] * coef(j)).sum().backward()
        pending = (i, o)
        outs.append(o["u"].detach())
    if pipelined and pending is not None:
        j, p = pending
        (p["u"] * coef(j)).sum().backward()
    return ec, outs


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=3),
                min_size=2, max_size=6))
def test_pipelined_order_equals_plain_order_when_neighbours_share_no_id(raw):
    # consecutive batches read disjoint ids (even / odd ranges), so reading batch i+1 before
    # batch i's update changes nothing; batches two apart share ids and must see the update
    shared = [[[i * 2 + k % 2 for i in bag] for bag in b] for k, b in enumerate(raw)]
    # under a capacity, rows of finished batches are evicted: only batches that never read
    # an id again can equal the unlimited run, so those take fresh ids each
    fresh = [[[k * 10 + i for i in bag] for bag in b] for k, b in enumerate(raw)]
    capacity = max(len({i for bag in a for i in bag} | {i for bag in b for i in bag})
                   for a, b in zip(fresh, fresh[1:]))
    for batches, cap in ((shared, None), (fresh, capacity)):
        ec, outs = run_pipelined(batches, cap, True)
        ref, ref_outs = run_pipelined(batches, None, False)
        for x, y in zip(outs, ref_outs):
            assert torch.equal(x, y)
        last = sorted({i for bag in batches[-1] for i in bag})
        assert torch.equal(rows_of(ec, last), rows_of(ref, last))


def test_ttl_never_evicts_rows_of_a_batch_in_flight():
    ec = collection(ttl=1)
    o1 = ec(sf([[1, 2]]))
    start = rows_of(ec, [1, 2])
    ec(sf([[7]]))  # step 2
    ec(sf([[8]]))  # step 3: ids 1, 2 unseen for 2 > ttl steps, but pinned
    (o1["u"] * coef(0)).sum().backward()
    assert torch.equal(rows_of(ec, [1, 2]), start - coef(0))  # SGD lr 1 on the rows it read
    ec(sf([[9]]))  # step 4: released, and now old enough to go
    assert ec.store("u").find(torch.tensor([1, 2])).tolist() == [-1, -1]


def test_a_dropped_output_releases_its_rows():
    ec = collection(capacity=2)
    o1 = ec(sf([[1], [2]]))
    del o1
    gc.collect()
    ec(sf([[3], [4]]))  # ids 1, 2 are no longer pinned: evicted
    assert ec.store("u").find(torch.tensor([1, 2])).tolist() == [-1, -1]


def test_a_second_backward_after_eviction_is_refused():
    ec = collection(capacity=4)
    o1 = ec(sf([[1], [2]]))
    loss = o1["u"].sum()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)  # nothing evicted since: applies again, as torch would
    ec(sf([[3], [4], [5]]))  # evicts ids 1, 2 (released): their slots go to new ids
    moved = rows_of(ec, [3, 4, 5])
    with pytest.raises(StoreError, match="second backward"):
        loss.backward()
    assert torch.equal(rows_of(ec, [3, 4, 5]), moved)


def test_a_table_replaced_between_forward_and_backward_is_refused():
    ec = collection()
    o1 = ec(sf([[1], [2]]))
    with pytest.raises(StoreError, match="cannot import"):
        ec.store("u").import_(ec.store("u").export())  # an import would move pinned rows
    state = {k: v.clone() for k, v in ec.state_dict().items()}
    ec.load_state_dict(state)
    with pytest.raises(StoreError, match="replaced"):
        o1["u"].sum().backward()


def test_a_failed_forward_takes_no_step_and_evicts_nothing():
    ec = EmbeddingCollection([TableConfig("u", dim=3, ttl=1, evict_interval=1),
                              TableConfig("s", dim=3, num_rows=5)], optimizer=SGD(lr=0.1))
    good = SparseFeatures.from_lists({"u": [[1]], "s": [[0]]})
    bad = SparseFeatures.from_lists({"u": [[2]], "s": [[9]]})  # id 9 is outside static table "s"
    ec(good)
    for _ in range(3):
        with pytest.raises(InputError, match="'s'"):
            ec(bad)
    assert ec.step == 1
    assert ec.store("u").find(torch.tensor([1, 2])).tolist()[1] == -1  # id 2 was not inserted
    assert ec.store("u").find(torch.tensor([1])).item() >= 0  # ttl did not run for the failed steps
    ec(good)
    assert ec.step == 2


def test_a_second_backward_after_an_import_moved_rows_is_refused():
    ec = collection()
    o1 = ec(sf([[1], [2]]))
    loss = (o1["u"] * torch.tensor([[1.0], [10.0]])).sum()
    loss.backward(retain_graph=True)
    store = ec.store("u")
    ex = store.export()
    swapped = type(ex)(ex.keys, ex.rows.flip(0), ex.counts, ex.last_step, ex.pending_keys, ex.pending_counts,
                       ex.pending_last_step)
    store.import_(swapped)  # existing keys get new slots
    rows = rows_of(ec, [1, 2])
    with pytest.raises(StoreError, match="second backward"):
        loss.backward()
    assert torch.equal(rows_of(ec, [1, 2]), rows)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("what", ["weights", "max_norm"])
def test_an_older_backward_differentiates_at_the_rows_its_forward_read(backend, what):
    """Batches A then B forward, then B's backward (its update changes rows A read), then A's:
    A's gradient is taken at the rows A read (max_norm's clip, the per-id weights' gradient),
    not at the rows B's update left.  Oracle: the same two forwards with the backwards in
    forward order (A's then at unchanged rows); SGD's updates add up alike in either order."""
    def make():
        return EmbeddingCollection([TableConfig("u", 4, num_rows=None, max_norm=0.5 if what == "max_norm" else None)],
                                   optimizer=SGD(lr=0.5), seed=2, backend=backend)

    results = []
    for b_backward_first in (True, False):
        ec = make()
        ec(SparseFeatures.from_lists({"u": [[1, 2, 3]]})).concat().sum().backward()  # rows exist
        base = SparseFeatures.from_lists({"u": [[1, 2], [2, 3]]})
        wa = torch.tensor([1.0, 2.0, 0.5, 1.5], requires_grad=what == "weights")
        sa = SparseFeatures(base.keys(), base.values(), offsets=base.offsets(), weights=wa, batch_size=2)
        la = (ec(sa).concat() * torch.arange(8.0).view(2, 4)).sum()
        lb = (ec(SparseFeatures.from_lists({"u": [[2, 3], [1]]})).concat() ** 2).sum()
        for loss in ((lb, la) if b_backward_first else (la, lb)):
            loss.backward()
        rows = ec._stores[0].gather(ec._stores[0].find(torch.tensor([1, 2, 3])))
        results.append((rows, wa.grad))
    (rows_1, gw_1), (rows_2, gw_2) = results
    if what == "weights":
        assert torch.equal(gw_1, gw_2)
    torch.testing.assert_close(rows_1, rows_2, rtol=1e-6, atol=1e-7)
