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


def test_rows_written_from_cache_slots_read_back_into_cache_slots(rowfile):
    cache = torch.arange(9 * 3, dtype=torch.float32).view(9, 3)
    records = torch.tensor([4, 5, 6, 0, 9])  # runs of adjacent records: one pwritev2 each
    slots = torch.tensor([8, 1, 3, 0, 5])
    rowfile.write_rows(records, cache, slots)
    back = torch.zeros(5, 3)
    rowfile.read(records, back)
    assert torch.equal(back, cache[slots])
    other = torch.full((7, 3), -1.0)
    rowfile.read_rows(records.flip(0), other, torch.tensor([6, 2, 4, 0, 1]))
    assert torch.equal(other[torch.tensor([6, 2, 4, 0, 1])], cache[slots.flip(0)])
    assert other[torch.tensor([3, 5])].eq(-1.0).all()


def test_runs_longer_than_a_staged_write_land_row_for_row(tmp_path):
    """he_tier_write_rows gathers a run into a buffer of 256 KiB and writes it whole: with rows of 40 KiB
    a piece is 6 rows, so runs of 200 and 100 records are 34 and 17 pieces; every record must hold its
    own slot's row."""
    f = RowFile(tmp_path / "rows.bin", 40 << 10, "t")
    try:
        g = torch.Generator().manual_seed(0)
        cache = torch.randn(400, 10 << 10, generator=g)
        slots = torch.randperm(400, generator=g)[:300]
        records = torch.cat([torch.arange(5, 205), torch.arange(300, 400)])  # two runs, one a piece long
        f.write_rows(records, cache, slots)
        back = torch.zeros(300, 10 << 10)
        f.read(records, back)
        assert torch.equal(back, cache[slots])
    finally:
        f.close()


def test_a_failing_write_from_cache_slots_is_a_store_error(rowfile):
    ro = os.open(rowfile.path, os.O_RDONLY)
    try:
        good, rowfile.fd = rowfile.fd, ro
        with pytest.raises(StoreError, match=r"table 't': writing .*rows\.bin failed: \[EBADF\]"):
            rowfile.write_rows(torch.tensor([0, 1]), torch.ones(4, 3), torch.tensor([3, 0]))
    finally:
        rowfile.fd = good
        os.close(ro)


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
def test_a_write_from_a_slot_outside_the_cache_writes_nothing(tmp_path):
    f = RowFile(tmp_path / "rows.bin", 8, "t")
    try:
        f.write(torch.tensor([0, 1]), torch.full((2, 2), 5.0))
        with pytest.raises(_native.KernelError, match=r"slots\[1\] = 4 is not a row of the cache \(4\)"):
            _native.call("he_tier_write_rows", [torch.tensor([0, 1]), torch.zeros(4, 2).view(torch.uint8),
                                                torch.tensor([0, 4])], [f.fd, 8, 4])
        back = torch.zeros(2, 2)
        f.read(torch.tensor([0, 1]), back)
        assert back.eq(5.0).all()
    finally:
        f.close()


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


def _drop_page_cache(f: RowFile) -> None:
    """Pushes the file's pages out of the page cache: a read then waits for the device, so
    he_tier_read's RWF_NOWAIT pass hands it to the I/O threads."""
    os.fsync(f.fd)
    os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
def test_reads_that_wait_for_the_device_go_through_the_io_threads_concurrently(tmp_path):
    import threading
    f = RowFile(tmp_path / "rows.bin", 4 * 3, "t", io_threads=4)
    try:
        n = 5000
        rows = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
        f.write(torch.arange(n), rows)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        outs, errors = {}, []

        def reader(k):  # two callers at once share the one pool (the prefetch thread and a fetch)
            try:
                for _ in range(3):
                    _drop_page_cache(f)
                    out = torch.zeros(n, 3)
                    f.read(perm, out)
                    cache = torch.zeros(n + 7, 3)
                    f.read_rows(perm, cache, perm.flip(0) + 7)
                    outs[k] = (out, cache)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=reader, args=(k,)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        for out, cache in outs.values():
            assert torch.equal(out, rows[perm])
            assert torch.equal(cache[perm.flip(0) + 7], rows[perm])
    finally:
        f.close()


@pytest.mark.skipif(not _native.available() or not hasattr(os, "fork"), reason="needs the native kernels and fork")
def test_a_forked_child_reads_through_its_own_io_threads(tmp_path):
    f = RowFile(tmp_path / "rows.bin", 8, "t", io_threads=4)
    try:
        n = 2000
        rows = torch.arange(n * 2, dtype=torch.float32).view(n, 2)
        f.write(torch.arange(n), rows)
        _drop_page_cache(f)
        out = torch.zeros(n, 2)
        f.read(torch.arange(n).flip(0), out)  # the parent's pool threads exist now
        assert torch.equal(out, rows.flip(0))
        pid = os.fork()
        if pid == 0:  # the child: the parent's threads are not here; it must not wait for them
            code = 1
            try:
                _drop_page_cache(f)
                got = torch.zeros(n, 2)
                f.read(torch.arange(n).flip(0), got)
                code = 0 if torch.equal(got, rows.flip(0)) else 2
            finally:
                os._exit(code)
        import time
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:  # hung (waiting for threads that are not there): fail, not hang
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's read did not finish")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        f.close()


