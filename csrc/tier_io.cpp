// Row I/O of the disk tier (hugeembed/store/_tier_file.py): fixed-size records at
// offset record * record_bytes of one file, read and written with preadv2/pwritev2.
//
// A cache miss reads rows scattered over the file.  Records adjacent in the file and in the
// request are merged into one call (a run).  The caller first issues every run itself with
// RWF_NOWAIT: a run the page cache holds is a memcpy, done at once with no thread involved
// (the common case of a table whose file fits the page cache).  The runs that would wait
// for the device (EAGAIN, or a kernel / file system without RWF_NOWAIT) go to a small pool
// of I/O threads started once and parked between calls: on an SSD each read waits ~0.1 ms,
// so they are issued from io_threads threads at once (the queue depth), not one after
// another.  The caller sorts the records of a write-back so that the writes go out in file
// order.
//
// Errors: HE_IO_ERROR with detail = (errno of the first failing call (EIO for a short read: a
// record past the end of the file), the index in `records` of its first record, that record).
// The calls that succeeded before it have moved their records (the kernel cannot undo I/O).
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <sys/uio.h>
#include <unistd.h>

#include "common.h"

namespace {

constexpr int64_t kWouldBlock = -1;  // an io function's answer under RWF_NOWAIT: retry blocking

// I/O threads started on first use and parked on a condition variable between calls (starting
// 15 threads per call cost more than the reads they did from the page cache).  As he::run_items,
// the caller works through the items itself and never waits for a helper that has not begun:
// a helper joins a job only while it is listed, and the caller unlists it before waiting for
// the helpers inside an item.  Items must not throw (the I/O functions return an errno).
class IoPool {
 public:
  // The process's pool: a forked child makes its own (the parent's threads do not exist there,
  // and the parent's lock may have been held at the fork: that pool is left alone).
  static IoPool& get() {
    static std::atomic<IoPool*> current{nullptr};
    const pid_t me = getpid();
    IoPool* p = current.load(std::memory_order_acquire);
    if (p != nullptr && p->pid_ == me) return *p;
    IoPool* fresh = new IoPool(me);  // never deleted: parked threads may outlive any owner
    if (current.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;  // another thread made it (no thread was started for `fresh`)
    return *p;
  }

  // fn(i) for every i in [0, n), by the caller and up to `helpers` pool threads.
  template <class F>
  void run(int64_t n, int64_t helpers, F& fn) {
    helpers = std::min<int64_t>({helpers, n - 1, kMaxThreads});
    if (helpers <= 0) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    Job job;
    job.call = [](void* f, int64_t i) { (*static_cast<F*>(f))(i); };
    job.fn = &fn;
    job.n = n;
    job.want = helpers;
    {
      std::lock_guard<std::mutex> g(mu_);
      jobs_.push_back(&job);
      while (threads_ < helpers && start_thread()) ++threads_;
      for (int64_t h = 0; h < helpers; ++h) work_.notify_one();
    }
    for (int64_t i = job.next.fetch_add(1); i < n; i = job.next.fetch_add(1)) fn(i);
    std::unique_lock<std::mutex> lk(mu_);
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));
    done_.wait(lk, [&] { return job.active == 0; });
  }

 private:
  static constexpr int64_t kMaxThreads = 64;
  struct Job {
    void (*call)(void*, int64_t) = nullptr;
    void* fn = nullptr;
    std::atomic<int64_t> next{0};
    int64_t n = 0;
    int64_t want = 0;    // helpers it may still take (under mu_)
    int64_t active = 0;  // helpers working on it (under mu_)
  };

  explicit IoPool(pid_t pid) : pid_(pid) {}

  bool start_thread() {
    try {
      std::thread([this] { work(); }).detach();
      return true;
    } catch (...) {  // no thread to be had: the caller does the work
      return false;
    }
  }

  Job* pick() {
    for (Job* j : jobs_)
      if (j->want > 0 && j->next.load(std::memory_order_relaxed) < j->n) return j;
    return nullptr;
  }

  void work() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      Job* j = nullptr;
      work_.wait(lk, [&] { return (j = pick()) != nullptr; });
      --j->want;
      ++j->active;
      lk.unlock();
      for (int64_t i = j->next.fetch_add(1); i < j->n; i = j->next.fetch_add(1)) j->call(j->fn, i);
      lk.lock();
      if (--j->active == 0) done_.notify_all();
    }
  }

  const pid_t pid_;
  std::mutex mu_;
  std::condition_variable work_, done_;
  std::vector<Job*> jobs_;
  int64_t threads_ = 0;
};

