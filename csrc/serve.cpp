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

// bags() on the index's slot type; apart from the checked call (and compiled apart from it).
__attribute__((noinline)) void run_bags(const int64_t* values, const int64_t* offsets, int64_t B, int64_t F,
                                        const int64_t* feature_pos, const int64_t* feature_table, const int64_t* keys,
                                        int64_t nkeys, const void* index, int64_t index_bytes, int64_t cap,
                                        const int64_t* meta, int64_t zero_row, const int64_t* starts, int64_t* idx,
                                        int64_t* kept, int64_t nthreads) {
  if (index_bytes == 4)
    bags(values, offsets, B, F, feature_pos, feature_table, keys, nkeys, static_cast<const int32_t*>(index), cap, meta,
         zero_row, starts, idx, kept, nthreads);
  else
    bags(values, offsets, B, F, feature_pos, feature_table, keys, nkeys, static_cast<const int64_t*>(index), cap, meta,
         zero_row, starts, idx, kept, nthreads);
}

}  // namespace

// What a refused he_serve_bags / he_serve_find found inconsistent: detail[0] of its HE_BAD_VALUE.
enum : int64_t {
  kServeBadIndex = 1,
  kServeBadRows = 2,
  kServeBadMeta = 3,
  kServeBadFeature = 4,
  kServeBadOffsets = 5,
  kServeBadCapacity = 6,
};

namespace {

// The index, buffer k: int32 or int64 slots, a power-of-two count of them (else HE_BAD_VALUE,
// detail = (kServeBadIndex, capacity)).  Returns the element size.
int64_t index_of(const he::Call& call, int64_t k, const void** index, int64_t* cap) {
  *cap = call.numel(k);
  const int64_t type = call.type(k);
  if (type == HE_I32) *index = call.buf<const int32_t>(k, *cap, "index");
  else if (type == HE_I64) *index = call.buf<const int64_t>(k, *cap, "index");
  else call.fail(HE_BAD_CALL, "buffer %lld (index) has element type %lld, expected int32 or int64", (long long)k,
                 (long long)type);
  if (*cap < 1 || (*cap & (*cap - 1)) != 0) {
    call.detail({kServeBadIndex, *cap});
    call.fail(HE_BAD_VALUE, "index capacity %lld is not a power of two", (long long)*cap);
  }
  return type == HE_I32 ? 4 : 8;
}

}  // namespace

