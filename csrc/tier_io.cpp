// Row I/O of the disk tier (hugeembed/store/_tier_file.py): fixed-size records at
// offset record * record_bytes of one file, read and written with pread/pwrite.
//
// A cache miss reads rows scattered over the file.  On an SSD each read waits ~0.1 ms
// for the device, so the reads of one batch are issued from many threads at once (the
// queue depth is the thread count), not one after another; from the page cache they
// are memcpys and a couple of threads suffice.  Records adjacent in the file and in
// the request are merged into one call.  The caller sorts the records of a write-back
// so that the writes go out in file order.
//
// Errors: HE_IO_ERROR with detail = (errno of the first failing call (EIO for a short read: a
// record past the end of the file), the index in `records` of its first record, that record).
// The calls that succeeded before it have moved their records (the kernel cannot undo I/O).
#include <cerrno>
#include <climits>
#include <cstring>
#include <sys/uio.h>
#include <unistd.h>

#include "common.h"

namespace {

// The runs of [0, n): i..j-1 where records[k+1] == records[k] + 1, each through io.  Returns 0, or
// the errno of the first call to fail (in time; no run starts after it) and in *where the index
// of its run's first record.
template <class F>
int64_t for_runs(const int64_t* records, int64_t n, int64_t max_run, int64_t nthreads, int64_t* where, F&& io) {
  std::vector<int64_t> starts;
  starts.reserve(n / 4 + 1);
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || records[i] != records[i - 1] + 1 || i - starts.back() >= max_run) starts.push_back(i);
  starts.push_back(n);
  std::atomic<int64_t> rc{0};
  std::atomic<int64_t> at{-1};
  he::run_items((int64_t)starts.size() - 1, nthreads, [&](int64_t r) {
    if (rc.load(std::memory_order_relaxed) != 0) return;
    int64_t e = io(starts[r], starts[r + 1]);
    if (e != 0) {
      int64_t zero = 0;
      if (rc.compare_exchange_strong(zero, e)) at.store(starts[r]);
    }
  });
  *where = at.load();
  return rc.load();
}

constexpr int64_t kMaxRun = 256;  // records per call: long runs still spread over threads

// bufs: records int64 [n], rows bytes [n * record_bytes]; ints: fd, record_bytes, io_threads.
template <class Row, class F>
int64_t tier_io(const he::Call& call, const char* verb, F&& io) {
  call.expect(2, 3, 0);
  const int64_t fd = call.i(0), record_bytes = call.i(1), io_threads = call.i(2);
  const int64_t n = call.numel(0);
  if (fd < 0 || fd > INT32_MAX || record_bytes < 1 || n > INT64_MAX / record_bytes || io_threads < 1)
    call.fail(HE_BAD_CALL, "fd %lld, record_bytes %lld, io_threads %lld, %lld records", (long long)fd,
              (long long)record_bytes, (long long)io_threads, (long long)n);
  const int64_t* records = call.buf<const int64_t>(0, n, "records");
  Row* rows = call.bytes<Row>(1, n * record_bytes, "rows");
  int64_t where = -1;
  const int64_t e = for_runs(records, n, kMaxRun, io_threads, &where,
                             [&](int64_t a, int64_t b) { return io((int)fd, records, rows, record_bytes, a, b); });
  if (e != 0) {
    call.detail({e, where, where >= 0 ? records[where] : -1});
    call.fail(HE_IO_ERROR, "%s record %lld: %s", verb, (long long)(where >= 0 ? records[where] : -1),
              std::strerror((int)e));
  }
  return 0;
}

}  // namespace

// out[i] = record records[i] of the file, for i in [0, n).
// bufs: records int64 [n], out bytes [n * record_bytes] (out); ints: fd, record_bytes, io_threads
// (the reads in flight).  Returns 0; fails with HE_IO_ERROR (see above).
HE_KERNEL(he_tier_read) {
  return tier_io<char>(call, "reading", [](int fd, const int64_t* records, char* out, int64_t record_bytes, int64_t a,
                                           int64_t b) -> int64_t {
    char* dst = out + a * record_bytes;
    int64_t left = (b - a) * record_bytes;
    int64_t off = records[a] * record_bytes;
    while (left > 0) {
      ssize_t got = pread(fd, dst, (size_t)left, (off_t)off);
      if (got < 0) {
        if (errno == EINTR) continue;
        return (int64_t)errno;
      }
      if (got == 0) return (int64_t)EIO;  // past the end: the record was never written
      dst += got, off += got, left -= got;
    }
    return 0;
  });
}

