// Row I/O of the disk tier (hugeembed/store/_tier_file.py): fixed-size records at
// offset record * record_bytes of one file, written with pwrite, read by copying from
// the file mapped into memory (he_tier_copy_rows: no system call per row).
//
// A cache miss reads rows scattered over the file.  On an SSD each read waits ~0.1 ms
// for the device, so the rows of one batch are copied from many threads at once (the
// faults in flight are the thread count), not one after another; from the page cache
// they are memcpys.  A write-back's records are one run: adjacent records are merged
// into one pwrite.
//
// Write errors: HE_IO_ERROR with detail = (errno of the first failing call, the index in `records`
// of its first record, that record).  The calls that succeeded before it have moved their records
// (the kernel cannot undo I/O).  A read of the mapping cannot fail but by a signal (SIGBUS: the
// disk failed under a page); the caller checks that every record is inside the file first.
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

// Row slots[i] of `rows` (a cache: C rows of record_bytes) = record records[i] of `src`, the tier
// file mapped into memory (R records), for i in [0, n): a read from the page cache without a system
// call per row (a pread of one row from the page cache costs ~1 us of kernel time, the copy ~0.1).
// Records not in the page cache fault in; the rows are split over io_threads threads so that an SSD
// still sees that many reads in flight.  Every record and slot is checked before any copy.
// bufs: src bytes [R * record_bytes], records int64 [n], rows bytes [C * record_bytes] (out), slots
// int64 [n]; ints: record_bytes, io_threads.  Returns 0; fails with HE_BAD_VALUE for a record outside
// the mapping (detail = (index, record, R)) or a slot outside the rows (detail = (index, slot, C)).
HE_KERNEL(he_tier_copy_rows) {
  call.expect(4, 2, 0);
  const int64_t record_bytes = call.i(0), io_threads = call.i(1);
  if (record_bytes < 1 || io_threads < 1)
    call.fail(HE_BAD_CALL, "record_bytes %lld, io_threads %lld", (long long)record_bytes, (long long)io_threads);
  const int64_t R = call.numel(0) / record_bytes, n = call.numel(1), C = call.numel(2) / record_bytes;
  const char* src = call.bytes<const char>(0, R * record_bytes, "src");
  const int64_t* records = call.buf<const int64_t>(1, n, "records");
  char* rows = call.bytes<char>(2, C * record_bytes, "rows");
  const int64_t* slots = call.buf<const int64_t>(3, n, "slots");
  for (int64_t i = 0; i < n; ++i) {
    if (records[i] < 0 || records[i] >= R) {
      call.detail({i, records[i], R});
      call.fail(HE_BAD_VALUE, "records[%lld] = %lld is not a record of the file (%lld)", (long long)i,
                (long long)records[i], (long long)R);
    }
    if (slots[i] < 0 || slots[i] >= C) {
      call.detail({i, slots[i], C});
      call.fail(HE_BAD_VALUE, "slots[%lld] = %lld is not a row of the cache (%lld)", (long long)i,
                (long long)slots[i], (long long)C);
    }
  }
  constexpr int64_t kChunk = 512;  // rows per item: page-cache copies need few threads, cold faults many
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  he::run_items(chunks, std::min<int64_t>(io_threads, chunks), [&](int64_t c) {
    const int64_t a = c * kChunk, b = std::min(n, a + kChunk);
    for (int64_t i = a; i < b; ++i) {
      if (i + 8 < b) __builtin_prefetch(src + records[i + 8] * record_bytes);
      std::memcpy(rows + slots[i] * record_bytes, src + records[i] * record_bytes, (size_t)record_bytes);
    }
  });
  return 0;
}