// The runs of [0, n): i..j-1 where records[k+1] == records[k] + 1, at most max_run long, each
// through io(a, b, flags): first all of them with RWF_NOWAIT over cpu_threads threads (what the
// page cache holds: memcpys), then those that would have waited for the device (kWouldBlock)
// blocking, over io_threads threads.  Returns 0, or the errno of the first call to fail (in time;
// no run starts after it) and in *where the index of its run's first record.  A run retried after
// a partial RWF_NOWAIT transfer moves its bytes again: the same bytes to the same place.
template <class F>
int64_t for_runs(const int64_t* records, int64_t n, int64_t max_run, int64_t cpu_threads, int64_t io_threads,
                 int64_t* where, F&& io) {
  std::vector<int64_t> starts;
  starts.reserve(n / 4 + 1);
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || records[i] != records[i - 1] + 1 || i - starts.back() >= max_run) starts.push_back(i);
  starts.push_back(n);
  const int64_t runs = (int64_t)starts.size() - 1;
  std::atomic<int64_t> rc{0};
  std::atomic<int64_t> at{-1};
  std::atomic<int> nowait{RWF_NOWAIT};  // 0 once the file refuses RWF_NOWAIT (EOPNOTSUPP)
  std::vector<uint8_t> waits(runs, 0);  // runs that would wait for the device
  // Items are chunks of runs (a pool hand-off per run would cost more than a cached read).
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(64, runs / (4 * std::max<int64_t>(1, cpu_threads))));
  auto cached = [&](int64_t c) {
    for (int64_t r = c * chunk; r < std::min(runs, (c + 1) * chunk); ++r) {
      if (rc.load(std::memory_order_relaxed) != 0) return;
      const int flags = nowait.load(std::memory_order_relaxed);
      int64_t e = flags ? io(starts[r], starts[r + 1], flags) : kWouldBlock;
      if (e == EOPNOTSUPP || e == EINVAL) {  // no RWF_NOWAIT for this file: every run waits its turn
        nowait.store(0, std::memory_order_relaxed);
        e = kWouldBlock;
      }
      if (e == kWouldBlock) {
        waits[r] = 1;
      } else if (e != 0) {
        int64_t zero = 0;
        if (rc.compare_exchange_strong(zero, e)) at.store(starts[r]);
      }
    }
  };
  IoPool::get().run((runs + chunk - 1) / chunk, cpu_threads - 1, cached);
  std::vector<int64_t> later;
  if (rc.load() == 0)
    for (int64_t r = 0; r < runs; ++r)
      if (waits[r]) later.push_back(r);
  auto blocking = [&](int64_t k) {
    if (rc.load(std::memory_order_relaxed) != 0) return;
    const int64_t r = later[k];
    const int64_t e = io(starts[r], starts[r + 1], 0);
    if (e != 0) {
      int64_t zero = 0;
      if (rc.compare_exchange_strong(zero, e)) at.store(starts[r]);
    }
  };
  if (!later.empty()) IoPool::get().run((int64_t)later.size(), io_threads - 1, blocking);
  *where = at.load();
  return rc.load();
}

constexpr int64_t kMaxRun = 256;  // records per call: long runs still spread over threads

// Moves a run's bytes with one call after another of sys(iov, count, offset, flags) (preadv2 or
// pwritev2) until all went, skipping what each call moved (a part-filled iovec goes on where it
// stopped).  Returns 0, an errno (EIO: a read at the end of the file), or kWouldBlock (RWF_NOWAIT
// and the page cache could not take it all).
template <class Sys>
int64_t move_run(struct iovec* iov, int k, int64_t off, int flags, Sys&& sys) {
  int first = 0;
  while (first < k) {
    ssize_t got = sys(iov + first, k - first, (off_t)off, flags);
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN && flags != 0) return kWouldBlock;
      return (int64_t)errno;
    }
    if (got == 0) return (int64_t)EIO;  // past the end: the record was never written
    off += got;
    while (got > 0 && first < k) {
      const size_t take = std::min<size_t>((size_t)got, iov[first].iov_len);
      iov[first].iov_base = (char*)iov[first].iov_base + take;
      iov[first].iov_len -= take;
      got -= (ssize_t)take;
      if (iov[first].iov_len == 0) ++first;
    }
  }
  return 0;
}