// Record records[i] of the file = rows[i], for i in [0, n).
// bufs: records int64 [n], rows bytes [n * record_bytes]; ints: fd, record_bytes, io_threads.
// Returns 0; fails with HE_IO_ERROR (see above).
HE_KERNEL(he_tier_write) {
  return tier_io<const char>(call, "writing", [](int fd, const int64_t* records, const char* rows,
                                                 int64_t record_bytes, int64_t a, int64_t b) -> int64_t {
    const char* src = rows + a * record_bytes;
    int64_t left = (b - a) * record_bytes;
    int64_t off = records[a] * record_bytes;
    while (left > 0) {
      ssize_t put = pwrite(fd, src, (size_t)left, (off_t)off);
      if (put < 0) {
        if (errno == EINTR) continue;
        return (int64_t)errno;
      }
      src += put, off += put, left -= put;
    }
    return 0;
  });
}

// Row slots[i] of `rows` (a cache: C rows of record_bytes) = record records[i] of the file, for i
// in [0, n): the bring-in's reads land in their cache slots, no buffer and no scatter after.  A run
// of adjacent records is one preadv, one iovec per row.
// bufs: records int64 [n], rows bytes [C * record_bytes] (out), slots int64 [n]; ints: fd, record_bytes,
// io_threads.  Returns 0; fails with HE_IO_ERROR (see above), HE_BAD_VALUE for a slot outside the
// rows (detail = (index, slot, C)), before any read.
HE_KERNEL(he_tier_read_rows) {
  call.expect(3, 3, 0);
  const int64_t fd = call.i(0), record_bytes = call.i(1), io_threads = call.i(2);
  const int64_t n = call.numel(0);
  if (fd < 0 || fd > INT32_MAX || record_bytes < 1 || io_threads < 1)
    call.fail(HE_BAD_CALL, "fd %lld, record_bytes %lld, io_threads %lld", (long long)fd, (long long)record_bytes,
              (long long)io_threads);
  const int64_t C = call.numel(1) / record_bytes;
  const int64_t* records = call.buf<const int64_t>(0, n, "records");
  char* rows = call.bytes<char>(1, C * record_bytes, "rows");
  const int64_t* slots = call.buf<const int64_t>(2, n, "slots");
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] < 0 || slots[i] >= C) {
      call.detail({i, slots[i], C});
      call.fail(HE_BAD_VALUE, "slots[%lld] = %lld is not a row of the cache (%lld)", (long long)i,
                (long long)slots[i], (long long)C);
    }
  int64_t where = -1;
  const int64_t max_run = std::min<int64_t>(kMaxRun, IOV_MAX);
  const int64_t e = for_runs(records, n, max_run, io_threads, &where, [&](int64_t a, int64_t b) -> int64_t {
    struct iovec iov[kMaxRun];
    int k = 0;
    for (int64_t i = a; i < b; ++i) iov[k++] = {rows + slots[i] * record_bytes, (size_t)record_bytes};
    int first = 0;  // the iovec a short read stopped in
    int64_t off = records[a] * record_bytes;
    while (first < k) {
      ssize_t got = preadv((int)fd, iov + first, k - first, (off_t)off);
      if (got < 0) {
        if (errno == EINTR) continue;
        return (int64_t)errno;
      }
      if (got == 0) return (int64_t)EIO;  // past the end: the record was never written
      off += got;
      while (got > 0 && first < k) {  // skip what arrived; a part-filled iovec goes on where it stopped
        const size_t take = std::min<size_t>((size_t)got, iov[first].iov_len);
        iov[first].iov_base = (char*)iov[first].iov_base + take;
        iov[first].iov_len -= take;
        got -= (ssize_t)take;
        if (iov[first].iov_len == 0) ++first;
      }
    }
    return 0;
  });
  if (e != 0) {
    call.detail({e, where, where >= 0 ? records[where] : -1});
    call.fail(HE_IO_ERROR, "reading record %lld: %s", (long long)(where >= 0 ? records[where] : -1),
              std::strerror((int)e));
  }
  return 0;
}
