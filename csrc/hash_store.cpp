// Native CPU kernels of the dynamic hash store: an open-addressing key -> code map
// with linear probing (layout in store_table.h), find-or-insert with admission,
// backward-shift deletion and rehash.  Called by hugeembed/store/_native_store.py.
//
// Find-or-insert runs in four phases so that nothing is written before every
// check has passed (a CapacityError or a duplicate key leaves the store as it was):
//   A (2 threads)  probe every key; software prefetch DIST keys ahead hides the
//                  DRAM latency of the random bucket reads;
//   B (1 thread)   count what the batch needs (new buckets, rows, pending ids),
//                  check capacity and that no new key is given twice;
//   C (2 threads)  add counts / set last step of the keys found (distinct rows,
//                  so no two threads touch the same row);
//   D (1 thread)   insert the new keys and promote pending keys, in batch order,
//                  so row slots are handed out in an order both backends share.
#include <sys/mman.h>

#include "common.h"
#include "store_table.h"

namespace {

using he::HsTable;
using he::kAbsent;
using he::kEmpty;

constexpr int64_t kDist = 16;  // prefetch distance in keys (measured: 8..32 within noise)

inline uint64_t home(int64_t key, uint64_t mask) { return he::mix64((uint64_t)key) & mask; }

// Probes keys[b, e): codes[i] = bucket code, kAbsent if absent; pos[i] = bucket
// where the key is, or the first empty bucket of its probe sequence (-1 for kEmpty).
void probe_range(const HsTable& t, const int64_t* keys, int64_t b, int64_t e, int64_t* codes, int64_t* pos) {
  const uint64_t mask = (uint64_t)t.nbuckets - 1;
  const int64_t* bk = t.bkeys;
  const int32_t* bc = t.bcodes;
  uint64_t ring[kDist];
  for (int64_t j = b; j < std::min(e, b + kDist); ++j) {
    uint64_t h = home(keys[j], mask);
    ring[j % kDist] = h;
    __builtin_prefetch(bk + h);
  }
  for (int64_t i = b; i < e; ++i) {
    uint64_t p = ring[i % kDist];
    int64_t j = i + kDist;
    if (j < e) {
      uint64_t h = home(keys[j], mask);
      ring[j % kDist] = h;
      __builtin_prefetch(bk + h);
      __builtin_prefetch(bc + h);
    }
    int64_t key = keys[i];
    if (key == kEmpty) {
      codes[i] = t.st[he::kSideUsed] ? t.st[he::kSideCode] : kAbsent;
      if (pos) pos[i] = -1;
      continue;
    }
    int64_t code = kAbsent;
    while (true) {
      int64_t k = bk[p];
      if (k == key) {
        code = bc[p];
        break;
      }
      if (k == kEmpty) break;
      p = (p + 1) & mask;
    }
    codes[i] = code;
    if (pos) pos[i] = (int64_t)p;
  }
}

// Puts key at the first empty bucket from `p` on (the key is known absent).
inline void place(HsTable& t, int64_t key, int32_t code, uint64_t p) {
  const uint64_t mask = (uint64_t)t.nbuckets - 1;
  while (t.bkeys[p] != kEmpty) p = (p + 1) & mask;
  t.bkeys[p] = key;
  t.bcodes[p] = code;
  t.st[he::kEntries] += 1;
}

inline int32_t alloc_row(HsTable& t) {
  int64_t* st = t.st;
  if (st[he::kNumFree] > 0) return t.free_rows[--st[he::kNumFree]];
  return (int32_t)st[he::kRowHwm]++;
}

inline int32_t alloc_pending(HsTable& t) {
  int64_t* st = t.st;
  if (st[he::kNumPFree] > 0) return t.free_pend[--st[he::kNumPFree]];
  return (int32_t)st[he::kPendHwm]++;
}

// True (and *dup set) when a key with out[i] < 0 occurs twice among keys[0, n).
// A small open-addressing set private to this call; emptiness is kept in a
// separate flag array so any int64 key works.
bool find_duplicate(const int64_t* keys, const int64_t* out, int64_t n, int64_t todo, int64_t* dup) {
  uint64_t cap = he::next_pow2((uint64_t)std::max<int64_t>(16, 2 * todo));
  std::vector<int64_t> set_keys(cap);
  std::vector<uint8_t> used(cap, 0);
  const uint64_t mask = cap - 1;
  for (int64_t i = 0; i < n; ++i) {
    if (out[i] >= 0) continue;
    uint64_t p = home(keys[i], mask);
    while (used[p] && set_keys[p] != keys[i]) p = (p + 1) & mask;
    if (used[p]) {
      *dup = keys[i];
      return true;
    }
    used[p] = 1;
    set_keys[p] = keys[i];
  }
  return false;
}

}  // namespace

