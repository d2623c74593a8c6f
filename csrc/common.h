// Shared helpers for hugeembed's native kernels.
//
// Kernels are extern "C" functions over raw pointers, loaded with ctypes by
// hugeembed/_native.py.  Conventions every kernel follows:
//   * pointers are to contiguous CPU buffers whose dtype and length the Python
//     wrapper has already checked;
//   * a kernel never throws across the C boundary; a bad value found inside a
//     kernel is reported through the return code (0 = ok) and an `int64_t* err`
//     out-array that the wrapper turns into an exception naming the feature,
//     table and value;
//   * `nthreads` comes from torch.get_num_threads() so we obey the same knob.
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define HE_API extern "C" __attribute__((visibility("default")))

namespace he {

// Runs fn(begin, end, thread_index) over [0, n) split into `nthreads` contiguous
// chunks.  Threads are spawned per call: a spawn costs ~20 us, negligible next to
// the millisecond kernels that use it, and it avoids a second OpenMP runtime next
// to the one torch ships (two spinning pools would fight over the cores).
template <class F>
void parallel_for(int64_t n, int nthreads, int64_t min_per_thread, F&& fn) {
  if (n <= 0) return;
  int64_t max_threads = std::max<int64_t>(1, n / std::max<int64_t>(1, min_per_thread));
  int t = (int)std::min<int64_t>(std::max(1, nthreads), max_threads);
  if (t == 1) {
    fn(int64_t(0), n, 0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  int64_t chunk = (n + t - 1) / t;
  for (int i = 1; i < t; ++i) {
    int64_t b = i * chunk, e = std::min(n, b + chunk);
    if (b >= e) break;
    pool.emplace_back([&fn, b, e, i] { fn(b, e, i); });
  }
  fn(int64_t(0), std::min(n, chunk), 0);
  for (auto& th : pool) th.join();
}

// Runs fn(item, thread_index) for each item of a work list, items handed out
// dynamically (an atomic counter) so uneven items (tables of different sizes)
// balance across threads.  Each item runs on exactly one thread.
template <class F>
void parallel_items(int64_t n_items, int nthreads, F&& fn) {
  if (n_items <= 0) return;
  int t = (int)std::min<int64_t>(std::max(1, nthreads), n_items);
  if (t == 1) {
    for (int64_t i = 0; i < n_items; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&](int tid) {
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) fn(i, tid);
  };
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  for (int i = 1; i < t; ++i) pool.emplace_back(worker, i);
  worker(0);
  for (auto& th : pool) th.join();
}

// 64-bit finaliser of MurmurHash3 / splitmix64: a bijection with good avalanche,
// so consecutive ids spread over the whole hash space.  The Python twin in
// hugeembed/_hashing.py computes the same function with torch int64 ops.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

inline uint64_t next_pow2(uint64_t x) {
  uint64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// A batch-local open-addressing map from int64 key to a dense index 0..n-1 in
// first-seen order.  Used to deduplicate the ids of one batch (DeepRec's
// "UniqueWithCounts").  Any int64 is a valid key: emptiness is kept in the
// index (-1), never encoded in the key.  Key and index share one 16-byte record
// so a probe touches one cache line.  Owned by a long-lived context and reused
// across batches so its memory is not faulted in afresh every step.
struct LocalDedup {
  struct Rec {
    int64_t key;
    int32_t idx;  // -1: empty
    int32_t pad;
  };
  std::vector<Rec> recs;
  uint64_t mask = 0;
  int32_t count = 0;

  void reset(int64_t expected) {
    uint64_t cap = next_pow2((uint64_t)std::max<int64_t>(16, expected * 2));
    if (cap > recs.size()) recs.assign(cap, Rec{0, -1, 0});
    else
      for (uint64_t i = 0; i < cap; ++i) recs[i].idx = -1;
    mask = cap - 1;
    count = 0;
  }

  // Returns the dense index of `key`; `is_new` tells whether it was first seen now.
  inline int32_t find_or_add(int64_t key, bool& is_new) {
    uint64_t pos = mix64((uint64_t)key) & mask;
    while (true) {
      Rec& r = recs[pos];
      if (r.idx < 0) {
        r.key = key;
        r.idx = count;
        is_new = true;
        return count++;
      }
      if (r.key == key) {
        is_new = false;
        return r.idx;
      }
      pos = (pos + 1) & mask;
    }
  }
};

// Dedup of a small static table's ids (0 <= id < rows) by direct indexing: no
// hashing.  `stamp[id] == epoch` marks ids seen in the current batch, so nothing
// is cleared between batches (a new epoch invalidates every mark at once).
struct DirectDedup {
  std::vector<int32_t> stamp, idx;
  int32_t epoch = 0;
  int32_t count = 0;

  void reset(int64_t rows) {
    if ((int64_t)stamp.size() < rows) {
      stamp.assign(rows, 0);
      idx.assign(rows, 0);
      epoch = 0;
    }
    if (++epoch == INT32_MAX) {  // after 2^31 batches: clear once and start over
      std::fill(stamp.begin(), stamp.end(), 0);
      epoch = 1;
    }
    count = 0;
  }

  inline int32_t find_or_add(int64_t key, bool& is_new) {
    if (stamp[key] == epoch) {
      is_new = false;
      return idx[key];
    }
    stamp[key] = epoch;
    idx[key] = count;
    is_new = true;
    return count++;
  }
};

}  // namespace he
