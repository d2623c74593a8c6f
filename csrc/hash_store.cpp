// Native CPU kernels of the dynamic hash store: an open-addressing key -> code map
// with linear probing (layout in store_table.h), find-or-insert with admission,
// backward-shift deletion and rehash.  Called by hugeembed/store/_native_store.py.
//
// Find-or-insert runs in phases; a call that fails (capacity, duplicate key,
// arrays to grow) leaves the store exactly as it was:
//   A (threads)  probe every key and count the hit of each key found in its
//                bucket record (the line is in cache right after the probe), with
//                bucket records prefetched kDist keys ahead (hiding the DRAM latency
//                of random reads); keys are unique, so no two threads touch the
//                same record.  Each thread also lists its keys to insert or promote;
//   B (serial)   sum what the batch needs (new buckets, rows), check capacity and
//                that no key to insert comes twice; on failure undo phase A (the
//                old record words were saved) and return;
//   C (serial)   hand out row slots in batch order (both backends
//                share this order, so slots are reproducible), promote pending keys;
//   D (threads)  place the new keys: each thread owns a contiguous bucket range
//                and places the keys whose probe starts there; a probe that would
//                leave the range is deferred and finished serially.
#include "common.h"
#include "store_table.h"

namespace {

using he::code_of;
using he::count_of;
using he::HsTable;
using he::kAbsent;
using he::kEmpty;
using he::kPendingCode;
using he::pack;

constexpr int64_t kDist = 16;     // prefetch distance in keys (8..64 measured within noise)
constexpr int64_t kChunk = 8192;  // keys per work item of the probe phase

// Home bucket: the top 32 bits of the hash scaled to [0, nb) by a multiply-shift
// ("fastrange"), so the bucket count need not be a power of two and the load
// factor can be held near its target (nb <= 2^32).
inline uint64_t home(int64_t key, uint64_t nb) { return ((he::mix64((uint64_t)key) >> 32) * nb) >> 32; }
inline uint64_t next(uint64_t p, uint64_t nb) { return p + 1 == nb ? 0 : p + 1; }
// Small power-of-two tables (the duplicate check) keep the mask form.
inline uint64_t home_pow2(int64_t key, uint64_t mask) { return he::mix64((uint64_t)key) & mask; }

inline void prefetch_record(const int64_t* r, uint64_t i) {
  // A 24-byte record may straddle two cache lines: ask for both ends.
  __builtin_prefetch(r + 3 * i, 1);
  __builtin_prefetch(r + 3 * i + 2, 1);
}

// What one chunk of a batch needs.  Cache-line aligned: neighbouring chunks are
// filled by different threads, and shared lines would bounce between cores.
struct alignas(64) Needs {
  int64_t entries = 0, rows = 0, pending = 0;
  std::vector<int64_t> todo;  // keys to insert or promote, in batch order
};

// Probes keys[b, e): codes[i] = code (row >= 0, pending -2, absent -1); pos[i] =
// bucket of the key, or the first empty bucket of its probe sequence (-1 for the
// key kEmpty).  With kApply, also adds counts[i] (1 if null) to the hit count and
// sets the last step of each key found, saving the old record words in
// saved1/saved2 for undo_hits(), and fills `needs`.
template <bool kApply>
void probe_range(const HsTable& t, const int64_t* keys, const int64_t* counts, int64_t step, int64_t admit_k,
                 int64_t b, int64_t e, int64_t* codes, int64_t* pos, int64_t* saved1, int64_t* saved2,
                 Needs* needs) {
  const uint64_t nb = (uint64_t)t.nbuckets;
  int64_t* r = t.buckets;
  Needs local;  // filled here, moved to *needs at the end (no writes to shared lines)
  uint64_t ring[kDist];
  for (int64_t j = b; j < std::min(e, b + kDist); ++j) {
    uint64_t h = home(keys[j], nb);
    ring[j % kDist] = h;
    prefetch_record(r, h);
  }
  for (int64_t i = b; i < e; ++i) {
    uint64_t p = ring[i % kDist];
    int64_t j = i + kDist;
    if (j < e) {
      uint64_t h = home(keys[j], nb);
      ring[j % kDist] = h;
      prefetch_record(r, h);
    }
    const int64_t key = keys[i];
    int64_t* w = nullptr;  // words 1 and 2 of the key's record, if present
    if (key == kEmpty) {
      if (t.st[he::kSideUsed]) w = t.st + he::kSideWord1;
      if (pos) pos[i] = -1;
    } else {
      while (true) {
        int64_t k = r[3 * p];
        if (k == key) {
          w = r + 3 * p + 1;
          break;
        }
        if (k == kEmpty) break;
        p = next(p, nb);
      }
      if (pos) pos[i] = (int64_t)p;
    }
    int64_t code = w ? code_of(w[0]) : kAbsent;
    codes[i] = code;
    if (!kApply) continue;
    const int64_t c = counts ? counts[i] : 1;
    if (w) {
      saved1[i] = w[0];
      saved2[i] = w[1];
      int64_t n = (int64_t)count_of(w[0]) + c;
      w[0] = pack((int32_t)code, n);
      w[1] = step;
      if (code < 0) {
        local.todo.push_back(i);
        if (n >= admit_k) ++local.rows;  // a pending key reaching admission
      }
    } else {
      local.todo.push_back(i);
      local.entries += key != kEmpty;
      if (c >= admit_k) ++local.rows; else ++local.pending;
    }
  }
  if (kApply) *needs = std::move(local);
}

// Reverts what probe_range<true> did to the keys found (a failed call changes nothing).
void undo_hits(const HsTable& t, const int64_t* keys, int64_t n, const int64_t* codes, const int64_t* pos,
               const int64_t* saved1, const int64_t* saved2) {
  for (int64_t i = n - 1; i >= 0; --i) {  // backwards: right even if a key came twice
    if (codes[i] == kAbsent) continue;
    int64_t* w = keys[i] == kEmpty ? t.st + he::kSideWord1 : t.buckets + 3 * pos[i] + 1;
    w[0] = saved1[i];
    w[1] = saved2[i];
  }
}

// True (and *dup set) when a key listed in `todo` occurs twice.  A small
// open-addressing set in caller-provided scratch (`cap` slots for keys, then `cap`
// flags; reused across calls so its pages are not faulted in afresh each batch);
// emptiness is a separate flag so any int64 key works.
bool find_duplicate(const int64_t* keys, const std::vector<int64_t>& todo, int64_t* scratch, int64_t cap,
                    int64_t* dup) {
  uint64_t size = he::next_pow2((uint64_t)std::max<int64_t>(16, 2 * (int64_t)todo.size()));
  if ((int64_t)size > cap) size = (uint64_t)cap;  // cap >= 2n: never fuller than half
  int64_t* set_keys = scratch;
  uint8_t* used = reinterpret_cast<uint8_t*>(scratch + cap);  // byte flags: the set stays L2-sized
  std::memset(used, 0, size);
  const uint64_t mask = size - 1;
  for (int64_t i : todo) {
    uint64_t p = home_pow2(keys[i], mask);
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

// Places n records (keys known absent and unique) at the first empty bucket from
// their start bucket on.  src(i, rec, start) fills the 3 words of record i and
// returns false for a record to skip.  Threads own contiguous bucket ranges (see
// the file comment); each scans every record and places those starting in its range.
template <class Src>
int64_t place_all(HsTable& t, int64_t n, Src&& src, int64_t nthreads) {
  if (n == 0) return 0;
  const uint64_t nb = (uint64_t)t.nbuckets;
  int64_t* r = t.buckets;
  int regions = (int)std::max<int64_t>(1, std::min<int64_t>({nthreads, (int64_t)nb / 1024, n / 2048 + 1}));
  std::vector<std::vector<int64_t>> deferred(regions);
  std::vector<int64_t> placed(regions, 0);
  he::run_items(regions, regions, [&](int64_t reg) {
    const uint64_t lo = nb / regions * reg, hi = (reg == regions - 1) ? nb : lo + nb / regions;
    int64_t rec[3];
    uint64_t p;
    for (int64_t i = 0; i < n; ++i) {
      if (i + kDist < n && src(i + kDist, rec, p) && p >= lo && p < hi) prefetch_record(r, p);
      if (!src(i, rec, p) || p < lo || p >= hi) continue;
      while (p < hi && r[3 * p] != kEmpty) ++p;
      if (p == hi) {
        deferred[reg].push_back(i);
        continue;
      }
      std::memcpy(r + 3 * p, rec, sizeof rec);
      ++placed[reg];
    }
  });
  int64_t total = 0;
  for (int reg = 0; reg < regions; ++reg) {
    total += placed[reg];
    for (int64_t i : deferred[reg]) {
      int64_t rec[3];
      uint64_t p;
      src(i, rec, p);
      while (r[3 * p] != kEmpty) p = next(p, nb);
      std::memcpy(r + 3 * p, rec, sizeof rec);
      ++total;
    }
  }
  t.st[he::kEntries] += total;
  return total;
}

}  // namespace

// codes[i] = code of keys[i] (row slot >= 0, pending -2, absent -1); with
// rows_only, pending keys read -1 too (what HashStore.find returns).
HE_API int64_t he_hs_find(const HsTable* t, const int64_t* keys, int64_t n, int64_t* codes, int64_t rows_only,
                          int64_t nthreads) {
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  he::run_items(nchunks, nthreads, [&](int64_t c) {
    const int64_t b = c * kChunk, e = std::min(n, (c + 1) * kChunk);
    probe_range<false>(*t, keys, nullptr, 0, 0, b, e, codes, nullptr, nullptr, nullptr, nullptr);
    if (rows_only)
      for (int64_t i = b; i < e; ++i) codes[i] = std::max(codes[i], kAbsent);
  });
  return 0;
}

// Find-or-insert with admission (see the file comment for the phases).
//   counts     hits per key in this batch (nullptr: 1 each)
//   admit_k    a key gets a row once its accumulated count reaches admit_k
//   row_limit  at most this many live rows after the call (capacity)
//   max_entries  most keys the buckets may hold (load factor limit)
//   out        [n] row slot, or -1 for a key not admitted yet
//   scratch    [6, n]: probe positions, saved record words (2), keys, packed word 1
//              and start bucket of the records to place
//   set_scratch [2 * set_cap]: the duplicate check's set; set_cap a power of two >= 2n
//   new_slots, new_keys  [n]: rows created by this call (to be initialised)
//   need       [4]: new bucket entries, new rows, new pending keys, rows created
// Returns 0 ok; 1 the arrays must grow first (need[0..2] say by how much);
// 2 the rows needed exceed row_limit (need[1] says how many, out holds the probe
// codes); 3 a key that is not a live row is given twice (need[0] = the key).
// On a non-zero return the store is exactly as before the call.
HE_API int64_t he_hs_find_or_insert(HsTable* t, const int64_t* keys, const int64_t* counts, int64_t n, int64_t step,
                                    int64_t admit_k, int64_t row_limit, int64_t max_entries, int64_t* out,
                                    int64_t* scratch, int64_t* set_scratch, int64_t set_cap, int64_t* new_slots,
                                    int64_t* new_keys, int64_t* need, int64_t nthreads) {
  int64_t* st = t->st;
  int64_t *pos = scratch, *saved1 = scratch + n, *saved2 = scratch + 2 * n;
  int64_t *place_keys = scratch + 3 * n, *place_w1 = scratch + 4 * n, *place_start = scratch + 5 * n;
  // A: chunks handed out dynamically, so a thread that loses its core to another
  // process does not hold the whole call back; needs are kept per chunk so the
  // to-do list stays in batch order.
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<Needs> parts(nchunks);
  he::run_items(nchunks, nthreads, [&](int64_t c) {
    probe_range<true>(*t, keys, counts, step, admit_k, c * kChunk, std::min(n, (c + 1) * kChunk), out, pos, saved1,
                      saved2, &parts[c]);
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
  if (all.todo.size() > 1 && find_duplicate(keys, all.todo, set_scratch, set_cap, &dup)) {
    need[0] = dup;
    rc = 3;
  } else if (st[he::kRows] + all.rows > row_limit) {
    rc = 2;
  } else if (st[he::kEntries] + all.entries > max_entries ||
             st[he::kRowHwm] + std::max<int64_t>(0, all.rows - st[he::kNumFree]) > t->r_cap) {
    rc = 1;
  }
  if (rc) {
    undo_hits(*t, keys, n, out, pos, saved1, saved2);
    return rc;
  }
  // C
  int64_t made = 0, placed = 0;
  for (int64_t i : all.todo) {
    const int64_t key = keys[i];
    if (out[i] == kAbsent) {
      const int64_t c = counts ? counts[i] : 1;
      int32_t code = kPendingCode;
      if (c >= admit_k) {
        code = alloc_row(*t);
        st[he::kRows] += 1;
        new_slots[made] = code;
        new_keys[made++] = key;
        out[i] = code;
      } else {
        st[he::kPending] += 1;
      }
      if (key == kEmpty) {
        st[he::kSideUsed] = 1;
        st[he::kSideWord1] = pack(code, c);
        st[he::kSideLast] = step;
      } else {
        place_keys[placed] = key;
        place_w1[placed] = pack(code, c);
        place_start[placed++] = pos[i];
      }
    } else {  // a pending key: promoted once its count (updated in A) reaches admit_k
      int64_t* w = key == kEmpty ? st + he::kSideWord1 : t->buckets + 3 * pos[i] + 1;
      if (count_of(w[0]) >= admit_k) {
        int32_t s = alloc_row(*t);
        w[0] = pack(s, count_of(w[0]));
        st[he::kRows] += 1;
        st[he::kPending] -= 1;
        new_slots[made] = s;
        new_keys[made++] = key;
        out[i] = s;
      } else {
        out[i] = kAbsent;
      }
    }
  }
  // D
  place_all(*t, placed, [&](int64_t j, int64_t* rec, uint64_t& p) {
    rec[0] = place_keys[j];
    rec[1] = place_w1[j];
    rec[2] = step;
    p = (uint64_t)place_start[j];
    return true;
  }, nthreads);
  need[3] = made;
  return 0;
}

// Inserts keys known to be absent and unique with their code (row slot or -2),
// count and last step (import, rebuild).
HE_API int64_t he_hs_insert(HsTable* t, const int64_t* keys, const int32_t* codes, const int64_t* counts,
                            const int64_t* lasts, int64_t n, int64_t nthreads) {
  for (int64_t i = 0; i < n; ++i) {
    if (keys[i] == kEmpty) {
      t->st[he::kSideUsed] = 1;
      t->st[he::kSideWord1] = pack(codes[i], counts[i]);
      t->st[he::kSideLast] = lasts[i];
    }
  }
  const uint64_t nb = (uint64_t)t->nbuckets;
  place_all(*t, n, [&](int64_t i, int64_t* rec, uint64_t& p) {
    rec[0] = keys[i];
    rec[1] = pack(codes[i], counts[i]);
    rec[2] = lasts[i];
    p = home(keys[i], nb);
    return keys[i] != kEmpty;
  }, nthreads);
  return 0;
}

// Removes keys from the index by backward-shift deletion (no tombstones: probe
// sequences stay as short as if the key had never been inserted).  Row
// bookkeeping is the caller's.  Returns how many keys were not present.
HE_API int64_t he_hs_erase(HsTable* t, const int64_t* keys, int64_t n) {
  const uint64_t nb = (uint64_t)t->nbuckets;
  int64_t* r = t->buckets;
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t key = keys[i];
    if (key == kEmpty) {
      if (t->st[he::kSideUsed]) t->st[he::kSideUsed] = 0; else ++missing;
      continue;
    }
    uint64_t p = home(key, nb);
    while (r[3 * p] != kEmpty && r[3 * p] != key) p = next(p, nb);
    if (r[3 * p] != key) {
      ++missing;
      continue;
    }
    // Knuth's algorithm R: move later records of the cluster back into the hole
    // when the hole lies between their home and where they sit.
    uint64_t hole = p, j = p;
    while (true) {
      j = next(j, nb);
      int64_t k = r[3 * j];
      if (k == kEmpty) break;
      uint64_t h = home(k, nb);
      // cyclic distances: from its home to j, and from the hole to j
      uint64_t dh = j >= h ? j - h : j + nb - h, dhole = j >= hole ? j - hole : j + nb - hole;
      if (dh >= dhole) {
        std::memcpy(r + 3 * hole, r + 3 * j, 3 * sizeof(int64_t));
        hole = j;
      }
    }
    r[3 * hole] = kEmpty;
    r[3 * hole + 1] = pack(-1, 0);
    r[3 * hole + 2] = 0;
    t->st[he::kEntries] -= 1;
  }
  return missing;
}

// Re-inserts every record of the old buckets (`on` of them) into `nt`, whose
// buckets array is allocated, not filled.  Returns the records moved.
HE_API int64_t he_hs_rehash(const int64_t* old, int64_t on, HsTable* nt, int64_t nthreads) {
  int64_t* nr = nt->buckets;
  const int64_t empty_w1 = pack(-1, 0);
  const int64_t fill_chunk = 1 << 16;
  he::run_items((nt->nbuckets + fill_chunk - 1) / fill_chunk, nthreads, [&](int64_t c) {
    for (int64_t i = c * fill_chunk; i < std::min(nt->nbuckets, (c + 1) * fill_chunk); ++i) {
      nr[3 * i] = kEmpty;
      nr[3 * i + 1] = empty_w1;
      nr[3 * i + 2] = 0;
    }
  });
  const uint64_t nb = (uint64_t)nt->nbuckets;
  nt->st[he::kEntries] = 0;
  return place_all(*nt, on, [&](int64_t i, int64_t* rec, uint64_t& p) {
    std::memcpy(rec, old + 3 * i, 3 * sizeof(int64_t));
    p = home(rec[0], nb);
    return rec[0] != kEmpty;
  }, nthreads);
}

HE_API int64_t he_init_rows(int64_t kind, const double* params, int64_t seed, const int64_t* keys, int64_t n,
                            int64_t dim, float* out, int64_t stride, const int64_t* rows, int64_t nthreads);

// Columns of one table's row in he_hs_find_or_insert_many's descriptor (int64 each;
// pointers as addresses, the initializer's parameters as the bits of doubles).
// Must match hugeembed/store/_native_store.py::BATCH_COLUMNS.
enum BatchCol : int {
  bBuckets, bNBuckets, bRCap, bFreeRows, bFreeLen, bSt,            // the table (HsTable + free_rows length)
  bKeys, bCounts, bN, bAdmitK, bRowLimit, bMaxEntries,             // the call
  bOut, bScratch, bSetScratch, bSetCap, bNewSlots, bNewKeys,       // its buffers
  bInitKind, bInitP0, bSeed = bInitP0 + 6, bStorage, bStride, bDim, bStateRow, bStateWidth,  // new rows
  bRc, bNeed, bCols = bNeed + 4,                                   // outputs
};

// Find-or-insert into many tables at once, the tables spread over the threads (one
// table per thread at a time): a collection's per-table batches, each too small to
// split, run side by side instead of one after another, and new rows are
// initialised here too (weights by he_init_rows, then the optimizer state copied
// from a one-row template).  Row d of `desc` ([count, bCols]) describes table d; its
// rc is as he_hs_find_or_insert's, plus 4: the store's arrays are inconsistent, and
// 5: a count below 1.  A table whose rc is not 0 is exactly as before the call (the
// caller grows it, makes room or raises, alone).
HE_API int64_t he_hs_find_or_insert_many(int64_t* desc, int64_t count, int64_t step, int64_t nthreads) {
  he::run_items(count, nthreads, [&](int64_t d) {
    int64_t* b = desc + d * bCols;
    auto p = [&](int c) { return reinterpret_cast<int64_t*>(b[c]); };
    HsTable t{p(bBuckets), b[bNBuckets], b[bRCap], reinterpret_cast<int32_t*>(b[bFreeRows]), p(bSt)};
    const int64_t n = b[bN];
    const int64_t* counts = p(bCounts);
    if (t.nbuckets < 1 || t.st[he::kNumFree] > b[bFreeLen] || t.st[he::kRowHwm] > t.r_cap) {
      b[bRc] = 4;
      return;
    }
    for (int64_t i = 0; counts && i < n; ++i)
      if (counts[i] < 1) {
        b[bRc] = 5;
        return;
      }
    int64_t* need = b + bNeed;
    b[bRc] = he_hs_find_or_insert(&t, p(bKeys), counts, n, step, b[bAdmitK], b[bRowLimit], b[bMaxEntries], p(bOut),
                                  p(bScratch), p(bSetScratch), b[bSetCap], p(bNewSlots), p(bNewKeys), need, 1);
    const int64_t made = b[bRc] == 0 ? need[3] : 0;
    if (made == 0) return;
    double params[6];
    std::memcpy(params, b + bInitP0, sizeof params);
    float* storage = reinterpret_cast<float*>(b[bStorage]);
    const int64_t stride = b[bStride], dim = b[bDim], sw = b[bStateWidth];
    const int64_t* slots = p(bNewSlots);
    he_init_rows(b[bInitKind], params, b[bSeed], p(bNewKeys), made, dim, storage, stride, slots, 1);
    const float* state_row = reinterpret_cast<const float*>(b[bStateRow]);
    if (sw > 0)
      for (int64_t j = 0; j < made; ++j) std::memcpy(storage + slots[j] * stride + dim, state_row, sw * sizeof(float));
  });
  return 0;
}

// Columns of one static table's row in he_array_touch_many's descriptor.
// Must match hugeembed/store/_array.py::TOUCH_COLUMNS.
enum TouchCol : int { tMeta, tRows, tKeys, tCounts, tN, tOut, tRc, tBadPos, tCols };

// The training fetch of many static tables (ArrayStore, key k at slot k) at once: for
// each table, every key checked against [0, rows) and then, only if every key of every
// table is in range, slot = key copied to `out`, meta[slot][0] += count (1 without
// counts) and meta[slot][1] = step.  A table with a bad key or count gets rc 1 / 2 and
// the position in bad_pos; then nothing anywhere is written and the call returns the
// number of such tables (the caller raises with the details, table by table).
HE_API int64_t he_array_touch_many(int64_t* desc, int64_t count, int64_t step, int64_t nthreads) {
  std::atomic<int64_t> bad{0};
  he::run_items(count, nthreads, [&](int64_t d) {
    int64_t* b = desc + d * tCols;
    const int64_t* keys = reinterpret_cast<const int64_t*>(b[tKeys]);
    const int64_t* counts = reinterpret_cast<const int64_t*>(b[tCounts]);
    const int64_t n = b[tN], rows = b[tRows];
    b[tRc] = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (keys[i] < 0 || keys[i] >= rows || (counts && counts[i] < 1)) {
        b[tRc] = (keys[i] < 0 || keys[i] >= rows) ? 1 : 2;
        b[tBadPos] = i;
        bad.fetch_add(1);
        return;
      }
    }
  });
  if (bad.load()) return bad.load();
  he::run_items(count, nthreads, [&](int64_t d) {
    const int64_t* b = desc + d * tCols;
    int64_t* meta = reinterpret_cast<int64_t*>(b[tMeta]);
    const int64_t* keys = reinterpret_cast<const int64_t*>(b[tKeys]);
    const int64_t* counts = reinterpret_cast<const int64_t*>(b[tCounts]);
    int64_t* out = reinterpret_cast<int64_t*>(b[tOut]);
    for (int64_t i = 0, n = b[tN]; i < n; ++i) {
      const int64_t k = keys[i];
      out[i] = k;
      meta[2 * k] += counts ? counts[i] : 1;
      meta[2 * k + 1] = step;
    }
  });
  return 0;
}