// bufs: records int64 [n], rows bytes [n * record_bytes]; ints: fd, record_bytes, io_threads, cpu_threads.
// io(fd, records, rows, record_bytes, a, b, flags) moves the run [a, b).
template <class Row, class F>
int64_t tier_io(const he::Call& call, const char* verb, F&& io) {
  call.expect(2, -1, 0);
  const int64_t fd = call.i(0), record_bytes = call.i(1), io_threads = call.i(2);
  const int64_t cpu_threads = call.nints() > 3 ? call.i(3) : 1;
  const int64_t n = call.numel(0);
  if (fd < 0 || fd > INT32_MAX || record_bytes < 1 || n > INT64_MAX / record_bytes || io_threads < 1 ||
      cpu_threads < 1)
    call.fail(HE_BAD_CALL, "fd %lld, record_bytes %lld, io_threads %lld, %lld records", (long long)fd,
              (long long)record_bytes, (long long)io_threads, (long long)n);
  const int64_t* records = call.buf<const int64_t>(0, n, "records");
  Row* rows = call.bytes<Row>(1, n * record_bytes, "rows");
  int64_t where = -1;
  const int64_t e = for_runs(records, n, kMaxRun, cpu_threads, io_threads, &where, [&](int64_t a, int64_t b, int flags) {
    return io((int)fd, records, rows, record_bytes, a, b, flags);
  });
  if (e != 0) {
    call.detail({e, where, where >= 0 ? records[where] : -1});
    call.fail(HE_IO_ERROR, "%s record %lld: %s", verb, (long long)(where >= 0 ? records[where] : -1),
              std::strerror((int)e));
  }
  return 0;
}

