// Native CPU kernels of the dynamic hash store: an open-addressing key -> code map
// with linear probing (layout in store_table.h), find-or-insert with admission,
// backward-shift deletion and rehash.  Called by hugeembed/store/_native_store.py.
//
// Find-or-insert runs in phases; a call that fails (capacity, duplicate key,
// arrays to grow) leaves the store exactly as it was:
//   A (threads)  probe every key and count the hits of the keys found, in a
//                software pipeline that prefetches bucket records and metadata
//                rows kDist keys ahead (hiding the DRAM latency of random reads);
//                keys are unique, so no two threads touch the same row.  Each
//                thread also lists its keys to insert or promote;
//   B (serial)   sum what the batch needs (new buckets, rows, pending ids), check
//                capacity and that no key to insert comes twice; on failure undo
//                phase A (the old last steps were saved) and return;
//   C (serial)   hand out row slots / pending ids in batch order (both backends
//                share this order, so slots are reproducible), promote pending keys;
//   D (threads)  place the new keys: each thread owns a contiguous bucket range
//                and places the keys whose probe starts there; a probe that would
//                leave the range is deferred and finished serially.
#include "common.h"
#include "store_table.h"

namespace {

using he::bcode;
using he::bkey;
using he::bprefetch;
using he::bset;
using he::HsTable;
using he::kAbsent;
using he::kEmpty;

constexpr int64_t kDist = 16;  // prefetch distance in keys (8..64 measured within noise)

inline uint64_t home(int64_t key, uint64_t mask) { return he::mix64((uint64_t)key) & mask; }

struct Needs {
  int64_t entries = 0, rows = 0, pending = 0;
  std::vector<int64_t> todo;  // keys to insert or promote, in batch order
};

// Probes keys[b, e): codes[i] = bucket code, kAbsent if absent; pos[i] = bucket
// where the key is, or the first empty bucket of its probe sequence (-1 for kEmpty).
// With kApply, also adds counts[i] (1 if null) to the hit count and sets the last
// step of every key found (row or pending), saving the old last step in saved[i]
// for undo_hits(), and fills `needs`.  Three pipeline stages per iteration: key
// i + kDist is hashed and its bucket prefetched, key i is probed (and its metadata
// row prefetched), key i - kDist gets its metadata written.
template <bool kApply>
void probe_range(const HsTable& t, const int64_t* keys, const int64_t* counts, int64_t step, int64_t admit_k,
                 int64_t b, int64_t e, int64_t* codes, int64_t* pos, int64_t* saved, Needs* needs) {
  const uint64_t mask = (uint64_t)t.nbuckets - 1;
  const int32_t* bk = t.buckets;
  int64_t* meta = t.meta;
  int64_t* pmeta = t.pmeta;
  uint64_t ring[kDist];
  for (int64_t j = b; j < std::min(e, b + kDist); ++j) {
    uint64_t h = home(keys[j], mask);
    ring[j % kDist] = h;
    bprefetch(bk, h);
  }
  for (int64_t i = b; i < e + kDist; ++i) {
    if (i < e) {
      uint64_t p = ring[i % kDist];
      int64_t j = i + kDist;
      if (j < e) {
        uint64_t h = home(keys[j], mask);
        ring[j % kDist] = h;
        bprefetch(bk, h);
      }
      int64_t key = keys[i];
      int64_t code = kAbsent;
      if (key == kEmpty) {
        if (t.st[he::kSideUsed]) code = t.st[he::kSideCode];
        if (pos) pos[i] = -1;
      } else {
        while (true) {
          int64_t k = bkey(bk, p);
          if (k == key) {
            code = bcode(bk, p);
            break;
          }
          if (k == kEmpty) break;
          p = (p + 1) & mask;
        }
        if (pos) pos[i] = (int64_t)p;
      }
      codes[i] = code;
      if (kApply) {
        if (code >= 0) {
          __builtin_prefetch(meta + 2 * code, 1);
        } else {
          needs->todo.push_back(i);
          if (code == kAbsent) {
            needs->entries += key != kEmpty;
            if ((counts ? counts[i] : 1) >= admit_k) ++needs->rows; else ++needs->pending;
          }
        }
      }
    }
    int64_t k = i - kDist;
    if (kApply && k >= b) {
      int64_t code = codes[k];
      if (code == kAbsent) continue;
      int64_t* m = code >= 0 ? meta + 2 * code : pmeta + 2 * (-2 - code);
      saved[k] = m[1];
      m[0] += counts ? counts[k] : 1;
      m[1] = step;
      if (code < 0 && m[0] >= admit_k) ++needs->rows;  // a pending key reaching admission
    }
  }
}

// Reverts what probe_range<true> did to the keys found (a failed call changes nothing).
void undo_hits(const HsTable& t, const int64_t* counts, int64_t n, const int64_t* codes, const int64_t* saved) {
  for (int64_t i = n - 1; i >= 0; --i) {  // backwards: right even if a key came twice
    int64_t code = codes[i];
    if (code == kAbsent) continue;
    int64_t* m = code >= 0 ? t.meta + 2 * code : t.pmeta + 2 * (-2 - code);
    m[0] -= counts ? counts[i] : 1;
    m[1] = saved[i];
  }
}

// True (and *dup set) when a key listed in `todo` occurs twice.  A small
// open-addressing set; emptiness is a separate flag so any int64 key works.
bool find_duplicate(const int64_t* keys, const std::vector<int64_t>& todo, int64_t* dup) {
  uint64_t cap = he::next_pow2((uint64_t)std::max<int64_t>(16, 2 * (int64_t)todo.size()));
  std::vector<int64_t> set_keys(cap);
  std::vector<uint8_t> used(cap, 0);
  const uint64_t mask = cap - 1;
  for (int64_t i : todo) {
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

// Places n records (keys known absent and unique) at the first empty bucket from
// their start bucket on.  src(i, key, code, start) fills record i and returns
// false for a record to skip.  Threads own contiguous bucket ranges (see the file
// comment); each scans every record and places those that start in its range.
template <class Src>
int64_t place_all(HsTable& t, int64_t n, Src&& src, int64_t nthreads) {
  if (n == 0) return 0;
  const uint64_t nb = (uint64_t)t.nbuckets, mask = nb - 1;
  int32_t* bk = t.buckets;
  int regions = (int)std::max<int64_t>(1, std::min<int64_t>({nthreads, (int64_t)nb / 1024, n / 2048 + 1}));
  std::vector<std::vector<int64_t>> deferred(regions);
  std::vector<int64_t> placed(regions, 0);
  he::parallel_items(regions, regions, [&](int64_t r, int) {
    const uint64_t lo = nb / regions * r, hi = (r == regions - 1) ? nb : lo + nb / regions;
    int64_t key;
    int32_t code;
    uint64_t p;
    for (int64_t i = 0; i < n; ++i) {
      if (i + kDist < n && src(i + kDist, key, code, p) && p >= lo && p < hi) bprefetch(bk, p, 1);
      if (!src(i, key, code, p) || p < lo || p >= hi) continue;
      while (p < hi && bkey(bk, p) != kEmpty) ++p;
      if (p == hi) {
        deferred[r].push_back(i);
        continue;
      }
      bset(bk, p, key, code);
      ++placed[r];
    }
  });
  int64_t total = 0;
  for (int r = 0; r < regions; ++r) {
    total += placed[r];
    for (int64_t i : deferred[r]) {
      int64_t key;
      int32_t code;
      uint64_t p;
      src(i, key, code, p);
      while (bkey(bk, p) != kEmpty) p = (p + 1) & mask;
      bset(bk, p, key, code);
      ++total;
    }
  }
  t.st[he::kEntries] += total;
  return total;
}

}  // namespace

// codes[i] = code of keys[i] (row slot >= 0, pending <= -2, absent -1).
HE_API int64_t he_hs_find(const HsTable* t, const int64_t* keys, int64_t n, int64_t* codes, int64_t nthreads) {
  he::parallel_for(n, (int)nthreads, 4096, [&](int64_t b, int64_t e, int) {
    probe_range<false>(*t, keys, nullptr, 0, 0, b, e, codes, nullptr, nullptr, nullptr);
  });
  return 0;
}

// Find-or-insert with admission (see the file comment for the phases).
//   counts     hits per key in this batch (nullptr: 1 each)
//   admit_k    a key gets a row once its accumulated count reaches admit_k
//   row_limit  at most this many live rows after the call (capacity)
//   max_entries  most keys the buckets may hold (load factor limit)
//   out        [n] row slot, or -1 for a key not admitted yet
//   pos, saved, place_keys, place_start  [n] scratch; place_codes int32 [n] scratch
//   new_slots, new_keys  [n]: rows created by this call (to be initialised)
//   need       [4]: new bucket entries, new rows, new pending keys, rows created
// Returns 0 ok; 1 the arrays must grow first (need[0..2] say by how much);
// 2 the rows needed exceed row_limit (need[1] says how many, out holds the probe
// codes); 3 a key that is not a live row is given twice (need[0] = the key).
// On a non-zero return the store is exactly as before the call.
HE_API int64_t he_hs_find_or_insert(HsTable* t, const int64_t* keys, const int64_t* counts, int64_t n, int64_t step,
                                    int64_t admit_k, int64_t row_limit, int64_t max_entries, int64_t* out, int64_t* pos,
                                    int64_t* saved, int64_t* place_keys, int64_t* place_start, int32_t* place_codes,
                                    int64_t* new_slots, int64_t* new_keys, int64_t* need, int64_t nthreads) {
  int64_t* st = t->st;
  // A
  std::vector<Needs> parts(std::max<int64_t>(1, nthreads));
  he::parallel_for(n, (int)nthreads, 4096, [&](int64_t b, int64_t e, int tid) {
    probe_range<true>(*t, keys, counts, step, admit_k, b, e, out, pos, saved, &parts[tid]);
  });
  // B
  Needs all;
  for (auto& p : parts) {
    all.entries += p.entries;
    all.rows += p.rows;
    all.pending += p.pending;
    all.todo.insert(all.todo.end(), p.todo.begin(), p.todo.end());
  }
  need[0] = all.entries;
  need[1] = all.rows;
  need[2] = all.pending;
  need[3] = 0;
  int64_t rc = 0, dup = 0;
  if (all.todo.size() > 1 && find_duplicate(keys, all.todo, &dup)) {
    need[0] = dup;
    rc = 3;
  } else if (st[he::kRows] + all.rows > row_limit) {
    rc = 2;
  } else if (st[he::kEntries] + all.entries > max_entries ||
             st[he::kRowHwm] + std::max<int64_t>(0, all.rows - st[he::kNumFree]) > t->r_cap ||
             st[he::kPendHwm] + std::max<int64_t>(0, all.pending - st[he::kNumPFree]) > t->p_cap ||
             t->free_pend_cap < t->p_cap) {
    rc = 1;
  }
  if (rc) {
    undo_hits(*t, counts, n, out, saved);
    return rc;
  }
  // C
  int64_t made = 0, placed = 0;
  const size_t m = all.todo.size();
  for (size_t j = 0; j < m; ++j) {
    int64_t i = all.todo[j];
    if (j + kDist < m && out[all.todo[j + kDist]] < kAbsent) bprefetch(t->buckets, pos[all.todo[j + kDist]], 1);
    int64_t code = out[i];
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
        newcode = -2 - p;
      }
      if (key == kEmpty) {
        st[he::kSideUsed] = 1;
        st[he::kSideCode] = newcode;
      } else {
        place_keys[placed] = key;
        place_start[placed] = pos[i];
        place_codes[placed++] = newcode;
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
        if (key == kEmpty) st[he::kSideCode] = s; else t->buckets[3 * pos[i] + 2] = s;
        new_slots[made] = s;
        new_keys[made++] = key;
        out[i] = s;
      }
    }
    if (out[i] < 0) out[i] = kAbsent;
  }
  // D
  const uint64_t mask = (uint64_t)t->nbuckets - 1;
  place_all(*t, placed, [&](int64_t j, int64_t& key, int32_t& code, uint64_t& p) {
    key = place_keys[j];
    code = place_codes[j];
    p = (uint64_t)place_start[j] & mask;
    return true;
  }, nthreads);
  need[3] = made;
  return 0;
}

