"""The disk tier's row file (hugeembed/store/_tier_file.py) on he_tier_copy_rows (reads through a
mapping of the file) / he_tier_write (csrc/tier_io.cpp) and on its plain twin: rows round-trip,
the mapping follows the file's growth, and a failing read or write is a StoreError naming the
table, the file and the errno, on both paths, changing nothing."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from hugeembed import StoreError
from hugeembed import _native
from hugeembed.store import _tier_file
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
@pytest.mark.parametrize("kernel", ["he_tier_write"])
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
    ro = os.open(f.path, os.O_RDONLY)
    try:
        rows = torch.zeros(1, 2)
        with pytest.raises(_native.KernelError) as e:
            _native.call("he_tier_write", [torch.tensor([3]), rows.view(torch.uint8)], [ro, 8, 4])
        assert e.value.status == _native.Status.IO_ERROR and e.value.detail[:3] == (errno.EBADF, 0, 3)
    finally:
        os.close(ro)
        f.close()


def test_reads_follow_the_file_as_it_grows_and_its_pages_are_dropped(rowfile, monkeypatch):
    """Reads map the file once and remap when a record lies past the mapping (the file grew); the
    pages they touched are dropped from the process every MAPPED_RSS_BYTES: values stay right."""
    monkeypatch.setattr(_tier_file, "MAPPED_RSS_BYTES", 3 * mmap.PAGESIZE)
    want = {}
    g = torch.Generator().manual_seed(0)
    for n in (2, 7, 40, 1500):  # the file grows; 1,500 rows span several copy chunks (threads)
        records = torch.randperm(n, generator=g)[: max(1, n // 2)] + len(want)
        rows = torch.randn(records.numel(), 3, generator=g)
        rowfile.write(records, rows)
        want.update(zip(records.tolist(), rows))
        ask = torch.tensor(list(want))[torch.randperm(len(want), generator=g)]
        out = torch.zeros(ask.numel(), 3)
        rowfile.read(ask, out)
        assert torch.equal(out, torch.stack([want[r] for r in ask.tolist()]))
        cache = torch.full((ask.numel() + 5, 3), -1.0)
        slots = torch.randperm(cache.shape[0], generator=g)[: ask.numel()]
        rowfile.read_rows(ask, cache, slots)
        assert torch.equal(cache[slots], out)


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
def test_the_mapped_copy_refuses_a_record_or_slot_outside_and_copies_nothing(tmp_path):
    f = RowFile(tmp_path / "rows.bin", 8, "t")
    try:
        f.write(torch.arange(4), torch.full((4, 2), 5.0))
        src = f._mapping(torch.tensor([3]))
        rows = torch.full((3, 2), -1.0)
        for records, slots, detail in (([0, 4], [0, 1], (1, 4, 4)), ([0, 1], [2, 3], (1, 3, 3))):
            with pytest.raises(_native.KernelError, match="is not a") as e:
                _native.call("he_tier_copy_rows", [src, torch.tensor(records), rows.view(torch.uint8),
                                                   torch.tensor(slots)], [8, 4])
            assert e.value.status == _native.Status.BAD_VALUE and e.value.detail[:3] == detail
            assert rows.eq(-1.0).all()
    finally:
        f.close()
