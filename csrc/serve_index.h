// The serving lookup's key indexes, as csrc/serve.cpp's bags pass reads them: open addressing with
// linear probing; a probe stops at an empty slot, at the key, or after the longest chain the build
// recorded.
//
// The artifact's own index (SlotIndex; hugeembed/serving/_index.py::build_index, index.npy): `cap` slots
// (a power of two) holding positions into the dim group's key array (-1: empty), home slot
// splitmix64(id + (t + 1) * GOLDEN) & (cap - 1), chain limits per table in the group's meta.  A probe
// reads a slot, then the key it names.  Its hash is public: anyone can compute ids that share one home slot.
//
// hugeembed's private index (PairIndex), built at load by he_serve_index_build (serve_index.cpp) in the
// server's memory only: int64 words, a header of kHeader -- kIndexMagic, log2(cap), the longest chain,
// the salt's four 16-bit parts (low first), 0 -- then `cap` slots of (key, position), home slot
// splitmix64((id + (t + 1) * GOLDEN) ^ salt) & (cap - 1), the salt drawn at random when the index is
// built: ids chosen to collide without the salt collide here no more than others.  A probe reads one
// slot (16 bytes: the key is in it), where the artifact's index reads a slot and then a key elsewhere.
// A build whose longest chain passes the cap is redrawn (or grown) by the caller.
#pragma once

#include <cstdint>

#include "common.h"

// What a refused he_serve_* kernel found inconsistent: detail[0] of its HE_BAD_VALUE.
enum : int64_t {
  kServeBadIndex = 1,
  kServeBadRows = 2,
  kServeBadMeta = 3,
  kServeBadFeature = 4,
  kServeBadOffsets = 5,
  kServeBadCapacity = 6,
};

namespace he::serve {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr int64_t kIndexMagic = 0x31534548;  // "HES1", little-endian; fits an int32 slot
constexpr int64_t kHeader = 8;

// splitmix64's finalizer (not he::mix64, MurmurHash3's): the serving format fixes this one.
inline uint64_t splitmix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z;
}

inline uint64_t table_key(int64_t id, int64_t t) { return (uint64_t)(t + 1) * kGolden + (uint64_t)id; }

// A table's record in the group's meta: ROW_BASE, NUM, KEY_BASE, MISS_ROW, MAX_PROBE.
template <class Slot>
struct SlotIndex {
  const Slot* slots;
  uint64_t mask;
  const int64_t* keys;
  int64_t nkeys;

  uint64_t home(int64_t id, int64_t t) const { return splitmix64(table_key(id, t)) & mask; }
  void prefetch_slot(uint64_t h) const { __builtin_prefetch(slots + h); }
  // What a probe of (id, t) from home slot h reads first, s = slots[h], with the key it names fetched (the bags
  // pass fetches a batch of home slots, then their keys, before it compares any: the misses overlap).
  int64_t fetch(uint64_t h) const {
    const int64_t s = (int64_t)slots[h];
    if (s >= 0 && s < nkeys) __builtin_prefetch(keys + s);
    return s;
  }
  // The position in `keys` of (id, dynamic table t), or -1; *probes: the slots read.
  int64_t position(int64_t id, int64_t t, const int64_t* m, int64_t* probes = nullptr) const {
    const uint64_t h = home(id, t);
    return position_from(id, t, m, h, (int64_t)slots[h], probes);
  }
  // position() given the home slot h of (id, t) and what it holds, s = slots[h] (read by the caller).
  int64_t position_from(int64_t id, int64_t t, const int64_t* m, uint64_t h, int64_t s,
                        int64_t* probes = nullptr) const {
    (void)t;
    const int64_t lo = m[2], hi = m[2] + m[1], limit = m[4];
    int64_t r = 0;
    for (; r < limit; ++r) {
      if (r > 0) s = (int64_t)slots[h];
      if (s < 0) break;
      if (s >= lo && s < hi && s < nkeys && keys[s] == id) {
        if (probes) *probes = r + 1;
        return s;
      }
      h = (h + 1) & mask;
    }
    if (probes) *probes = r < limit ? r + 1 : limit;
    return -1;
  }
  // The row of (id, dynamic table t) in the group's row matrix, or -1.
  int64_t find(int64_t id, int64_t t, const int64_t* m) const {
    const int64_t s = position(id, t, m);
    return s >= 0 ? m[0] + (s - m[2]) : -1;
  }
};

// hugeembed's private index (he_serve_index_build): int64 words, a header of kHeader, then `cap` slots of two
// words, the key and its position in the group's key array (-1: empty).  A probe compares the key in the
// slot itself: one read (a cache line) per slot, not a slot and then the key it names.
struct PairIndex {
  const int64_t* slots;  // [2 * cap]: key, position
  uint64_t mask;
  uint64_t salt;
  int64_t longest;  // the chain limit of every table

  uint64_t home(int64_t id, int64_t t) const { return splitmix64(table_key(id, t) ^ salt) & mask; }
  void prefetch_slot(uint64_t h) const { __builtin_prefetch(slots + 2 * h); }
  int64_t fetch(uint64_t) const { return 0; }  // nothing more to fetch: the slot holds the key
  // The position in `keys` of (id, dynamic table t) (its range [m[2], m[2] + m[1])), or -1; *probes: the
  // slots read.
  int64_t position_from(int64_t id, int64_t, const int64_t* m, uint64_t h, int64_t, int64_t* probes = nullptr) const {
    const int64_t lo = m[2], hi = m[2] + m[1];
    int64_t r = 0;
    for (; r < longest; ++r) {
      const int64_t* e = slots + 2 * h;
      const int64_t s = e[1];
      if (s < 0) break;
      if (e[0] == id && s >= lo && s < hi) {
        if (probes) *probes = r + 1;
        return s;
      }
      h = (h + 1) & mask;
    }
    if (probes) *probes = r < longest ? r + 1 : longest;
    return -1;
  }
  int64_t position(int64_t id, int64_t t, const int64_t* m, int64_t* probes = nullptr) const {
    return position_from(id, t, m, home(id, t), 0, probes);
  }
};

// The private index, buffer k (int64: the header, then 2 words a slot), checked (else HE_BAD_VALUE,
// detail = (kServeBadIndex, its length)).
inline PairIndex private_index(const he::Call& call, int64_t k) {
  const int64_t n = call.numel(k);
  if (call.type(k) != HE_I64)
    call.fail(HE_BAD_CALL, "buffer %lld (index) has element type %lld, expected int64", (long long)k,
              (long long)call.type(k));
  const int64_t* w = call.buf<const int64_t>(k, n, "index");
  const int64_t log2cap = n >= kHeader ? w[1] : -1;
  const bool ok = n >= kHeader && w[0] == kIndexMagic && log2cap >= 1 && log2cap < 61 &&
                  n == kHeader + ((int64_t)2 << log2cap) && w[2] >= 0 && w[2] <= ((int64_t)1 << log2cap);
  if (!ok) {
    call.detail({kServeBadIndex, n});
    call.fail(HE_BAD_VALUE, "buffer %lld (%lld words) is not a private serving index", (long long)k, (long long)n);
  }
  uint64_t salt = 0;
  for (int q = 3; q >= 0; --q) salt = (salt << 16) | ((uint64_t)w[3 + q] & 0xFFFF);
  return PairIndex{w + kHeader, ((uint64_t)1 << log2cap) - 1, salt, w[2]};
}

}  // namespace he::serve