// The whole id -> row pass of hugeembed_serve::pooled_lookup for one dim group: bags pooled
// batch-major (bag j = b * F + f reads input bag feature_pos[f] * B + b), each id's row in
// `rows` written at idx[starts[j] ...] (starts: the bags' exclusive prefix sum of lengths, also
// written here), ids < 0 reading zero_row (n_rows - 1) and not counted, kept[j] the counted ids
// of bag j (the divisor of mean / sqrtn).
//   bufs: values int64 [n_values], offsets int64 [n_offsets], feature_pos int64 [F],
//         feature_table int64 [F], keys int64 [nkeys], index int32 or int64 [cap] (a power of two),
//         meta int64 [T * 5], starts int64 [B * F] (out), idx int64 [the ids read] (out),
//         kept int64 [B * F] (out)
//   ints: B, T, n_rows (rows in the group's row matrix)
// Returns the number of ids read (written to idx).  Fails with HE_BAD_VALUE, writing nothing, when
// the arguments are inconsistent; then the caller takes its torch path.  detail[0] says which:
//   kServeBadIndex    (capacity): the index capacity is not a power of two
//   kServeBadRows     (n_rows): no zero row
//   kServeBadMeta     (table t, its ROW_BASE, NUM, KEY_BASE, MISS_ROW): a row or key range outside the
//                     arrays (or a negative MAX_PROBE)
//   kServeBadFeature  (f, its table, its input feature): a table outside [0, T), or a position
//                     negative or past the offsets (>= n_offsets / B)
//   kServeBadOffsets  (bag j, input bag, its first and end offset): offsets outside the values
//   kServeBadCapacity (ids read, idx length): idx too short for the ids the bags read
HE_KERNEL(he_serve_bags) {
  call.expect(10, 3, 0);
  const int64_t B = call.i(0), T = call.i(1), n_rows = call.i(2);
  const int64_t F = call.numel(2);
  if (B < 0 || T < 0 || T > INT64_MAX / 5 || (F > 0 && B > INT64_MAX / F))
    call.fail(HE_BAD_CALL, "B %lld, T %lld, F %lld: need B >= 0, T >= 0", (long long)B, (long long)T, (long long)F);
  const int64_t n_values = call.numel(0), n_offsets = call.numel(1), nkeys = call.numel(4);
  const int64_t* values = call.buf<const int64_t>(0, n_values, "values");
  const int64_t* offsets = call.buf<const int64_t>(1, n_offsets, "offsets");
  const int64_t* feature_pos = call.buf<const int64_t>(2, F, "feature_pos");
  const int64_t* feature_table = call.buf<const int64_t>(3, F, "feature_table");
  const int64_t* keys = call.buf<const int64_t>(4, nkeys, "keys");
  const void* index = nullptr;
  int64_t cap = 0;
  const int64_t index_bytes = index_of(call, 5, &index, &cap);
  const int64_t* meta = call.buf<const int64_t>(6, 5 * T, "meta");
  int64_t* starts = call.buf<int64_t>(7, B * F, "starts");
  int64_t* kept = call.buf<int64_t>(9, B * F, "kept");
  if (n_rows < 1) {
    call.detail({kServeBadRows, n_rows});
    call.fail(HE_BAD_VALUE, "no zero row (%lld rows)", (long long)n_rows);
  }
  for (int64_t t = 0; t < T; ++t) {  // every row an id can read lies in `rows`
    const int64_t* m = meta + 5 * t;
    if (m[0] < 0 || m[1] < 0 || m[0] + m[1] > n_rows || m[3] < 0 || m[3] >= n_rows || m[4] < 0 ||
        (m[2] >= 0 && m[2] + m[1] > nkeys)) {
      call.detail({kServeBadMeta, t, m[0], m[1], m[2], m[3]});
      call.fail(HE_BAD_VALUE, "table %lld: rows [%lld, +%lld), keys from %lld, miss row %lld, probes %lld outside "
                "%lld rows, %lld keys", (long long)t, (long long)m[0], (long long)m[1], (long long)m[2],
                (long long)m[3], (long long)m[4], (long long)n_rows, (long long)nkeys);
    }
  }
  for (int64_t f = 0; f < F; ++f)
    if (feature_table[f] < 0 || feature_table[f] >= T || feature_pos[f] < 0 ||
        (B > 0 && feature_pos[f] >= n_offsets / B)) {  // so feature_pos[f] * B + b stays in int64
      call.detail({kServeBadFeature, f, feature_table[f], feature_pos[f]});
      call.fail(HE_BAD_VALUE, "feature %lld: table %lld of %lld, input feature %lld", (long long)f,
                (long long)feature_table[f], (long long)T, (long long)feature_pos[f]);
    }
  int64_t total = 0;  // checked first (feature-major: each feature's offsets in order), starts written after
  for (int64_t f = 0; f < F; ++f)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t in_bag = feature_pos[f] * B + b;
      const bool inside = in_bag + 1 < n_offsets;
      const int64_t i0 = inside ? offsets[in_bag] : -1, i1 = inside ? offsets[in_bag + 1] : -1;
      if (!inside || i0 < 0 || i1 < i0 || i1 > n_values) {
        const int64_t j = b * F + f;
        call.detail({kServeBadOffsets, j, in_bag, i0, i1});
        call.fail(HE_BAD_VALUE, "bag %lld (input bag %lld): offsets [%lld, %lld) outside %lld values (%lld offsets)",
                  (long long)j, (long long)in_bag, (long long)i0, (long long)i1, (long long)n_values,
                  (long long)n_offsets);
      }
      total += i1 - i0;
    }
  if (total > call.numel(8)) {
    call.detail({kServeBadCapacity, total, call.numel(8)});
    call.fail(HE_BAD_VALUE, "the bags read %lld ids, idx holds %lld", (long long)total, (long long)call.numel(8));
  }
  int64_t* idx = call.buf<int64_t>(8, total, "idx");
  total = 0;
  for (int64_t b = 0, j = 0; b < B; ++b)
    for (int64_t f = 0; f < F; ++f, ++j) {
      const int64_t in_bag = feature_pos[f] * B + b;
      starts[j] = total;
      total += offsets[in_bag + 1] - offsets[in_bag];
    }
  run_bags(values, offsets, B, F, feature_pos, feature_table, keys, nkeys, index, index_bytes, cap, meta, n_rows - 1,
           starts, idx, kept, call.nthreads());
  return total;
}

// The position in `keys` of each (id, table): out[i], or -1 (static tables and tables outside
// [0, T): -1).
//   bufs: ids int64 [n], table int64 [n], keys int64 [nkeys], index int32 or int64 [cap] (a power
//         of two), meta int64 [T * 5], out int64 [n]
//   ints: T
// Returns 0.  Fails with HE_BAD_VALUE, writing nothing, when the index capacity is not a power of
// two (detail = (kServeBadIndex, capacity)); then the caller takes its torch path.
HE_KERNEL(he_serve_find) {
  call.expect(6, 1, 0);
  const int64_t T = call.i(0);
  if (T < 0 || T > INT64_MAX / 5) call.fail(HE_BAD_CALL, "T %lld: need T >= 0", (long long)T);
  const int64_t n = call.numel(0), nkeys = call.numel(2);
  const int64_t* ids = call.buf<const int64_t>(0, n, "ids");
  const int64_t* table = call.buf<const int64_t>(1, n, "table");
  const int64_t* keys = call.buf<const int64_t>(2, nkeys, "keys");
  const int64_t* meta = call.buf<const int64_t>(4, 5 * T, "meta");
  int64_t* out = call.buf<int64_t>(5, n, "out");
  const void* index = nullptr;
  int64_t cap = 0;
  if (index_of(call, 3, &index, &cap) == 4)
    find(ids, table, n, keys, nkeys, static_cast<const int32_t*>(index), cap, meta, T, out, call.nthreads());
  else
    find(ids, table, n, keys, nkeys, static_cast<const int64_t*>(index), cap, meta, T, out, call.nthreads());
  return 0;
}