def _pread_only(monkeypatch, f: RowFile) -> None:
    monkeypatch.setattr(f._map, "read_rows", lambda *a: False)


def test_reads_through_the_mapping_follow_the_file_as_it_grows(tmp_path, monkeypatch):
    """read_rows maps the file (store/_tier_map.py) and reads what was written, rewritten and appended
    since it was mapped, as preadv does (the oracle: the rows written, held in a plain tensor)."""
    f = RowFile(tmp_path / "rows.bin", 4 * 3, "t")
    try:
        g = torch.Generator().manual_seed(3)
        truth = torch.randn(40, 3, generator=g)
        f.write(torch.arange(20), truth[:20])
        cache = torch.zeros(25, 3)
        slots = torch.randperm(25, generator=g)[:10]
        f.read_rows(torch.arange(0, 20, 2), cache, slots)
        assert f._map._n == 20  # read through the mapping
        assert torch.equal(cache[slots], truth[0:20:2])
        truth[5] = 7.0
        f.write(torch.tensor([5]), truth[5:6])  # a rewrite shows through the mapping (one page cache)
        f.write(torch.arange(20, 40), truth[20:])  # appended: past the mapping, mapped again
        recs = torch.tensor([5, 39, 21, 0])
        f.read_rows(recs, cache, torch.tensor([1, 2, 3, 4]))
        assert f._map._n == 40
        assert torch.equal(cache[1:5], truth[recs])
        _pread_only(monkeypatch, f)
        other = torch.zeros(25, 3)
        f.read_rows(recs, other, torch.tensor([1, 2, 3, 4]))
        assert torch.equal(other, torch.zeros(25, 3).index_copy_(0, torch.tensor([1, 2, 3, 4]), truth[recs]))
    finally:
        f.close()


def test_a_file_over_the_limit_or_a_record_past_its_end_is_read_without_the_mapping(tmp_path):
    f = RowFile(tmp_path / "rows.bin", 8, "t")
    try:
        rows = torch.arange(12, dtype=torch.float32).view(6, 2)
        f.write(torch.arange(6), rows)
        f._map.limit = 5 * 8  # six records are over it: preadv reads them
        cache = torch.zeros(6, 2)
        f.read_rows(torch.tensor([5, 0]), cache, torch.tensor([0, 1]))
        assert f._map._n == 0 and torch.equal(cache[:2], rows[[5, 0]])
        f._map.limit = 1 << 30
        before = cache.clone()
        with pytest.raises(StoreError, match=r"table 't': reading .*rows\.bin failed: \[EIO\]"):
            f.read_rows(torch.tensor([9]), cache, torch.tensor([3]))  # never written: past the end
        assert torch.equal(cache, before)
        f.read_rows(torch.tensor([2]), cache, torch.tensor([3]))
        assert f._map._n == 6 and torch.equal(cache[3], rows[2])
    finally:
        f.close()


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
def test_a_read_into_a_slot_outside_the_cache_reads_nothing(tmp_path):
    f = RowFile(tmp_path / "rows.bin", 8, "t")
    try:
        f.write(torch.arange(3), torch.full((3, 2), 5.0))
        cache = torch.zeros(4, 2)
        with pytest.raises(_native.KernelError, match=r"slots\[1\] = 4 is not a row of the cache \(4\)"):
            f.read_rows(torch.tensor([0, 1]), cache, torch.tensor([0, 4]))
        assert cache.eq(0.0).all()
    finally:
        f.close()


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
def test_he_copy_rows_copies_row_for_row_and_refuses_a_bad_index_copying_nothing():
    """The mapping's reads (store/_tier_map.py) copy rows with he_copy_rows: oracle, torch indexing."""
    g = torch.Generator().manual_seed(5)
    src = torch.randn(300, 65, generator=g)
    dst = torch.zeros(200, 65)
    si, di = torch.randint(0, 300, (150,), generator=g), torch.randperm(200, generator=g)[:150]
    want = dst.clone()
    want[di] = src[si]
    _native.call("he_copy_rows", [src.view(torch.uint8), si, dst.view(torch.uint8), di], [65 * 4])
    assert torch.equal(dst, want)
    for which, bad, msg in [("src", 300, r"src_idx\[149\] = 300 is not a row \(300 rows\)"),
                            ("dst", -1, r"dst_idx\[149\] = -1 is not a row \(200 rows\)")]:
        si2, di2 = si.clone(), di.clone()
        (si2 if which == "src" else di2)[-1] = bad
        before = dst.clone()
        with pytest.raises(_native.KernelError, match=msg):
            _native.call("he_copy_rows", [src.view(torch.uint8), si2, dst.view(torch.uint8), di2], [65 * 4])
        assert torch.equal(dst, before)