// codes[i] = code of keys[i] (row slot >= 0, pending <= -2, absent -1).
HE_API int64_t he_hs_find(const HsTable* t, const int64_t* keys, int64_t n, int64_t* codes, int64_t nthreads) {
  he::parallel_for(n, (int)nthreads, 4096,
                   [&](int64_t b, int64_t e, int) { probe_range(*t, keys, b, e, codes, nullptr); });
  return 0;
}

// Find-or-insert with admission (see the file comment for the phases).
//   counts     hits per key in this batch (nullptr: 1 each)
//   admit_k    a key gets a row once its accumulated count reaches admit_k
//   row_limit  at most this many live rows after the call (capacity)
//   out        [n] row slot, or -1 for a key not admitted yet
//   pos        [n] scratch
//   new_slots, new_keys  [n]: rows created by this call (to be initialised)
//   need       [4]: new bucket entries, new rows, new pending keys, rows created
// Returns 0 ok; 2 the rows needed exceed row_limit (need[1] says how many, out
// holds the probe codes, nothing written); 3 a key that is not a live row is
// given twice (need[0] = the key, nothing written); 1 the Python side did not
// reserve enough room (a bug; nothing written).
HE_API int64_t he_hs_find_or_insert(HsTable* t, const int64_t* keys, const int64_t* counts, int64_t n, int64_t step,
                                    int64_t admit_k, int64_t row_limit, int64_t max_entries, int64_t* out, int64_t* pos,
                                    int64_t* new_slots, int64_t* new_keys, int64_t* need, int64_t nthreads) {
  int64_t* st = t->st;
  // A: probe.
  he::parallel_for(n, (int)nthreads, 4096, [&](int64_t b, int64_t e, int) { probe_range(*t, keys, b, e, out, pos); });

  // B: what the batch needs.
  int64_t new_entries = 0, new_rows = 0, new_pend = 0, todo = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t code = out[i];
    if (code >= 0) continue;
    ++todo;
    int64_t c = counts ? counts[i] : 1;
    if (code == kAbsent) {
      if (keys[i] != kEmpty) ++new_entries;
      if (c >= admit_k) ++new_rows; else ++new_pend;
    } else if (t->pmeta[2 * (-2 - code)] + c >= admit_k) {
      ++new_rows;
    }
  }
  need[0] = new_entries;
  need[1] = new_rows;
  need[2] = new_pend;
  need[3] = 0;
  if (todo > 1) {  // a key to insert or promote must not come twice
    int64_t dup;
    if (find_duplicate(keys, out, n, todo, &dup)) {
      need[0] = dup;
      return 3;
    }
  }
  if (st[he::kRows] + new_rows > row_limit) return 2;
  int64_t fresh_rows = std::max<int64_t>(0, new_rows - st[he::kNumFree]);
  int64_t fresh_pend = std::max<int64_t>(0, new_pend - st[he::kNumPFree]);
  if (st[he::kEntries] + new_entries > max_entries || st[he::kRowHwm] + fresh_rows > t->r_cap ||
      st[he::kPendHwm] + fresh_pend > t->p_cap || t->free_pend_cap < t->p_cap)
    return 1;

  // C: count the hits.
  he::parallel_for(n, (int)nthreads, 4096, [&](int64_t b, int64_t e, int) {
    int64_t* meta = t->meta;
    int64_t* pmeta = t->pmeta;
    for (int64_t i = b; i < e; ++i) {
      int64_t j = i + kDist;
      if (j < e && out[j] >= 0) __builtin_prefetch(meta + 2 * out[j], 1);
      int64_t code = out[i];
      int64_t c = counts ? counts[i] : 1;
      if (code >= 0) {
        meta[2 * code] += c;
        meta[2 * code + 1] = step;
      } else if (code != kAbsent) {
        int64_t p = -2 - code;
        pmeta[2 * p] += c;
        pmeta[2 * p + 1] = step;
      }
    }
  });

  // D: insert and promote in batch order.
  int64_t made = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t code = out[i];
    if (code >= 0) continue;
    int64_t key = keys[i];
    if (code == kAbsent) {
      int64_t c = counts ? counts[i] : 1;
      int32_t newcode;
      if (c >= admit_k) {
        int32_t s = alloc_row(*t);
        t->meta[2 * s] = c;
        t->meta[2 * s + 1] = step;
        st[he::kRows] += 1;
        new_slots[made] = s;
        new_keys[made++] = key;
        out[i] = s;
        newcode = s;
      } else {
        int32_t p = alloc_pending(*t);
        t->pmeta[2 * p] = c;
        t->pmeta[2 * p + 1] = step;
        st[he::kPending] += 1;
        out[i] = kAbsent;
        newcode = -2 - p;
      }
      if (key == kEmpty) {
        st[he::kSideUsed] = 1;
        st[he::kSideCode] = newcode;
      } else {
        place(*t, key, newcode, (uint64_t)pos[i]);
      }
    } else {
      int64_t p = -2 - code;
      if (t->pmeta[2 * p] >= admit_k) {
        int32_t s = alloc_row(*t);
        t->meta[2 * s] = t->pmeta[2 * p];
        t->meta[2 * s + 1] = t->pmeta[2 * p + 1];
        t->free_pend[st[he::kNumPFree]++] = (int32_t)p;
        st[he::kRows] += 1;
        st[he::kPending] -= 1;
        if (key == kEmpty) st[he::kSideCode] = s; else t->bcodes[pos[i]] = s;
        new_slots[made] = s;
        new_keys[made++] = key;
        out[i] = s;
      } else {
        out[i] = kAbsent;
      }
    }
  }
  need[3] = made;
  return 0;
}

