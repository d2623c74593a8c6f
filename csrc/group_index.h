// The key index of a group of dynamic tables (hugeembed/store/_dynamic.py): one open-addressing
// hash table keyed by (table, key), shared by the native kernels (csrc/group_index.cpp) and the
// plain-PyTorch reference (hugeembed/store/_index_torch.py), so a group moves between them (and
// between devices) as a copy of its tensors:
//
//   buckets int64 [B, 4]  one 32-byte record per bucket (never straddling a cache line):
//     word 0  key (any int64)
//     word 1  table (the group's table index), kFreeBucket when the bucket is empty
//     word 2  low 32 bits: code (int32)  >= 0 row slot of an admitted key, -2 a pending key
//             high 32 bits: hit count (int32, saturating at 2^31 - 1)
//     word 3  last step the key was seen
//   free_rows int32 []    stack of free row slots of the group's rows, sorted descending (pop = smallest)
//   scalars  int64 [kGroupLen]   below
//   tables   int64 [T, kTableLen]  per table, below
//
// A key's home bucket is ((mix64(key ^ hash_key[t]) >> 32) * B) >> 32 (any B <= 2^32), probing
// linear and wrapping at B.  hash_key[t] differs per table (and holds the table's random salt),
// so equal ids of two tables live apart and ids chosen to collide under one key do not collide
// under another.
#pragma once

#include <cstdint>

#include "common.h"

namespace he::gi {

constexpr int64_t kWords = 4;
constexpr int64_t kFreeBucket = -1;
constexpr int64_t kAbsent = -1;
constexpr int32_t kPendingCode = -2;

enum GroupScalar : int {
  kEntries = 0,  // keys held in buckets
  kRowHwm = 1,   // row slots handed out so far (live + free)
  kNumFree = 2,  // entries of free_rows in use
  kGroupLen = 3,
};

enum TableField : int {
  kRows = 0,      // live admitted rows of the table
  kPending = 1,   // live pending keys of the table
  kRowLimit = 2,  // at most this many live rows (its capacity)
  kAdmitK = 3,    // a key gets a row once seen this many times
  kHashKey = 4,   // mixed into the hash of the table's keys
  kTableLen = 5,
};

inline int32_t code_of(int64_t w) { return (int32_t)(uint32_t)(uint64_t)w; }
inline int32_t count_of(int64_t w) { return (int32_t)((uint64_t)w >> 32); }
inline int64_t pack(int32_t code, int64_t count) {
  int64_t c = count < 0 ? 0 : (count > INT32_MAX ? INT32_MAX : count);
  return (int64_t)(((uint64_t)c << 32) | (uint64_t)(uint32_t)code);
}
inline uint64_t home(int64_t key, int64_t hash_key, uint64_t nb) {
  return ((he::mix64((uint64_t)key ^ (uint64_t)hash_key) >> 32) * nb) >> 32;
}
inline uint64_t next(uint64_t p, uint64_t nb) { return p + 1 == nb ? 0 : p + 1; }

// A group's arrays as the kernels use them (built and checked from a call's buffers).
struct Group {
  int64_t* buckets;
  int64_t nbuckets;
  int64_t r_cap;  // rows of the group's storage
  int32_t* free_rows;
  int64_t* st;
  int64_t* tables;
  int64_t T;
  int64_t* table(int64_t t) const { return tables + kTableLen * t; }
};

}  // namespace he::gi
