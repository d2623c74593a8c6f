// The serving lookup's key index probe (hugeembed/serving/_runtime.py::_find, bit for bit): the
// position in the group's key array of each (id, table), or -1.
//
// The index is open addressing with linear probing over the keys of a dim group's dynamic
// tables; the home slot of (id, table t) is splitmix64's finalizer of id + (t + 1) * GOLDEN
// (unsigned 64-bit arithmetic, as torch's wrapping int64 ops compute it), masked to the
// capacity.  A probe ends at an empty slot (-1), at a key of the id's table equal to the id,
// or after the table's max probe length (meta column 4).  Static tables (key base -1) and ids
// of tables outside [0, T) are not probed: -1.
#include <cstdint>

#include "common.h"

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z;
}

template <class Slot>
void find(const int64_t* ids, const int64_t* table, int64_t n, const int64_t* keys, int64_t nkeys, const Slot* index,
          int64_t cap, const int64_t* meta, int64_t T, int64_t* out, int64_t nthreads) {
  const uint64_t mask = (uint64_t)cap - 1;
  he::parallel_for(n, (int)nthreads, 8192, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      out[i] = -1;
      const int64_t t = table[i];
      if (t < 0 || t >= T) continue;
      const int64_t* m = meta + 5 * t;  // ROW_BASE, NUM, KEY_BASE, MISS_ROW, MAX_PROBE
      const int64_t lo = m[2], hi = m[2] + m[1], limit = m[4];
      if (lo < 0) continue;
      const int64_t id = ids[i];
      uint64_t h = mix64((uint64_t)(t + 1) * kGolden + (uint64_t)id) & mask;
      for (int64_t r = 0; r < limit; ++r) {
        const int64_t s = (int64_t)index[h];
        if (s < 0) break;  // empty: every probe sequence ends at one
        if (s >= lo && s < hi && s < nkeys && keys[s] == id) {
          out[i] = s;
          break;
        }
        h = (h + 1) & mask;
      }
    }
  });
}

}  // namespace

// index_bytes: 4 (int32 slots) or 8 (int64); cap a power of two.  Returns 0, or 1 when the
// arguments are inconsistent (nothing written).
HE_API int64_t he_serve_find(const int64_t* ids, const int64_t* table, int64_t n, const int64_t* keys, int64_t nkeys,
                             const void* index, int64_t index_bytes, int64_t cap, const int64_t* meta, int64_t T,
                             int64_t* out, int64_t nthreads) {
  if (cap < 1 || (cap & (cap - 1)) != 0 || (index_bytes != 4 && index_bytes != 8) || n < 0 || T < 0) return 1;
  if (index_bytes == 4)
    find(ids, table, n, keys, nkeys, static_cast<const int32_t*>(index), cap, meta, T, out, nthreads);
  else
    find(ids, table, n, keys, nkeys, static_cast<const int64_t*>(index), cap, meta, T, out, nthreads);
  return 0;
}
