"""The one calling convention of the native kernels (csrc/call.h, hugeembed/_native.call):
a kernel checks every buffer's type and length itself and fails with a status and a
message, never reading past a buffer; the Python side refuses what it cannot hand over."""

import numpy as np
import pytest
import torch

from hugeembed import _native

pytestmark = pytest.mark.skipif(not _native.available(), reason="native kernels not built")


def test_a_call_returns_the_kernels_result_and_writes_its_outputs():
    keys = torch.arange(-3, 5, dtype=torch.int64)
    out = torch.empty_like(keys)
    assert _native.call("he_mix64", [keys, out]) == 0
    twin = torch.empty_like(keys)
    _native.call("he_mix64", [keys.numpy(), twin.numpy()])  # numpy arrays go over the same way
    assert torch.equal(out, twin)


@pytest.mark.parametrize("bufs, says", [
    (lambda k: [k], "called with 1 buffers, 0 ints, 0 reals; expects 2"),
    (lambda k: [k, torch.empty(3, dtype=torch.int64)], "holds 3 elements, needs 8"),
    (lambda k: [k, torch.empty(8, dtype=torch.int32)], "has element type 2, expected 3"),
    (lambda k: [k, torch.empty(8, dtype=torch.int64), torch.empty(1)], "called with 3 buffers"),
])
def test_a_kernel_refuses_a_call_that_breaks_the_convention_and_writes_nothing(bufs, says):
    keys = torch.arange(8, dtype=torch.int64)
    args = bufs(keys)
    before = [a.clone() for a in args]
    with pytest.raises(_native.KernelError, match=says) as info:
        _native.call("he_mix64", args)
    assert info.value.status == _native.Status.BAD_CALL and info.value.kernel == "he_mix64"
    assert all(torch.equal(a, b) for a, b in zip(args, before))


def test_call_refuses_what_it_cannot_hand_over():
    keys = torch.arange(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="buffer 1 must be contiguous"):
        _native.call("he_mix64", [keys, torch.empty(16, dtype=torch.int64)[::2]])
    with pytest.raises(ValueError, match="buffer 1 has dtype torch.bool"):
        _native.call("he_mix64", [keys, torch.empty(8, dtype=torch.bool)])
    with pytest.raises(ValueError, match="buffer 0 is a list"):
        _native.call("he_mix64", [[1, 2], keys])
    with pytest.raises(ValueError, match="C-contiguous"):
        _native.call("he_mix64", [np.arange(16)[::2], keys])
    with pytest.raises(ImportError, match="lack he_no_such_kernel"):
        _native.call("he_no_such_kernel", [])


def test_a_row_strided_view_goes_over_as_its_span():
    table = torch.zeros(4, 10)
    view = table[:, 2:5]  # rows 10 apart, 3 long: spans 3 * 10 + 3 elements
    entry = _native._entry("k", 0, _native.rows(view))
    assert entry == (view.data_ptr(), 33, 4)
    with pytest.raises(ValueError, match="unit column stride"):
        _native._entry("k", 0, _native.rows(table[:, ::2]))


# ---- the store and optimizer kernels under the convention ----

from hugeembed.errors import InputError, StoreError  # noqa: E402
from hugeembed.store import ArrayStore, DynamicGroup, HashStore, TableSettings, RowLayout  # noqa: E402
from hugeembed.optim import _native_ops  # noqa: E402


def _state(g):
    return [t.clone() for t in (g.buckets, g.free_rows, g.scalars, g.tables, g.rows)]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_corrupt_group_index_is_refused_by_the_kernel_and_left_as_it_was():
    s = HashStore(dim=4, name="users", backend="native")
    s.find_or_insert(torch.arange(10), step=1)
    g = s.group
    g.scalars[2] = g.free_rows.numel() + 5  # more free rows listed than the free list holds
    before = _state(g)
    with pytest.raises(StoreError, match=r"tables \['users'\]: he_group_find.*inconsistent"):
        s.find(torch.arange(3))
    with pytest.raises(StoreError, match=r"tables \['users'\]: he_group_find_or_insert.*inconsistent"):
        s.find_or_insert(torch.arange(20, 25), step=2)
    assert _same(_state(g), before)


def test_a_group_call_with_a_bad_count_changes_no_table_and_names_the_position():
    lay = RowLayout(4, torch.float32)
    g = DynamicGroup([TableSettings("items", lay), TableSettings("ads", lay)], backend="native")
    g.find_or_insert(torch.tensor([0, 1]), torch.arange(2), step=1)
    before = _state(g)
    with pytest.raises(InputError, match="table 'ads': counts must be >= 1 .*got 0"):
        g.find_or_insert(torch.tensor([0, 0, 1, 1]), torch.arange(4), step=2, counts=torch.tensor([1, 1, 1, 0]))
    assert _same(_state(g), before)


def test_a_table_column_naming_no_table_of_the_group_is_our_bug_and_writes_nothing():
    s = HashStore(dim=4, name="users", backend="native")
    s.find_or_insert(torch.arange(5), step=1)
    s.group._room_for(1)  # (a call grows the arrays ahead of it: the kernel's refusal is what is tested)
    before = _state(s.group)
    with pytest.raises(_native.KernelError, match="table 1 at position 0 is not one of the group's 1") as info:
        s.group.find_or_insert(torch.tensor([1]), torch.tensor([7]), step=2)
    assert info.value.status == _native.Status.BAD_CALL
    assert _same(_state(s.group), before)