// Records [0, n) moved to or from their cache slots (the *_rows kernels below): one iovec per row, a
// run of adjacent records one sys(fd, iov, count, offset, flags) call.  Every slot is checked before
// any I/O.  bufs: records int64 [n], rows bytes [C * record_bytes], slots int64 [n]; ints: fd,
// record_bytes, io_threads, cpu_threads (optional).
// run_bytes > 0: sys(fd, iov, count, off, flags) moves the whole run itself (returning as move_run
// does), and a run is at most run_bytes; else sys is one preadv2 / pwritev2 and a run at most
// IOV_MAX rows.
template <class Row, int64_t run_bytes = 0, class Sys>
int64_t tier_io_slots(const he::Call& call, const char* verb, Sys&& sys) {
  call.expect(3, -1, 0);
  const int64_t fd = call.i(0), record_bytes = call.i(1), io_threads = call.i(2);
  const int64_t cpu_threads = call.nints() > 3 ? call.i(3) : 1;
  const int64_t n = call.numel(0);
  if (fd < 0 || fd > INT32_MAX || record_bytes < 1 || io_threads < 1 || cpu_threads < 1)
    call.fail(HE_BAD_CALL, "fd %lld, record_bytes %lld, io_threads %lld", (long long)fd, (long long)record_bytes,
              (long long)io_threads);
  const int64_t C = call.numel(1) / record_bytes;
  const int64_t* records = call.buf<const int64_t>(0, n, "records");
  Row* rows = call.bytes<Row>(1, C * record_bytes, "rows");
  const int64_t* slots = call.buf<const int64_t>(2, n, "slots");
  for (int64_t i = 0; i < n; ++i)
    if (slots[i] < 0 || slots[i] >= C) {
      call.detail({i, slots[i], C});
      call.fail(HE_BAD_VALUE, "slots[%lld] = %lld is not a row of the cache (%lld)", (long long)i,
                (long long)slots[i], (long long)C);
    }
  int64_t where = -1;
  const int64_t max_run = run_bytes > 0 ? std::max<int64_t>(1, run_bytes / record_bytes) : std::min<int64_t>(kMaxRun, IOV_MAX);
  const int64_t e = for_runs(records, n, max_run, cpu_threads, io_threads, &where,
                             [&](int64_t a, int64_t b, int flags) -> int64_t {
    thread_local std::vector<struct iovec> t_iov;
    std::vector<struct iovec>& iov = t_iov;
    if ((int64_t)iov.size() < b - a) iov.resize(b - a);
    int k = 0;
    for (int64_t i = a; i < b; ++i) iov[k++] = {(void*)(rows + slots[i] * record_bytes), (size_t)record_bytes};
    if constexpr (run_bytes > 0) return sys((int)fd, iov.data(), k, (off_t)(records[a] * record_bytes), flags);
    else return move_run(iov.data(), k, records[a] * record_bytes, flags, [&](struct iovec* v, int c, off_t off, int f) {
      return sys((int)fd, v, c, off, f);
    });
  });
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
// (the reads in flight), cpu_threads (optional, 1: the threads copying what the page cache holds).
// Returns 0; fails with HE_IO_ERROR (see above).
HE_KERNEL(he_tier_read) {
  return tier_io<char>(call, "reading", [](int fd, const int64_t* records, char* out, int64_t record_bytes, int64_t a,
                                           int64_t b, int flags) -> int64_t {
    struct iovec iov = {out + a * record_bytes, (size_t)((b - a) * record_bytes)};
    return move_run(&iov, 1, records[a] * record_bytes, flags, [fd](struct iovec* v, int k, off_t off, int f) {
      return preadv2(fd, v, k, off, f);
    });
  });
}

// Record records[i] of the file = rows[i], for i in [0, n).
// bufs: records int64 [n], rows bytes [n * record_bytes]; ints: fd, record_bytes, io_threads, cpu_threads
// (optional).
// Returns 0; fails with HE_IO_ERROR (see above).
HE_KERNEL(he_tier_write) {
  return tier_io<const char>(call, "writing", [](int fd, const int64_t* records, const char* rows,
                                                 int64_t record_bytes, int64_t a, int64_t b, int flags) -> int64_t {
    struct iovec iov = {(void*)(rows + a * record_bytes), (size_t)((b - a) * record_bytes)};
    return move_run(&iov, 1, records[a] * record_bytes, flags, [fd](struct iovec* v, int k, off_t off, int f) {
      return pwritev2(fd, v, k, off, f);
    });
  });
}

// Row slots[i] of `rows` (a cache: C rows of record_bytes) = record records[i] of the file, for i
// in [0, n): the bring-in's reads land in their cache slots, no buffer and no scatter after.  A run
// of adjacent records is one preadv2, one iovec per row.
// bufs: records int64 [n], rows bytes [C * record_bytes] (out), slots int64 [n]; ints: fd, record_bytes,
// io_threads, cpu_threads (optional).  Returns 0; fails with HE_IO_ERROR (see above), HE_BAD_VALUE for a slot outside the
// rows (detail = (index, slot, C)), before any read.
HE_KERNEL(he_tier_read_rows) {
  return tier_io_slots<char>(call, "reading", [](int fd, struct iovec* v, int c, off_t off, int f) {
    return preadv2(fd, v, c, off, f);
  });
}

// Record records[i] of the file = row slots[i] of `rows` (a cache: C rows of record_bytes), for i in
// [0, n).  A run of adjacent records (up to kStageBytes) is gathered from its cache slots into a
// buffer of the thread (the next rows prefetched: the victims are scattered over the cache) and
// written with one pwritev2 of one iovec.  One iovec per row, as the reads do, cost the kernel
// ~0.35 us a row (54 k rows of 260 B: ~20 ms of system time, against ~2.5 ms for the same bytes
// in one piece, 2026-11-28, this VM's Xeon).
// bufs: records int64 [n], rows bytes [C * record_bytes], slots int64 [n]; ints: fd, record_bytes,
// io_threads, cpu_threads (optional).  Returns 0; fails with HE_IO_ERROR (see above), HE_BAD_VALUE
// for a slot outside the rows (detail = (index, slot, C)), before any write.
HE_KERNEL(he_tier_write_rows) {
  constexpr int64_t kStageBytes = 256 << 10, kAhead = 8;
  return tier_io_slots<const char, kStageBytes>(call, "writing", [](int fd, struct iovec* v, int c, off_t off,
                                                                    int f) -> int64_t {
    thread_local std::vector<char> t_stage;
    std::vector<char>& stage = t_stage;
    size_t bytes = 0;
    for (int i = 0; i < c; ++i) bytes += v[i].iov_len;
    if (stage.size() < bytes) stage.resize(bytes);
    char* out = stage.data();
    for (int i = 0; i < c; ++i) {
      if (i + kAhead < c) {
        const char* p = (const char*)v[i + kAhead].iov_base;
        for (size_t b = 0; b < v[i + kAhead].iov_len; b += 64) __builtin_prefetch(p + b);
      }
      std::memcpy(out, v[i].iov_base, v[i].iov_len);
      out += v[i].iov_len;
    }
    struct iovec one = {stage.data(), bytes};
    return move_run(&one, 1, off, f, [fd](struct iovec* w, int k, off_t o, int fl) { return pwritev2(fd, w, k, o, fl); });
  });
}
