// The shared memory layout of hugeembed's dynamic hash store (hugeembed/store/_hash.py).
//
// The native kernels (csrc/hash_store.cpp) and the plain-PyTorch twin
// (hugeembed/store/_hash_torch.py) read and write the same arrays, so moving a
// store between backends or devices is a copy of its tensors:
//
//   buckets int64 [B, 3]  one 24-byte record per bucket:
//     word 0  key (kEmpty when the bucket is free)
//     word 1  low 32 bits: code (int32)  >= 0 row slot of an admitted key,
//                                        -2 a pending (not yet admitted) key
//             high 32 bits: hit count (int32, saturating at 2^31 - 1)
//     word 2  last step the key was seen (int64)
//   free_rows int32 []    stack of free row slots, sorted descending (pop = smallest)
//   st        int64 [kStLen] scalars below
//
// Keeping a key's code and metadata in its bucket record means a hit touches one
// cache line (probe, count, last step), not two or three.  A key's home bucket is
// ((mix64(key) >> 32) * B) >> 32 (any B <= 2^32) and probing is linear, wrapping at B.  The key equal
// to kEmpty cannot live in a bucket: its record is kept in st (kSide*).
#pragma once

#include <cstdint>

namespace he {

constexpr int64_t kEmpty = INT64_MIN;
constexpr int64_t kAbsent = -1;
constexpr int32_t kPendingCode = -2;

enum StoreScalar : int {
  kEntries = 0,    // keys held in buckets (the side record not included)
  kRowHwm = 1,     // row slots handed out so far (live + free)
  kNumFree = 2,    // entries of free_rows in use
  kSideUsed = 3,   // 1 when the key kEmpty is stored
  kSideWord1 = 4,  // its record, words 1 and 2
  kSideLast = 5,
  kRows = 6,       // live admitted rows
  kPending = 7,    // live pending keys
  kStLen = 8,
};

// A table's arrays as the kernels use them (built from the call's buffers, hash_store.cpp::table_of).
struct HsTable {
  int64_t* buckets;
  int64_t nbuckets;
  int64_t r_cap;
  int32_t* free_rows;
  int64_t* st;
};

inline int32_t code_of(int64_t w1) { return (int32_t)(uint32_t)(uint64_t)w1; }
inline int32_t count_of(int64_t w1) { return (int32_t)((uint64_t)w1 >> 32); }
inline int64_t pack(int32_t code, int64_t count) {
  int64_t c = count < 0 ? 0 : (count > INT32_MAX ? INT32_MAX : count);
  return (int64_t)(((uint64_t)c << 32) | (uint64_t)(uint32_t)code);
}

}  // namespace he