// Inserts keys known to be absent and unique with given codes (import, rebuild).
HE_API int64_t he_hs_insert(HsTable* t, const int64_t* keys, const int32_t* codes, int64_t n, int64_t nthreads) {
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] == kEmpty) {
      t->st[he::kSideUsed] = 1;
      t->st[he::kSideCode] = codes[i];
    }
  }
  const uint64_t mask = (uint64_t)t->nbuckets - 1;
  place_all(*t, n, [&](int64_t i, int64_t& key, int32_t& code, uint64_t& p) {
    key = keys[i];
    code = codes[i];
    p = home(key, mask);
    return key != kEmpty;
  }, nthreads);
  return 0;
}

// Removes keys from the index by backward-shift deletion (no tombstones: probe
// sequences stay as short as if the key had never been inserted).  Row and
// pending bookkeeping is the caller's.  Returns how many keys were not present.
HE_API int64_t he_hs_erase(HsTable* t, const int64_t* keys, int64_t n) {
  const uint64_t mask = (uint64_t)t->nbuckets - 1;
  int32_t* bk = t->buckets;
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t key = keys[i];
    if (key == kEmpty) {
      if (t->st[he::kSideUsed]) t->st[he::kSideUsed] = 0; else ++missing;
      continue;
    }
    uint64_t p = home(key, mask);
    while (bkey(bk, p) != kEmpty && bkey(bk, p) != key) p = (p + 1) & mask;
    if (bkey(bk, p) != key) {
      ++missing;
      continue;
    }
    // Knuth's algorithm R: move later entries of the cluster back into the hole
    // when the hole lies between their home and where they sit.
    uint64_t hole = p, j = p;
    while (true) {
      j = (j + 1) & mask;
      int64_t k = bkey(bk, j);
      if (k == kEmpty) break;
      uint64_t h = home(k, mask);
      if (((j - h) & mask) >= ((j - hole) & mask)) {
        bset(bk, hole, k, bcode(bk, j));
        hole = j;
      }
    }
    bset(bk, hole, kEmpty, -1);
    t->st[he::kEntries] -= 1;
  }
  return missing;
}

// Re-inserts every entry of the old bucket records (`on` buckets) into `nt`,
// whose buckets array is allocated, not filled.  Returns the entries moved.
HE_API int64_t he_hs_rehash(const int32_t* old, int64_t on, HsTable* nt, int64_t nthreads) {
  int32_t* nb = nt->buckets;
  he::parallel_for(nt->nbuckets, (int)nthreads, 1 << 16, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) bset(nb, i, kEmpty, -1);
  });
  const uint64_t mask = (uint64_t)nt->nbuckets - 1;
  nt->st[he::kEntries] = 0;
  return place_all(*nt, on, [&](int64_t i, int64_t& key, int32_t& code, uint64_t& p) {
    key = bkey(old, i);
    code = bcode(old, i);
    p = home(key, mask);
    return key != kEmpty;
  }, nthreads);
}
