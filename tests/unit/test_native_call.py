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

from hugeembed.errors import StoreError  # noqa: E402
from hugeembed.store import ArrayStore, HashStore, find_or_insert_many  # noqa: E402
from hugeembed.store._array import touch_many  # noqa: E402
from hugeembed.optim import _native_ops  # noqa: E402


def _hash(name, **kw):
    return HashStore(dim=4, name=name, backend="native", **kw)


def _state(s):
    return [t.clone() for t in (s._buckets, s._free, s._st, s._storage)]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_corrupt_hash_store_is_refused_by_the_kernel_and_left_as_it_was():
    s = _hash("users")
    s.find_or_insert(torch.arange(10), step=1)
    s._st[2] = s._free.numel() + 5  # more free rows listed than the free list holds
    before = _state(s)
    with pytest.raises(StoreError, match="table 'users': he_hs_find.*inconsistent"):
        s.find(torch.arange(3))
    with pytest.raises(StoreError, match="table 'users': he_hs_find_or_insert.*inconsistent"):
        s.find_or_insert(torch.arange(20, 25), step=2)
    assert _same(_state(s), before)


def test_many_tables_with_one_corrupt_change_none_and_name_it():
    good, bad = _hash("items"), _hash("ads")
    for s in (good, bad):
        s.find_or_insert(torch.arange(5), step=1)
    bad._st[1] = bad._storage.shape[0] + 1  # more rows handed out than the storage holds
    before = [_state(good), _state(bad)]
    with pytest.raises(StoreError, match="table 'ads': he_hs_find_or_insert_many.*inconsistent"):
        find_or_insert_many([good, bad], [torch.arange(3, 9), torch.arange(3, 9)], step=2)
    assert _same(_state(good), before[0]) and _same(_state(bad), before[1])


def test_touch_many_with_a_bad_key_writes_no_table():
    a, b = ArrayStore(num_rows=8, dim=2, name="a"), ArrayStore(num_rows=4, dim=2, name="b")
    ka, kb = torch.arange(4), torch.tensor([0, 9])
    oa, ob = torch.empty(4, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
    meta = [a._meta.clone(), b._meta.clone()]
    assert touch_many([a._touch_row(ka, None, oa), b._touch_row(kb, None, ob)], step=3) == 1
    assert torch.equal(a._meta, meta[0]) and torch.equal(b._meta, meta[1])
    assert touch_many([a._touch_row(ka, None, oa)], step=3) is None
    assert torch.equal(oa, ka) and a._meta[:4, 1].eq(3).all()


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


def test_touch_many_refuses_more_rows_than_its_meta_holds():
    meta, keys, out = torch.zeros(1, 2, dtype=torch.int64), torch.tensor([5]), torch.empty(1, dtype=torch.int64)
    with pytest.raises(_native.KernelError, match="rows, meta holds 1"):
        _native.call("he_array_touch_many", [meta, keys, None, out], [1, 2**63 - 1])
    assert meta.eq(0).all()


def test_integer_arguments_outside_int64_are_refused_not_wrapped():
    with pytest.raises(OverflowError, match="outside int64"):
        _native.call("he_mix64", [torch.arange(2), torch.empty(2, dtype=torch.int64)], [2**64 + 5])
