// The shared memory layout of hugeembed's dynamic hash store (hugeembed/store/_hash.py).
//
// The native kernels (csrc/hash_store.cpp) and the plain-PyTorch twin
// (hugeembed/store/_hash_torch.py) read and write the same arrays, so moving a
// store between backends or devices is a copy of its tensors:
//
//   buckets int32 [B, 3] one 12-byte record per bucket: the key (int64, low
//                        word first, kEmpty when the bucket is free) and its code:
//                        >= 0: row slot of an admitted key
//                        <= -2: pending (not yet admitted) key, pending id = -2 - code
//                        Key and code share a cache line (one miss per probe, not
//                        two) at 12 bytes per bucket.
//   meta   int64 [R, 2]  per row: (hit count, last step seen)
//   pmeta  int64 [P, 2]  per pending id: (hit count, last step seen)
//   free_rows int32 []   stack of free row slots, sorted descending (pop = smallest)
//   free_pend int32 []   stack of free pending ids
//   st     int64 [kStLen] scalars below
//
// B is a power of two; a key's home bucket is mix64(key) & (B - 1) and probing is
// linear.  The key equal to kEmpty cannot live in a bucket: it is kept in a side
// entry (st[kSideUsed], st[kSideCode]).
#pragma once

#include <cstdint>
#include <cstring>

namespace he {

constexpr int64_t kEmpty = INT64_MIN;
constexpr int64_t kAbsent = -1;

enum StoreScalar : int {
  kEntries = 0,   // keys held in buckets (the side entry not included)
  kRowHwm = 1,    // row slots handed out so far (live + free)
  kNumFree = 2,   // entries of free_rows in use
  kPendHwm = 3,   // pending ids handed out so far
  kNumPFree = 4,  // entries of free_pend in use
  kSideUsed = 5,  // 1 when the key kEmpty is stored
  kSideCode = 6,  // its code
  kRows = 7,      // live admitted rows
  kPending = 8,   // live pending keys
  kStLen = 9,
};

// Must match hugeembed/store/_native_store.py::_Table field for field.
struct HsTable {
  int32_t* buckets;
  int64_t nbuckets;
  int64_t* meta;
  int64_t r_cap;
  int64_t* pmeta;
  int64_t p_cap;
  int32_t* free_rows;
  int32_t* free_pend;
  int64_t free_pend_cap;
  int64_t* st;
};

// Access to the packed bucket records (unaligned 8-byte key: memcpy, no UB).
inline int64_t bkey(const int32_t* b, uint64_t i) {
  int64_t k;
  std::memcpy(&k, b + 3 * i, 8);
  return k;
}
inline int32_t bcode(const int32_t* b, uint64_t i) { return b[3 * i + 2]; }
inline void bset(int32_t* b, uint64_t i, int64_t key, int32_t code) {
  std::memcpy(b + 3 * i, &key, 8);
  b[3 * i + 2] = code;
}
inline void bprefetch(const int32_t* b, uint64_t i, int rw = 0) {
  // A record may straddle two cache lines: ask for both ends.
  if (rw) {
    __builtin_prefetch(b + 3 * i, 1);
    __builtin_prefetch(b + 3 * i + 2, 1);
  } else {
    __builtin_prefetch(b + 3 * i);
    __builtin_prefetch(b + 3 * i + 2);
  }
}

}  // namespace he