def test_static_touch_with_a_bad_key_writes_no_table():
    a = ArrayStore(num_rows=8, dim=2, name="a")
    g = a.group
    meta = g.meta.clone()
    with pytest.raises(InputError, match="table 'a': key 9 is outside"):
        g.touch(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 9]), step=3)
    assert torch.equal(g.meta, meta)
    out = g.touch(torch.tensor([0, -1, 0]), torch.tensor([1, 5, 2]), step=3)
    assert out.tolist() == [1, -1, 2] and g.meta[[1, 2], 1].eq(3).all() and g.meta[5].eq(0).all()


def test_static_touch_refuses_tables_that_do_not_fit_its_meta():
    meta, info = torch.zeros(1, 2, dtype=torch.int64), torch.tensor([[0, 5, 0, 1]])
    keys, out = torch.tensor([3]), torch.empty(1, dtype=torch.int64)
    with pytest.raises(_native.KernelError, match="do not fit 1 rows"):
        _native.call("he_static_touch", [meta, info, keys, torch.zeros(1, dtype=torch.int64), None, out], [1, 1, 1])
    assert meta.eq(0).all()


def test_init_rows_refuses_a_row_outside_its_output_and_writes_nothing():
    out = torch.zeros(4, 6)
    params = torch.tensor([0.5, 0, 0, 0, 0, 0], dtype=torch.float64)
    keys, rows = torch.arange(2), torch.tensor([1, 4])
    with pytest.raises(_native.KernelError, match="row 4 at position 1 lies outside") as info:
        _native.call("he_init_rows", [keys, out, rows, params], [0, 7, 6, 6])
    assert info.value.status == _native.Status.BAD_VALUE and info.value.detail[:2] == (1, 4)
    assert out.eq(0).all()
    _native.call("he_init_rows", [keys, _native.rows(out[:, 1:3]), rows[:1].repeat(2), params], [0, 7, 2, 6])
    assert out[1, 1:3].eq(0.5).all() and out.sum() == 1.0  # the view's columns of row 1 only


def test_init_rows_native_writes_a_column_view_in_place():
    from hugeembed.store import Constant
    from hugeembed.store._init import init_rows_native
    table = torch.zeros(4, 6)
    assert init_rows_native(Constant(0.5), torch.arange(2), 4, 0, table[:, :4], torch.tensor([1, 3]))
    want = torch.zeros(4, 6)
    want[[1, 3], :4] = 0.5
    assert torch.equal(table, want)


def test_an_optimizer_kernel_checks_its_gradient_and_slots_before_writing():
    storage = torch.ones(6, 8)
    slots = torch.tensor([0, 2])
    with pytest.raises(_native.KernelError, match="buffer 2 \\(grad\\) holds 4 elements, needs 8"):
        _native_ops.run("he_optim_sgd", storage, slots, torch.ones(4), 4, reals=(0.1, 0.0))
    with pytest.raises(IndexError, match="slot 6 at position 1 is out of range for a table of 6 rows"):
        _native_ops.run("he_optim_sgd", storage, torch.tensor([0, 6]), torch.ones(2, 4), 4, reals=(0.1, 0.0))
    assert storage.eq(1).all()


def test_a_call_made_while_this_threads_frame_is_busy_gets_arrays_of_its_own():
    # a finalizer run by the garbage collector inside a call calls a kernel itself
    keys = torch.arange(6, dtype=torch.int64)
    out, twin = torch.empty_like(keys), torch.empty_like(keys)
    _native._frame.busy = True
    try:
        _native.call("he_mix64", [keys, out])
    finally:
        _native._frame.busy = False
    _native.call("he_mix64", [keys, twin])
    assert torch.equal(out, twin)


def test_calls_on_other_threads_use_their_own_frames():
    import threading
    results = {}

    def run(i):
        keys = torch.arange(i, i + 50, dtype=torch.int64)
        for _ in range(200):
            out = torch.empty_like(keys)
            _native.call("he_mix64", [keys, out])
        results[i] = out

    threads = [threading.Thread(target=run, args=(i * 1000,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, out in results.items():
        want = torch.empty_like(out)
        _native.call("he_mix64", [torch.arange(i, i + 50, dtype=torch.int64), want])
        assert torch.equal(out, want)


def test_an_optimizer_kernel_refuses_rows_too_narrow_for_its_state():
    storage = torch.ones(4, 8)  # Adam at dim 4 needs 4 + 2*4 (+1) columns
    with pytest.raises(_native.KernelError, match="holding dim 4 and 8 state columns"):
        _native_ops.run("he_optim_adam", storage, torch.tensor([3]), torch.ones(1, 4), 4, ints=(0, 0, 0, 1, 1),
                        reals=(0.1, 0.9, 0.999, 1e-8, 0.0, 0.0))
    with pytest.raises(_native.KernelError, match="holding dim 8 and 8 state columns"):
        _native_ops.run("he_optim_momentum", storage, torch.tensor([3]), torch.ones(1, 8), 8, ints=(0,),
                        reals=(0.1, 0.9, 0.0))
    assert storage.eq(1).all()


def test_integer_arguments_outside_int64_are_refused_not_wrapped():
    with pytest.raises(OverflowError, match="outside int64"):
        _native.call("he_mix64", [torch.arange(2), torch.empty(2, dtype=torch.int64)], [2**64 + 5])
