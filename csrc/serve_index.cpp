// hugeembed's private key index of a served dim group (csrc/serve_index.h): built at load with a random
// salt (he_serve_index_build, from hugeembed/serving/_index.py), and probed id by id with the slots each
// probe reads counted (he_serve_index_probes: tests and benchmarks).  The lookups read it through
// he_serve_index_bags (serve.cpp).
#include <algorithm>
#include <cstdint>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common.h"
#include "serve_index.h"


// The result of he_serve_index_build when a chain is longer than the cap: the caller draws another
// salt, or grows the index.
enum : int64_t { kIndexChainTooLong = -1 };

namespace {

// Asks for 2 MiB pages under [p, p + bytes) before its first write: the slots are read at random over
// gigabytes, and on 4 KiB pages nearly every probe also misses the TLB (bench/serve.py at full size: the
// lookups ran ~2x faster on 2 MiB pages).  THP in "madvise" mode backs only memory advised before it is
// touched; a refusal costs only speed.
void advise_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t huge = (uintptr_t)2 << 20, lo = ((uintptr_t)p + huge - 1) & ~(huge - 1);
  const uintptr_t hi = ((uintptr_t)p + (uintptr_t)bytes) & ~(huge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

int64_t build_private(const he::Call& call, const int64_t* keys, const int64_t* meta, int64_t T, int64_t* w,
                      int64_t log2cap, uint64_t salt, int64_t probe_cap) {
  const int64_t cap = (int64_t)1 << log2cap;
  int64_t* slots = w + he::serve::kHeader;
  advise_huge_pages(slots, 16 * cap);
  for (int64_t h = 0; h < cap; ++h) slots[2 * h] = 0, slots[2 * h + 1] = -1;
  const he::serve::PairIndex view{slots, (uint64_t)cap - 1, salt, 0};
  int64_t longest = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* m = meta + 5 * t;
    if (m[2] < 0) continue;
    for (int64_t s = m[2]; s < m[2] + m[1]; ++s) {  // keys in order: the same salt gives the same slots
      uint64_t h = view.home(keys[s], t);
      for (int64_t r = 1;; ++r) {
        if (r > probe_cap) return kIndexChainTooLong;
        int64_t* e = slots + 2 * h;
        if (e[1] < 0) {
          e[0] = keys[s], e[1] = s;
          longest = std::max(longest, r);
          break;
        }
        if (e[1] >= m[2] && e[1] < s && e[0] == keys[s]) {
          call.detail({kServeBadIndex, t, keys[s]});
          call.fail(HE_BAD_VALUE, "table %lld holds key %lld twice", (long long)t, (long long)keys[s]);
        }
        h = (h + 1) & (uint64_t)(cap - 1);
      }
    }
  }
  const int64_t header[he::serve::kHeader] = {he::serve::kIndexMagic, log2cap, longest, (int64_t)(salt & 0xFFFF),
                                              (int64_t)((salt >> 16) & 0xFFFF), (int64_t)((salt >> 32) & 0xFFFF),
                                              (int64_t)(salt >> 48), 0};
  for (int64_t q = 0; q < he::serve::kHeader; ++q) w[q] = header[q];
  return longest;
}

}  // namespace

// Builds the private index of a dim group (see serve_index.h) over its dynamic tables' keys: table t
// (meta row t: ROW_BASE, NUM, KEY_BASE, ...) holds keys[KEY_BASE + i] at row ROW_BASE + i.
//   bufs: keys int64 [nkeys], meta int64 [T * 5], index int64 [8 + 2 * 2^log2cap] (out)
//   ints: log2cap (>= 1), salt (any 64 bits), probe_cap (the longest chain allowed, in slots)
// Returns the longest chain (slots a present key needs), or kIndexChainTooLong (the index is then
// scratch).  Fails with HE_BAD_VALUE: detail (kServeBadMeta, t, ...) for a key range outside `keys`,
// (kServeBadCapacity, keys, slots) when the keys fill more than half the slots, (kServeBadIndex, t,
// key) for a key given twice in one table.
HE_KERNEL(he_serve_index_build) {
  call.expect(3, 3, 0);
  const int64_t log2cap = call.i(0), salt = call.i(1), probe_cap = call.i(2);
  const int64_t nkeys = call.numel(0), T = call.numel(1) / 5;
  if (log2cap < 1 || log2cap > 60 || probe_cap < 1 || call.numel(1) != 5 * T)
    call.fail(HE_BAD_CALL, "log2 capacity %lld, probe cap %lld, meta of %lld", (long long)log2cap,
              (long long)probe_cap, (long long)call.numel(1));
  const int64_t cap = (int64_t)1 << log2cap;
  const int64_t* keys = call.buf<const int64_t>(0, nkeys, "keys");
  const int64_t* meta = call.buf<const int64_t>(1, 5 * T, "meta");
  int64_t total = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* m = meta + 5 * t;
    if (m[2] < 0) continue;
    if (m[1] < 0 || m[2] + m[1] > nkeys) {
      call.detail({kServeBadMeta, t, m[0], m[1], m[2], m[3]});
      call.fail(HE_BAD_VALUE, "table %lld: keys [%lld, +%lld) outside %lld keys", (long long)t, (long long)m[2],
                (long long)m[1], (long long)nkeys);
    }
    total += m[1];
  }
  if (2 * total > cap) {
    call.detail({kServeBadCapacity, total, cap});
    call.fail(HE_BAD_VALUE, "%lld keys fill more than half of %lld slots", (long long)total, (long long)cap);
  }
  return build_private(call, keys, meta, T, call.buf<int64_t>(2, he::serve::kHeader + 2 * cap, "index"), log2cap,
                       (uint64_t)salt, probe_cap);
}

// Each (id, table) through the private index: its position in `keys` (or -1: absent, or a static
// table or a table outside [0, T)) and the slots its probe read (0 for those not probed).
//   bufs: ids int64 [n], table int64 [n], keys int64 [nkeys], index (he_serve_index_build),
//         meta int64 [T * 5], positions int64 [n] (out), probes int64 [n] (out)
// Returns the probes of all ids.  Fails with HE_BAD_VALUE (kServeBadIndex, length) for an index of
// another kind.
HE_KERNEL(he_serve_index_probes) {
  call.expect(7, 0, 0);
  const int64_t n = call.numel(0), nkeys = call.numel(2), T = call.numel(4) / 5;
  const int64_t* ids = call.buf<const int64_t>(0, n, "ids");
  const int64_t* table = call.buf<const int64_t>(1, n, "table");
  call.buf<const int64_t>(2, nkeys, "keys");  // checked: the tables' key ranges lie in it (the index holds the keys)
  const int64_t* meta = call.buf<const int64_t>(4, 5 * T, "meta");
  int64_t* out = call.buf<int64_t>(5, n, "positions");
  int64_t* probes = call.buf<int64_t>(6, n, "probes");
  for (int64_t t = 0; t < T; ++t)
    if (meta[5 * t + 2] >= 0 && (meta[5 * t + 1] < 0 || meta[5 * t + 2] + meta[5 * t + 1] > nkeys)) {
      call.detail({kServeBadMeta, t});
      call.fail(HE_BAD_VALUE, "table %lld: keys outside %lld", (long long)t, (long long)nkeys);
    }
  int64_t total = 0;
  const he::serve::PairIndex index = he::serve::private_index(call, 3);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = table[i];
    out[i] = -1;
    probes[i] = 0;
    if (t >= 0 && t < T && meta[5 * t + 2] >= 0) out[i] = index.position(ids[i], t, meta + 5 * t, probes + i);
    total += probes[i];
  }
  return total;
}