// Inserts keys with given codes (import, rebuild).  A key already present gets its
// code overwritten.  Returns how many keys were already present.
HE_API int64_t he_hs_insert(HsTable* t, const int64_t* keys, const int32_t* codes, int64_t n) {
  const uint64_t mask = (uint64_t)t->nbuckets - 1;
  int64_t present = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t key = keys[i];
    if (key == kEmpty) {
      present += t->st[he::kSideUsed];
      t->st[he::kSideUsed] = 1;
      t->st[he::kSideCode] = codes[i];
      continue;
    }
    uint64_t p = home(key, mask);
    while (t->bkeys[p] != kEmpty && t->bkeys[p] != key) p = (p + 1) & mask;
    if (t->bkeys[p] == key) {
      ++present;
      t->bcodes[p] = codes[i];
    } else {
      t->bkeys[p] = key;
      t->bcodes[p] = codes[i];
      t->st[he::kEntries] += 1;
    }
  }
  return present;
}

// Removes keys from the index by backward-shift deletion (no tombstones: probe
// sequences stay as short as if the key had never been inserted).  Row and
// pending bookkeeping is the caller's.  Returns how many keys were not present.
HE_API int64_t he_hs_erase(HsTable* t, const int64_t* keys, int64_t n) {
  const uint64_t mask = (uint64_t)t->nbuckets - 1;
  int64_t* bk = t->bkeys;
  int32_t* bc = t->bcodes;
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t key = keys[i];
    if (key == kEmpty) {
      if (t->st[he::kSideUsed]) t->st[he::kSideUsed] = 0; else ++missing;
      continue;
    }
    uint64_t p = home(key, mask);
    while (bk[p] != kEmpty && bk[p] != key) p = (p + 1) & mask;
    if (bk[p] != key) {
      ++missing;
      continue;
    }
    // Knuth's algorithm R: move later entries of the cluster back into the hole
    // when the hole lies between their home and where they sit.
    uint64_t hole = p, j = p;
    while (true) {
      j = (j + 1) & mask;
      int64_t k = bk[j];
      if (k == kEmpty) break;
      uint64_t h = home(k, mask);
      if (((j - h) & mask) >= ((j - hole) & mask)) {
        bk[hole] = k;
        bc[hole] = bc[j];
        hole = j;
      }
    }
    bk[hole] = kEmpty;
    bc[hole] = -1;
    t->st[he::kEntries] -= 1;
  }
  return missing;
}

