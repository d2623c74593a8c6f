"""The disk tier's row file (hugeembed/store/_tier_file.py) on he_tier_read / he_tier_write
(csrc/tier_io.cpp) and on its plain twin: rows round-trip, and a failing read or write is a
StoreError naming the table, the file and the errno, on both paths."""

from __future__ import annotations

import os

import pytest
import torch

from hugeembed import StoreError
from hugeembed import _native
from hugeembed.store._tier_file import RowFile

PATHS = [pytest.param(False, id="twin")] + (
    [pytest.param(True, id="native")] if _native.available() else [])


@pytest.fixture(params=PATHS)
def rowfile(request, tmp_path, monkeypatch):
    if not request.param:
        monkeypatch.setattr(_native, "available", lambda: False)
    f = RowFile(tmp_path / "rows.bin", 4 * 3, "t")
    yield f
    f.close()


def test_rows_round_trip(rowfile):
    rows = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    records = torch.tensor([7, 2, 3, 4, 0])
    rowfile.write(records, rows)
    out = torch.zeros(5, 3)
    rowfile.read(records.flip(0), out)
    assert torch.equal(out, rows.flip(0))


def test_reading_a_record_never_written_is_a_store_error(rowfile):
    rowfile.write(torch.tensor([0, 1]), torch.ones(2, 3))
    out = torch.zeros(3, 3)
    with pytest.raises(StoreError, match=r"table 't': reading .*rows\.bin failed: \[EIO\]"):
        rowfile.read(torch.tensor([1, 9, 0]), out)


def test_a_failing_write_is_a_store_error(rowfile, tmp_path):
    ro = os.open(rowfile.path, os.O_RDONLY)
    try:
        good, rowfile.fd = rowfile.fd, ro  # a descriptor that cannot write: EBADF
        with pytest.raises(StoreError, match=r"table 't': writing .*rows\.bin failed: \[EBADF\]"):
            rowfile.write(torch.tensor([0, 1]), torch.ones(2, 3))
    finally:
        rowfile.fd = good
        os.close(ro)


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
@pytest.mark.parametrize("kernel", ["he_tier_read", "he_tier_write"])
def test_the_kernels_refuse_a_too_short_buffer_and_move_nothing(tmp_path, kernel):
    f = RowFile(tmp_path / "rows.bin", 8, "t")
    try:
        f.write(torch.tensor([0, 1, 2]), torch.full((3, 2), 5.0))
        rows = torch.full((2, 2), -1.0)  # three records, room for two
        with pytest.raises(_native.KernelError, match=r"buffer 1 \(rows\) holds 16 elements, needs 24") as e:
            _native.call(kernel, [torch.tensor([0, 1, 2]), rows.view(torch.uint8)], [f.fd, 8, 4])
        assert e.value.status == _native.Status.BAD_CALL
        assert rows.eq(-1.0).all()
        back = torch.zeros(3, 2)
        f.read(torch.tensor([0, 1, 2]), back)
        assert back.eq(5.0).all()
        with pytest.raises(_native.KernelError, match=r"must be bytes \(uint8\)"):  # counted in bytes, not floats
            _native.call(kernel, [torch.tensor([0]), torch.zeros(8)], [f.fd, 8, 4])
    finally:
        f.close()


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
def test_a_kernel_io_error_says_which_record_and_errno(tmp_path):
    import errno
    f = RowFile(tmp_path / "rows.bin", 8, "t")
    try:
        out = torch.zeros(1, 2)
        with pytest.raises(_native.KernelError) as e:
            _native.call("he_tier_read", [torch.tensor([3]), out.view(torch.uint8)], [f.fd, 8, 4])
        assert e.value.status == _native.Status.IO_ERROR and e.value.detail[:3] == (errno.EIO, 0, 3)
    finally:
        f.close()
