// The row access every sparse optimizer kernel shares (csrc/optim.cpp, csrc/optim_adam.cpp):
// the checked arguments, threads per row count, prefetching row visits, int32 counters
// kept in a float column.  The rules' contract is csrc/optim.cpp's header.
#pragma once
#include <cstring>

#include "common.h"

namespace he_optim {

// The arguments every rule takes (csrc/call.h): bufs storage float32 [R, W] (row-major),
// slots int64 [U], grad float32 [U, D] (may be empty only where the rule says); ints W, D,
// then the rule's own; reals the rule's hyperparameters.  All slots are checked before
// anything is written: a bad one fails with HE_BAD_VALUE, detail = {position, slot},
// and the table is unchanged.
struct Rows {
  float* storage;
  int64_t R, W, D;
  const int64_t* slots;
  int64_t U;
  const float* grad;
};

// `state(D)`: the rule's state columns after the weights (each row reads and writes D + state).
template <class S>
inline Rows rows_of(const he::Call& call, int64_t nints, int64_t nreals, S&& state, bool grad_optional = false) {
  call.expect(3, nints, nreals);
  const int64_t W = call.i(0), D = call.i(1);
  const int64_t n = call.numel(0);
  if (W < 1 || D < 0 || D > W || state(D) > W - D || n % W != 0)
    call.fail(HE_BAD_CALL, "storage of %lld floats is not [rows, %lld] holding dim %lld and %lld state columns",
              (long long)n, (long long)W, (long long)D, (long long)state(std::min<int64_t>(std::max<int64_t>(D, 0), W)));
  Rows r{call.buf<float>(0, n, "storage"), n / W, W, D, nullptr, call.numel(1), nullptr};
  r.slots = call.buf<const int64_t>(1, r.U, "slots");
  r.grad = grad_optional ? call.opt<const float>(2, r.U * D, "grad") : call.buf<const float>(2, r.U * D, "grad");
  for (int64_t i = 0; i < r.U; ++i) {
    const int64_t slot = r.slots[i];
    if (slot < 0 || slot >= r.R) {
      call.detail({i, slot});
      call.fail(HE_BAD_VALUE, "slot %lld at position %lld is out of range for a table of %lld rows", (long long)slot,
                (long long)i, (long long)r.R);
    }
  }
  return r;
}

// Rows per thread so that a thread gets at least ~32k element updates: below
// that, spawning a thread costs more than it saves.
inline int64_t rows_per_thread(int64_t D, int64_t cost = 1) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, D * cost));
}

// Rows are visited in slot order, scattered over a table far larger than the
// caches: each visit is a cache/TLB miss.  Prefetching the row `kAhead` visits
// ahead (for writing) overlaps those misses.
constexpr int64_t kAhead = 12;

// Runs body(i) for i in [b, e), prefetching the `bytes` of row slots[i + kAhead].
template <class F>
inline void for_rows(const float* storage, int64_t W, int64_t bytes, const int64_t* slots, int64_t b, int64_t e,
                     F&& body) {
  for (int64_t i = b; i < e; ++i) {
    if (i + kAhead < e) {
      const char* row = (const char*)(storage + slots[i + kAhead] * W);
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 1, 3);
      __builtin_prefetch(row + bytes - 1, 1, 3);  // the last line when the row is not line-aligned
    }
    body(i);
  }
}

// Integer counters (Adam's per-row step, last-updated step) live in a float
// column as the bit pattern of an int32: exact up to 2^31 - 1, unlike a float
// value (exact only to 2^24).  memcpy avoids type-punning undefined behaviour.
inline int64_t load_counter(const float* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_counter(float* p, int64_t v) {
  int32_t x = (int32_t)v;
  std::memcpy(p, &x, sizeof x);
}

}  // namespace he_optim

// The leading arguments of every rule's row function, from a checked Rows r.
#define HE_ROWS r.storage, r.R, r.W, r.D, r.slots, r.U, r.grad