// Re-inserts every entry of the old bucket arrays into new ones of `nn` buckets
// (filled here).  Each thread owns a contiguous range of the new table and
// inserts the keys whose home lies in it; a probe that would leave its range is
// deferred and finished single-threaded afterwards, so threads never write the
// same bucket.  Returns the number of entries moved.
HE_API int64_t he_hs_rehash(const int64_t* okeys, const int32_t* ocodes, int64_t on, int64_t* nkeys, int32_t* ncodes,
                            int64_t nn, int64_t nthreads) {
  he::parallel_for(nn, (int)nthreads, 1 << 16, [&](int64_t b, int64_t e, int) {
    std::fill(nkeys + b, nkeys + e, kEmpty);
    std::fill(ncodes + b, ncodes + e, -1);
  });
  const uint64_t mask = (uint64_t)nn - 1;
  int regions = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, nn / 1024));
  std::vector<std::vector<int64_t>> deferred(regions);
  std::vector<int64_t> moved(regions, 0);
  he::parallel_items(regions, regions, [&](int64_t r, int) {
    const uint64_t lo = (uint64_t)(nn / regions * r), hi = (r == regions - 1) ? (uint64_t)nn : lo + nn / regions;
    for (int64_t i = 0; i < on; ++i) {
      if (i + kDist < on && okeys[i + kDist] != kEmpty) {
        uint64_t hp = home(okeys[i + kDist], mask);
        if (hp >= lo && hp < hi) __builtin_prefetch(nkeys + hp, 1);
      }
      int64_t key = okeys[i];
      if (key == kEmpty) continue;
      uint64_t p = home(key, mask);
      if (p < lo || p >= hi) continue;
      while (nkeys[p] != kEmpty) {
        if (++p == hi) break;
      }
      if (p == hi) {
        deferred[r].push_back(i);
        continue;
      }
      nkeys[p] = key;
      ncodes[p] = ocodes[i];
      ++moved[r];
    }
  });
  int64_t total = 0;
  for (int r = 0; r < regions; ++r) {
    total += moved[r];
    for (int64_t i : deferred[r]) {
      uint64_t p = home(okeys[i], mask);
      while (nkeys[p] != kEmpty) p = (p + 1) & mask;
      nkeys[p] = okeys[i];
      ncodes[p] = ocodes[i];
      ++total;
    }
  }
  return total;
}

// madvise(MADV_HUGEPAGE) on the 2 MiB-aligned interior of [ptr, ptr + len).
// Returns 0 on success, errno-style -1 when the kernel refused (no THP).
HE_API int64_t he_madvise_hugepage(void* ptr, int64_t len) {
  const uintptr_t huge = 2u << 20;
  uintptr_t b = ((uintptr_t)ptr + huge - 1) & ~(huge - 1);
  uintptr_t e = ((uintptr_t)ptr + (uintptr_t)len) & ~(huge - 1);
  if (e <= b) return 0;
#ifdef MADV_HUGEPAGE
  return madvise((void*)b, e - b, MADV_HUGEPAGE) == 0 ? 0 : -1;
#else
  return -1;
#endif
}
