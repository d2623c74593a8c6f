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
