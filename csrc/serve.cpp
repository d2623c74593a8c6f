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

// splitmix64's finalizer (not he::mix64, MurmurHash3's): the serving format fixes this one.
inline uint64_t splitmix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z;
}

// One (id, table t) through the index: its position in `keys`, or -1 (m: table t's meta row).
template <class Slot>
int64_t probe(int64_t id, int64_t t, const int64_t* m, const int64_t* keys, int64_t nkeys, const Slot* index,
              uint64_t mask) {
  const int64_t lo = m[2], hi = m[2] + m[1], limit = m[4];
  uint64_t h = splitmix64((uint64_t)(t + 1) * kGolden + (uint64_t)id) & mask;
  for (int64_t r = 0; r < limit; ++r) {
    const int64_t s = (int64_t)index[h];
    if (s < 0) return -1;
    if (s >= lo && s < hi && s < nkeys && keys[s] == id) return s;
    h = (h + 1) & mask;
  }
  return -1;
}

// The position in `keys` of each (id, table), or -1 (static tables and tables outside [0, T): -1).
template <class Slot>
void find(const int64_t* ids, const int64_t* table, int64_t n, const int64_t* keys, int64_t nkeys, const Slot* index,
          int64_t cap, const int64_t* meta, int64_t T, int64_t* out, int64_t nthreads) {
  const uint64_t mask = (uint64_t)cap - 1;
  he::parallel_for(n, (int)nthreads, 8192, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = table[i];
      const bool dynamic = t >= 0 && t < T && meta[5 * t + 2] >= 0;
      out[i] = dynamic ? probe(ids[i], t, meta + 5 * t, keys, nkeys, index, mask) : -1;
    }
  });
}

template <class Slot>
void bags(const int64_t* values, const int64_t* offsets, int64_t B, int64_t F, const int64_t* feature_pos,
          const int64_t* feature_table, const int64_t* keys, int64_t nkeys, const Slot* index, int64_t cap,
          const int64_t* meta, int64_t zero_row, const int64_t* starts, int64_t* idx, int64_t* kept,
          int64_t nthreads) {
  const uint64_t mask = (uint64_t)cap - 1;
  // Bags visited feature-major (the ids and offsets read in order; the row indices written to their
  // batch-major places): measured 2.5x faster than visiting them batch-major, where each sample's
  // F bags read F distant parts of `values`.
  he::parallel_for(B * F, (int)nthreads, 1024, [&](int64_t q0, int64_t q1, int) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t f = q / B, b = q % B, j = b * F + f, t = feature_table[f];
      const int64_t in_bag = feature_pos[f] * B + b;
      const int64_t* m = meta + 5 * t;  // ROW_BASE, NUM, KEY_BASE, MISS_ROW, MAX_PROBE
      int64_t o = starts[j], n = 0;
      for (int64_t i = offsets[in_bag]; i < offsets[in_bag + 1]; ++i, ++o) {
        const int64_t id = values[i];
        if (id < 0) {  // dropped: reads the zero row, not counted
          idx[o] = zero_row;
          continue;
        }
        ++n;
        if (m[2] < 0) {  // static: the id is the row
          idx[o] = id < m[1] ? m[0] + id : m[3];
        } else {
          const int64_t s = probe(id, t, m, keys, nkeys, index, mask);
          idx[o] = s >= 0 ? m[0] + (s - m[2]) : m[3];
        }
      }
      kept[j] = n;
    }
  });
}

}  // namespace

// The whole id -> row pass of hugeembed_serve::pooled_lookup for one dim group: bags pooled
// batch-major (bag j = b * F + f reads input bag feature_pos[f] * B + b), each id's row in
// `rows` written at idx[starts[j] ...] (starts: the bags' exclusive prefix sum of lengths, also
// written here), ids < 0 reading zero_row and not counted, kept[j] the counted ids of bag j (the
// divisor of mean / sqrtn).  Returns the number of ids, or -1 when the arguments are
// inconsistent (bad offsets, a table outside [0, T), a row or probe range outside the arrays):
// then nothing meaningful was written and the caller takes its torch path.
HE_API int64_t he_serve_bags(const int64_t* values, int64_t n_values, const int64_t* offsets, int64_t n_offsets,
                             int64_t B, int64_t F, const int64_t* feature_pos, const int64_t* feature_table,
                             const int64_t* keys, int64_t nkeys, const void* index, int64_t index_bytes, int64_t cap,
                             const int64_t* meta, int64_t T, int64_t n_rows, int64_t* starts, int64_t* idx,
                             int64_t idx_len, int64_t* kept, int64_t nthreads) {
  if (cap < 1 || (cap & (cap - 1)) != 0 || (index_bytes != 4 && index_bytes != 8) || B < 0 || F < 0 || T < 0 ||
      n_rows < 1)
    return -1;
  for (int64_t t = 0; t < T; ++t) {  // every row an id can read lies in `rows`
    const int64_t* m = meta + 5 * t;
    if (m[0] < 0 || m[1] < 0 || m[0] + m[1] > n_rows || m[3] < 0 || m[3] >= n_rows || m[4] < 0) return -1;
    if (m[2] >= 0 && m[2] + m[1] > nkeys) return -1;
  }
  int64_t total = 0;
  for (int64_t j = 0; j < B * F; ++j) {
    const int64_t b = j / F, f = j % F;
    if (feature_table[f] < 0 || feature_table[f] >= T || feature_pos[f] < 0) return -1;
    const int64_t in_bag = feature_pos[f] * B + b;
    if (in_bag + 1 >= n_offsets) return -1;
    const int64_t i0 = offsets[in_bag], i1 = offsets[in_bag + 1];
    if (i0 < 0 || i1 < i0 || i1 > n_values) return -1;
    starts[j] = total;
    total += i1 - i0;
  }
  if (total > idx_len) return -1;
  if (index_bytes == 4)
    bags(values, offsets, B, F, feature_pos, feature_table, keys, nkeys, static_cast<const int32_t*>(index), cap, meta,
         n_rows - 1, starts, idx, kept, nthreads);
  else
    bags(values, offsets, B, F, feature_pos, feature_table, keys, nkeys, static_cast<const int64_t*>(index), cap, meta,
         n_rows - 1, starts, idx, kept, nthreads);
  return total;
}

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
