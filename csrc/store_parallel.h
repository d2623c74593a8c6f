// Work sharing for the store kernels that never waits for a thread that has not
// started yet.
//
// he::parallel_for / parallel_items (common.h) join every helper thread.  On a
// loaded machine (more runnable threads than cores, or torch's OpenMP workers
// still spinning after the previous op) a freshly spawned helper may get a core
// only milliseconds later, and the caller then sits idle in join() for longer
// than the whole kernel takes on one thread (measured: find at 5 M keys/s with
// two joined threads against 40 M keys/s on one).  Here the caller works through
// the items itself; helpers are detached and only help while items remain.  When
// the caller has run out of items it waits only for helpers that are inside an
// item, never for one that has not begun.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

namespace he {

// Runs fn(item) once for every item in [0, n_items), on the calling thread and
// up to nthreads - 1 helpers.  fn must be safe to run concurrently on distinct items.
template <class F>
void run_items(int64_t n_items, int64_t nthreads, F&& fn) {
  if (n_items <= 0) return;
  const int64_t helpers = std::min<int64_t>(nthreads - 1, n_items - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n_items; ++i) fn(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
    std::atomic<bool> closed{false};
  };
  auto shared = std::make_shared<Shared>();
  auto* f = &fn;
  for (int64_t h = 0; h < helpers; ++h) {
    // The helper owns a reference to `shared`, never to the caller's stack unless
    // it registered as active before the caller closed the call (see below).
    std::thread([shared, f, n_items] {
      shared->active.fetch_add(1);
      if (!shared->closed.load()) {
        for (int64_t i = shared->next.fetch_add(1); i < n_items; i = shared->next.fetch_add(1)) (*f)(i);
      }
      shared->active.fetch_sub(1);
    }).detach();
  }
  for (int64_t i = shared->next.fetch_add(1); i < n_items; i = shared->next.fetch_add(1)) fn(i);
  // Sequentially consistent: a helper that registers after this store sees
  // closed == true and leaves without touching fn; one that registered before is
  // waited for (it is running, so the wait is at most one item long).
  shared->closed.store(true);
  while (shared->active.load() != 0) std::this_thread::yield();
}

}  // namespace he
