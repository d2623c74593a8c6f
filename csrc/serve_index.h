// The serving lookup's key indexes, as csrc/serve.cpp's bags pass reads them: open addressing with
// linear probing over slots that hold positions into the dim group's key array (-1: empty).  A probe
// reads a slot, then the key it names, and stops at an empty slot, at the key, or after the
// longest chain the build recorded.
//
// The artifact's own index (hugeembed/serving/_runtime.py::build_index, index.npy): `cap` slots (a
// power of two), home slot splitmix64(id + (t + 1) * GOLDEN) & (cap - 1), chain limits per table in
// the group's meta.  Its hash is public: anyone can compute ids that share one home slot.
//
// hugeembed's private index, built at load by he_serve_index_build (serve_index.cpp) in the server's memory
// only: the same slots (int32, or int64 past 2^31 keys) after a header of kHeader words of the slot
// type -- kIndexMagic, log2(cap), the longest chain, the salt's four 16-bit parts (low first), 0 --
// and home slot splitmix64((id + (t + 1) * GOLDEN) ^ salt) & (cap - 1), the salt drawn at random
// when the index is built: ids chosen to collide without the salt collide here no more than others.
// A build whose longest chain passes the cap is redrawn (or grown) by the caller.
#pragma once

#include <cstdint>
#include <type_traits>

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
  uint64_t salt = 0;
  int64_t longest = -1;  // the chain limit of every table; -1: each table's MAX_PROBE (the artifact's index)

  uint64_t home(int64_t id, int64_t t) const { return splitmix64(table_key(id, t) ^ salt) & mask; }
  void prefetch(int64_t id, int64_t t) const { __builtin_prefetch(slots + home(id, t)); }
  // The position in `keys` of (id, dynamic table t), or -1; *probes: the slots read.
  int64_t position(int64_t id, int64_t t, const int64_t* m, int64_t* probes = nullptr) const {
    const int64_t lo = m[2], hi = m[2] + m[1], limit = longest >= 0 ? longest : m[4];
    uint64_t h = home(id, t);
    int64_t r = 0;
    for (; r < limit; ++r) {
      const int64_t s = (int64_t)slots[h];
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

// The private index, buffer k (int32 or int64: the header, then its slots), checked (else
// HE_BAD_VALUE, detail = (kServeBadIndex, its length)); runs fn(SlotIndex<Slot> over it).
template <class F>
void with_private_index(const he::Call& call, int64_t k, const int64_t* keys, int64_t nkeys, F&& fn) {
  const int64_t n = call.numel(k), type = call.type(k);
  auto view = [&](auto* w) {
    using Slot = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    const int64_t log2cap = n >= kHeader ? (int64_t)w[1] : -1;
    const bool ok = n >= kHeader && (int64_t)w[0] == kIndexMagic && log2cap >= 1 &&
                    log2cap < 62 && n == kHeader + ((int64_t)1 << log2cap) && w[2] >= 0 &&
                    (int64_t)w[2] <= ((int64_t)1 << log2cap);
    if (!ok) {
      call.detail({kServeBadIndex, n});
      call.fail(HE_BAD_VALUE, "buffer %lld (%lld slots) is not a private serving index", (long long)k, (long long)n);
    }
    uint64_t salt = 0;
    for (int q = 3; q >= 0; --q) salt = (salt << 16) | ((uint64_t)w[3 + q] & 0xFFFF);
    fn(SlotIndex<Slot>{w + kHeader, ((uint64_t)1 << log2cap) - 1, keys, nkeys, salt, (int64_t)w[2]});
  };
  if (type == HE_I32) view(call.buf<const int32_t>(k, 0, "index"));
  else if (type == HE_I64) view(call.buf<const int64_t>(k, 0, "index"));
  else call.fail(HE_BAD_CALL, "buffer %lld (index) has element type %lld, expected int32 or int64", (long long)k,
                 (long long)type);
}

}  // namespace he::serve
