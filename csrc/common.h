// Shared helpers for hugeembed's native kernels.
//
// Kernels are extern "C" functions called through ctypes by hugeembed/_native.py, all
// in the one calling convention of call.h (buffers with their lengths and types,
// integer and real arguments, a status with a message).  `nthreads` comes from
// torch.get_num_threads() so we obey the same knob.
#pragma once

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "call.h"

namespace he {

// Work sharing that never waits for a thread that has not started yet.
//
// A fork-join pool (spawn helpers, join them all) is fragile here: on a loaded
// machine -- more runnable threads than cores, or torch's OpenMP workers still
// spinning after the previous torch op -- a freshly spawned helper may get a core
// only milliseconds later, and the caller then sits in join() for longer than the
// whole kernel takes on one thread (measured: a 0.5 ms kernel stretched to several
// ms).  Here the caller works through the items itself; helpers are detached and
// only help while items remain.  When the caller has run out of items it waits
// only for helpers that are inside an item, never for one that has not begun.
// Threads are spawned per call (~20 us): no second OpenMP runtime next to torch's.
//
// run_items calls fn(item, tid) (or fn(item)) once for every item in [0, n_items),
// tid in [0, nthreads) distinct among threads running at the same time (the caller
// is 0), so fn may index per-thread scratch by tid.
template <class F>
void run_items(int64_t n_items, int64_t nthreads, F&& fn) {
  auto call = [&fn](int64_t i, int tid) {
    if constexpr (std::is_invocable_v<F&, int64_t, int>) fn(i, tid);
    else fn(i);
  };
  if (n_items <= 0) return;
  const int64_t helpers = std::min<int64_t>(nthreads - 1, n_items - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n_items; ++i) call(i, 0);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
    std::atomic<bool> closed{false};
    std::mutex lock;
    std::exception_ptr error;  // the first item that threw: rethrown by the caller once all have left
  };
  auto shared = std::make_shared<Shared>();
  // An exception must not leave a helper (std::terminate) nor the caller while helpers still
  // use its stack: every item runs guarded, and the caller rethrows after the wait.
  auto guarded = [&call, s = shared.get()](int64_t i, int tid) {
    try {
      call(i, tid);
    } catch (...) {
      std::lock_guard<std::mutex> g(s->lock);
      if (!s->error) s->error = std::current_exception();
    }
  };
  auto* c = &guarded;
  for (int64_t h = 0; h < helpers; ++h) {
    // A helper owns a reference to `shared`, and touches the caller's stack (`guarded`)
    // only if it registered as active before the caller closed the call.
    std::thread([shared, c, n_items, tid = (int)(h + 1)] {
      shared->active.fetch_add(1);
      if (!shared->closed.load()) {
        for (int64_t i = shared->next.fetch_add(1); i < n_items; i = shared->next.fetch_add(1)) (*c)(i, tid);
      }
      shared->active.fetch_sub(1);
    }).detach();
  }
  for (int64_t i = shared->next.fetch_add(1); i < n_items; i = shared->next.fetch_add(1)) guarded(i, 0);
  // Sequentially consistent: a helper that registers after this store sees closed
  // and leaves; one that registered before is running, so the wait is one item long.
  shared->closed.store(true);
  while (shared->active.load() != 0) std::this_thread::yield();
  if (shared->error) std::rethrow_exception(shared->error);
}

// fn(begin, end, tid) over [0, n) in chunks of at least min_per_thread (about four
// per thread, so a slow thread is not left with a quarter of the work).
template <class F>
void parallel_for(int64_t n, int nthreads, int64_t min_per_thread, F&& fn) {
  if (n <= 0) return;
  const int64_t t = std::max(1, nthreads);
  const int64_t chunk = std::max<int64_t>(std::max<int64_t>(1, min_per_thread), (n + 4 * t - 1) / (4 * t));
  const int64_t chunks = (n + chunk - 1) / chunk;
  run_items(chunks, t, [&](int64_t c, int tid) { fn(c * chunk, std::min(n, (c + 1) * chunk), tid); });
}

// fn(item, tid) for each item (tables of different sizes), handed out dynamically.
template <class F>
void parallel_items(int64_t n_items, int nthreads, F&& fn) {
  run_items(n_items, nthreads, [&](int64_t i, int tid) { fn(i, tid); });
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

// No dedup at all: every id is its own "unique" entry (forward-only lookups, where
// no gradient has to be summed per row and deduplicating would be wasted work).
struct NoDedup {
  int32_t count = 0;
  void reset() { count = 0; }
  inline int32_t find_or_add(int64_t, bool& is_new) {
    is_new = true;
    return count++;
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
