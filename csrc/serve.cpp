// The serving lookup's id -> row pass (hugeembed/serving/_runtime.py::pooled_lookup's torch pass, bit
// for bit), over either key index of csrc/serve_index.h: the artifact's own (he_serve_bags,
// he_serve_find) or hugeembed's private, salted one built at load (he_serve_index_build,
// he_serve_index_bags, he_serve_index_probes).  Static tables (key base -1) read the id as the row.
#include <algorithm>
#include <cstdint>

#include "common.h"
#include "serve_bags.h"
#include "serve_index.h"

namespace {

using he::serve::Bags;
using he::serve::PairIndex;
using he::serve::SlotIndex;
using he::serve::bags_args;
using he::serve::index_of;
using he::serve::run_bags;
using he::serve::with_outputs;

// The position in `keys` of each (id, table), or -1 (static tables and tables outside [0, T): -1).
template <class Slot>
void find(const int64_t* ids, const int64_t* table, int64_t n, const SlotIndex<Slot>& index, const int64_t* meta,
          int64_t T, int64_t* out, int64_t nthreads) {
  he::parallel_for(n, (int)nthreads, 8192, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = table[i];
      const bool dynamic = t >= 0 && t < T && meta[5 * t + 2] >= 0;
      out[i] = dynamic ? index.position(ids[i], t, meta + 5 * t) : -1;
    }
  });
}

}  // namespace

// The whole id -> row pass of hugeembed_serve::pooled_lookup for one dim group: bags pooled
// batch-major (bag j = b * F + f reads input bag feature_pos[f] * B + b), each id's row in
// `rows` written at idx[starts[j] ...] (starts: the bags' exclusive prefix sum of lengths, also
// written here), ids < 0 reading zero_row (n_rows - 1) and not counted, kept[j] the counted ids
// of bag j (the divisor of mean / sqrtn).
//   bufs: values int64 [n_values], offsets int64 [n_offsets], feature_pos int64 [F],
//         feature_table int64 [F], keys int64 [nkeys], index int32 or int64 [cap] (a power of two),
//         meta int64 [T * 5], starts [B * F] (out), idx [the ids read] (out), kept [B * F] (out; or
//         empty: not written), these three all int64 or all int32
//         (int32: fails with kServeBadCapacity when the ids read or n_rows pass 2^31 - 1)
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
  const int64_t nkeys = call.numel(4);
  const int64_t* keys = call.buf<const int64_t>(4, nkeys, "keys");
  const void* slots = nullptr;
  int64_t cap = 0;
  const int64_t index_bytes = index_of(call, 5, &slots, &cap);
  int64_t total = 0;
  with_outputs(call, [&](auto o) {
    using O = decltype(o);
    const Bags<O> a = bags_args<O>(call, nkeys, &total);
    const uint64_t mask = (uint64_t)cap - 1;
    if (index_bytes == 4)
      run_bags(a, SlotIndex<int32_t>{static_cast<const int32_t*>(slots), mask, keys, nkeys}, call.nthreads());
    else
      run_bags(a, SlotIndex<int64_t>{static_cast<const int64_t*>(slots), mask, keys, nkeys}, call.nthreads());
  });
  return total;
}

// he_serve_bags over the private index (he_serve_index_build): the same buffers and results, buffer 5
// the private index (else HE_BAD_VALUE with kServeBadIndex).
HE_KERNEL(he_serve_index_bags) {
  call.expect(10, 3, 0);
  const int64_t nkeys = call.numel(4);
  call.buf<const int64_t>(4, nkeys, "keys");  // checked: the tables' key ranges lie in it (the index holds the keys)
  int64_t total = 0;
  const he::serve::PairIndex index = he::serve::private_index(call, 5);
  with_outputs(call, [&](auto o) {
    using O = decltype(o);
    run_bags(bags_args<O>(call, nkeys, &total), index, call.nthreads());
  });
  return total;
}

// The position in `keys` of each (id, table) through the artifact's slot index: out[i], or -1
// (static tables and tables outside [0, T): -1).
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
    find(ids, table, n, SlotIndex<int32_t>{static_cast<const int32_t*>(index), (uint64_t)cap - 1, keys, nkeys}, meta,
         T, out, call.nthreads());
  else
    find(ids, table, n, SlotIndex<int64_t>{static_cast<const int64_t*>(index), (uint64_t)cap - 1, keys, nkeys}, meta,
         T, out, call.nthreads());
  return 0;
}
