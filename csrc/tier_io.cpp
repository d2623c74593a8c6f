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
// Errors: the return value is 0, or -errno of the first failing call (-EIO for a
// short read: a record past the end of the file), and err[0] the index of its record.
#include <cerrno>
#include <unistd.h>

#include "common.h"

namespace {

// The runs of [0, n): i..j-1 where records[k+1] == records[k] + 1.
template <class F>
int64_t for_runs(const int64_t* records, int64_t n, int64_t max_run, int64_t nthreads, int64_t* err, F&& io) {
  std::vector<int64_t> starts;
  starts.reserve(n / 4 + 1);
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || records[i] != records[i - 1] + 1 || i - starts.back() >= max_run) starts.push_back(i);
  starts.push_back(n);
  std::atomic<int64_t> rc{0};
  std::atomic<int64_t> where{-1};
  he::run_items((int64_t)starts.size() - 1, nthreads, [&](int64_t r) {
    if (rc.load(std::memory_order_relaxed) != 0) return;
    int64_t e = io(starts[r], starts[r + 1]);
    if (e != 0) {
      int64_t zero = 0;
      if (rc.compare_exchange_strong(zero, e)) where.store(starts[r]);
    }
  });
  err[0] = where.load();
  return rc.load();
}

constexpr int64_t kMaxRun = 256;  // records per call: long runs still spread over threads

}  // namespace

// out[i] = record records[i] of the file, for i in [0, n).
HE_API int64_t he_tier_read(int64_t fd, const int64_t* records, int64_t n, int64_t record_bytes, char* out,
                            int64_t nthreads, int64_t* err) {
  return for_runs(records, n, kMaxRun, nthreads, err, [&](int64_t a, int64_t b) -> int64_t {
    char* dst = out + a * record_bytes;
    int64_t left = (b - a) * record_bytes;
    int64_t off = records[a] * record_bytes;
    while (left > 0) {
      ssize_t got = pread((int)fd, dst, (size_t)left, (off_t)off);
      if (got < 0) {
        if (errno == EINTR) continue;
        return -(int64_t)errno;
      }
      if (got == 0) return -(int64_t)EIO;  // past the end: the record was never written
      dst += got, off += got, left -= got;
    }
    return 0;
  });
}

// Record records[i] of the file = rows[i], for i in [0, n).
HE_API int64_t he_tier_write(int64_t fd, const int64_t* records, int64_t n, int64_t record_bytes,
                             const char* rows, int64_t nthreads, int64_t* err) {
  return for_runs(records, n, kMaxRun, nthreads, err, [&](int64_t a, int64_t b) -> int64_t {
    const char* src = rows + a * record_bytes;
    int64_t left = (b - a) * record_bytes;
    int64_t off = records[a] * record_bytes;
    while (left > 0) {
      ssize_t put = pwrite((int)fd, src, (size_t)left, (off_t)off);
      if (put < 0) {
        if (errno == EINTR) continue;
        return -(int64_t)errno;
      }
      src += put, off += put, left -= put;
    }
    return 0;
  });
}
