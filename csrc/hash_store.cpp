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

// What a find-or-insert did (the caller grows, makes room or raises, and calls again).
// Must match hugeembed/store/_native_store.py::Outcome.
enum Outcome : int64_t { kDone = 0, kMustGrow = 1, kOverLimit = 2, kDuplicateKey = 3, kBadCount = 4 };

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
static int64_t hs_find(const HsTable* t, const int64_t* keys, int64_t n, int64_t* codes, int64_t rows_only,
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
// Returns an Outcome: kDone; kMustGrow, the arrays must grow first (need[0..2] say by
// how much); kOverLimit, the rows needed exceed row_limit (need[1] says how many, out
// holds the probe codes); kDuplicateKey, a key that is not a live row is given twice
// (need[0] = the key).  On any outcome but kDone the store is exactly as before the call.
static int64_t hs_find_or_insert(HsTable* t, const int64_t* keys, const int64_t* counts, int64_t n, int64_t step,
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
    rc = kDuplicateKey;
  } else if (st[he::kRows] + all.rows > row_limit) {
    rc = kOverLimit;
  } else if (st[he::kEntries] + all.entries > max_entries ||
             st[he::kRowHwm] + std::max<int64_t>(0, all.rows - st[he::kNumFree]) > t->r_cap) {
    rc = kMustGrow;
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
static int64_t hs_insert(HsTable* t, const int64_t* keys, const int32_t* codes, const int64_t* counts,
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
static int64_t hs_erase(HsTable* t, const int64_t* keys, int64_t n) {
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
static int64_t hs_rehash(const int64_t* old, int64_t on, HsTable* nt, int64_t nthreads) {
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

namespace he {
int64_t init_rows(int64_t kind, const double* params, int64_t seed, const int64_t* keys, int64_t n, int64_t dim,
                  float* out, int64_t stride, const int64_t* rows, int64_t nthreads);  // store_init.cpp
}

// ---- the kernels (csrc/call.h) ----
namespace {

// A table is three buffers in a row, from buffer k: buckets int64 [B, 3], free_rows int32
// [>= num_free], st int64 [kStLen]; with the row capacity r_cap (rows of its storage) as
// an integer.  Arrays that do not fit together (a corrupt store) fail with HE_BAD_VALUE.
constexpr int64_t kTableBufs = 3;

HsTable table_of(const he::Call& call, int64_t k, int64_t r_cap) {
  const int64_t words = call.numel(k);
  if (words % 3 != 0 || words < 3 || words / 3 > (int64_t(1) << 32))
    call.fail(HE_BAD_VALUE, "hash store arrays are inconsistent: %lld bucket words", (long long)words);
  HsTable t{call.buf<int64_t>(k, words, "buckets"), words / 3, r_cap, call.opt<int32_t>(k + 1, 0, "free rows"),
            call.buf<int64_t>(k + 2, he::kStLen, "scalars")};
  if (t.st[he::kNumFree] < 0 || t.st[he::kNumFree] > call.numel(k + 1) || t.st[he::kRowHwm] < 0 ||
      t.st[he::kRowHwm] > r_cap || r_cap < 0 || r_cap > INT32_MAX)
    call.fail(HE_BAD_VALUE, "hash store arrays are inconsistent: %lld free rows listed in %lld, %lld of %lld rows used",
              (long long)t.st[he::kNumFree], (long long)call.numel(k + 1), (long long)t.st[he::kRowHwm],
              (long long)r_cap);
  return t;
}

// Position of the first count below 1, or -1.
int64_t first_bad_count(const int64_t* counts, int64_t n) {
  for (int64_t i = 0; counts && i < n; ++i)
    if (counts[i] < 1) return i;
  return -1;
}

// A find-or-insert's buffers after the table: keys [n], counts [n] or empty, out [n],
// scratch [>= 8n] (at 6n and 7n: the new rows' slots, then their keys), the duplicate set
// [2 * set_cap], set_cap a power of two >= 2n.
struct Insert {
  const int64_t *keys, *counts;
  int64_t n;
  int64_t *out, *scratch, *set;
  int64_t set_cap;
};

Insert insert_args(const he::Call& call, int64_t k) {
  Insert a{};
  a.n = call.numel(k);
  a.keys = call.buf<const int64_t>(k, a.n, "keys");
  a.counts = call.opt<const int64_t>(k + 1, a.n, "counts");
  a.out = call.buf<int64_t>(k + 2, a.n, "out");
  a.scratch = call.buf<int64_t>(k + 3, 8 * a.n, "scratch");
  a.set_cap = call.numel(k + 4) / 2;
  if (a.set_cap < 2 * a.n || (a.set_cap & (a.set_cap - 1)) != 0)
    call.fail(HE_BAD_CALL, "duplicate set of %lld slots for %lld keys", (long long)a.set_cap, (long long)a.n);
  a.set = call.buf<int64_t>(k + 4, 2 * a.set_cap, "duplicate set");
  return a;
}

}  // namespace

// codes[i] = code of keys[i] (row slot >= 0, pending -2, absent -1); with rows_only,
// pending keys read -1 too (what HashStore.find returns).
//   bufs  table (3), keys int64 [n], codes int64 [n];  ints  r_cap, rows_only
HE_KERNEL(he_hs_find) {
  call.expect(kTableBufs + 2, 2, 0);
  const HsTable t = table_of(call, 0, call.i(0));
  const int64_t n = call.numel(3);
  return hs_find(&t, call.buf<const int64_t>(3, n, "keys"), n, call.buf<int64_t>(4, n, "codes"), call.i(1),
                 call.nthreads());
}

// Find-or-insert into one table, with admission; returns an Outcome (hs_find_or_insert).
//   bufs  table (3), then as insert_args (5), need int64 [4]: new bucket entries, new rows,
//         new pending keys, rows created (their slots and keys: scratch[6n, 7n), [7n, 8n))
//   ints  r_cap, step, admit_k, row_limit, max_entries
// A count below 1 fails with HE_BAD_VALUE, detail {position, count}.
HE_KERNEL(he_hs_find_or_insert) {
  call.expect(kTableBufs + 6, 5, 0);
  HsTable t = table_of(call, 0, call.i(0));
  const Insert a = insert_args(call, kTableBufs);
  int64_t* need = call.buf<int64_t>(kTableBufs + 5, 4, "need");
  const int64_t bad = first_bad_count(a.counts, a.n);
  if (bad >= 0) {
    call.detail({bad, a.counts[bad]});
    call.fail(HE_BAD_VALUE, "count %lld at position %lld is below 1", (long long)a.counts[bad], (long long)bad);
  }
  return hs_find_or_insert(&t, a.keys, a.counts, a.n, call.i(1), call.i(2), call.i(3), call.i(4), a.out, a.scratch,
                           a.set, a.set_cap, a.scratch + 6 * a.n, a.scratch + 7 * a.n, need, call.nthreads());
}

// Inserts keys known to be absent and unique with their code (row slot or -2), count and
// last step (import, rebuild).
//   bufs  table (3), keys int64 [n], codes int32 [n], counts int64 [n], lasts int64 [n];  ints  r_cap
HE_KERNEL(he_hs_insert) {
  call.expect(kTableBufs + 4, 1, 0);
  HsTable t = table_of(call, 0, call.i(0));
  const int64_t n = call.numel(3);
  return hs_insert(&t, call.buf<const int64_t>(3, n, "keys"), call.buf<const int32_t>(4, n, "codes"),
                   call.buf<const int64_t>(5, n, "counts"), call.buf<const int64_t>(6, n, "last steps"), n,
                   call.nthreads());
}

// Removes keys from the index (row bookkeeping is the caller's); returns how many were
// not present.   bufs  table (3), keys int64 [n];  ints  r_cap
HE_KERNEL(he_hs_erase) {
  call.expect(kTableBufs + 1, 1, 0);
  HsTable t = table_of(call, 0, call.i(0));
  const int64_t n = call.numel(3);
  return hs_erase(&t, call.buf<const int64_t>(3, n, "keys"), n);
}

// Re-inserts every record of the old buckets into the table's new (unfilled) buckets;
// returns the records moved.   bufs  new table (3), old buckets int64 [B_old, 3];  ints  r_cap
HE_KERNEL(he_hs_rehash) {
  call.expect(kTableBufs + 1, 1, 0);
  HsTable t = table_of(call, 0, call.i(0));
  const int64_t words = call.numel(3);
  if (words % 3 != 0) call.fail(HE_BAD_CALL, "old buckets of %lld words", (long long)words);
  return hs_rehash(call.buf<const int64_t>(3, words, "old buckets"), words / 3, &t, call.nthreads());
}

// Find-or-insert into many tables at once, the tables spread over the threads (one table
// per thread at a time): a collection's per-table batches, each too small to split, run
// side by side instead of one after another, and new rows are initialised here too
// (weights by he::init_rows, then the optimizer state copied from a one-row template).
//   bufs  per table (kManyBufs): table (3), as insert_args (5), storage float32 [R, W]
//         (contiguous), state row float32 [state_width] or empty, initializer params
//         float64 [6]; then outcomes int64 [T, 5]: per table its Outcome and need[4]
//   ints  step, then per table (kManyInts): admit_k, row_limit, max_entries, init kind,
//         seed, W, dim, state_width
// Every table's arrays are checked before any table is touched (a corrupt one fails the
// call, detail[0] = the table).  A table whose outcome is not kDone is exactly as before the call (the caller
// grows it, makes room or raises, alone); kBadCount: a count below 1 (its own call raises
// with the details).
constexpr int64_t kManyBufs = kTableBufs + 8, kManyInts = 8;

HE_KERNEL(he_hs_find_or_insert_many) {
  if (call.nbufs() % kManyBufs != 1 || call.nints() != 1 + (call.nbufs() / kManyBufs) * kManyInts)
    call.fail(HE_BAD_CALL, "%lld buffers and %lld ints do not make whole tables",
                                      (long long)call.nbufs(), (long long)call.nints());
  const int64_t T = call.nbufs() / kManyBufs, step = call.i(0);
  int64_t* outcomes = call.buf<int64_t>(T * kManyBufs, 5 * T, "outcomes");
  struct Table {
    HsTable t;
    Insert a;
    const int64_t* ints;
    float* storage;
    const float* state_row;
    const double* params;
  };
  std::vector<Table> tables(T);
  for (int64_t d = 0; d < T; ++d) {  // every check before any write
    const int64_t k = d * kManyBufs;
    call.detail({d});  // which table a failing check is about
    const int64_t* in = call.raw()->ints + 1 + d * kManyInts;
    const int64_t W = in[5], dim = in[6], sw = in[7], words = call.numel(k + kTableBufs + 5);
    if (W < 1 || dim < 0 || sw < 0 || dim > W || sw > W - dim || words % W != 0 || in[3] < 0 || in[3] > 3)
      call.fail(HE_BAD_CALL, "table %lld: storage of %lld floats is not [rows, %lld] holding %lld + %lld columns "
                "(initializer %lld)", (long long)d, (long long)words, (long long)W, (long long)dim, (long long)sw,
                (long long)in[3]);
    Table& x = tables[d];
    x.t = table_of(call, k, words / W);
    x.a = insert_args(call, k + kTableBufs);
    x.ints = in;
    x.storage = call.buf<float>(k + kTableBufs + 5, words, "storage");
    x.state_row = call.opt<const float>(k + kTableBufs + 6, sw, "state row");
    if (sw > 0 && x.state_row == nullptr) call.fail(HE_BAD_CALL, "table %lld: no state row", (long long)d);
    x.params = call.buf<const double>(k + kTableBufs + 7, 6, "initializer params");
  }
  he::run_items(T, call.nthreads(), [&](int64_t d) {
    Table& x = tables[d];
    const Insert& a = x.a;
    const int64_t* in = x.ints;
    int64_t* o = outcomes + 5 * d;
    int64_t* need = o + 1;
    for (int k = 0; k < 4; ++k) need[k] = 0;
    if (first_bad_count(a.counts, a.n) >= 0) {
      o[0] = kBadCount;
      return;
    }
    int64_t* new_slots = a.scratch + 6 * a.n;
    o[0] = hs_find_or_insert(&x.t, a.keys, a.counts, a.n, step, in[0], in[1], in[2], a.out, a.scratch, a.set,
                             a.set_cap, new_slots, a.scratch + 7 * a.n, need, 1);
    const int64_t made = o[0] == kDone ? need[3] : 0;
    if (made == 0) return;
    const int64_t W = in[5], dim = in[6], sw = in[7];
    he::init_rows(in[3], x.params, in[4], a.scratch + 7 * a.n, made, dim, x.storage, W, new_slots, 1);
    if (sw > 0)
      for (int64_t j = 0; j < made; ++j) std::memcpy(x.storage + new_slots[j] * W + dim, x.state_row, sw * sizeof(float));
  });
  return 0;
}

// The training fetch of many static tables (ArrayStore, key k at slot k) at once: for
// each table, every key checked against [0, rows) and then, only if every key of every
// table is in range, slot = key copied to `out`, meta[slot][0] += count (1 without
// counts) and meta[slot][1] = step.
//   bufs  per table: meta int64 [rows, 2], keys int64 [n], counts int64 [n] or empty, out int64 [n]
//   ints  step, then per table its rows
// A bad key or count fails with HE_BAD_VALUE, detail {table, position, 1 (key) or 2 (count)},
// and nothing anywhere is written (the caller raises with the details, from the table's own call).
HE_KERNEL(he_array_touch_many) {
  const int64_t T = call.nbufs() / 4;
  call.expect(4 * T, 1 + T, 0);
  const int64_t step = call.i(0);
  struct Table {
    int64_t* meta;
    const int64_t *keys, *counts;
    int64_t* out;
    int64_t n, rows;
  };
  std::vector<Table> tables(T);
  for (int64_t d = 0; d < T; ++d) {
    Table& x = tables[d];
    x.rows = call.i(1 + d);
    x.n = call.numel(4 * d + 1);
    if (x.rows < 0 || x.rows > call.numel(4 * d) / 2)
      call.fail(HE_BAD_CALL, "table %lld: %lld rows, meta holds %lld", (long long)d, (long long)x.rows,
                (long long)call.numel(4 * d) / 2);
    x.meta = call.buf<int64_t>(4 * d, 2 * x.rows, "meta");
    x.keys = call.buf<const int64_t>(4 * d + 1, x.n, "keys");
    x.counts = call.opt<const int64_t>(4 * d + 2, x.n, "counts");
    x.out = call.buf<int64_t>(4 * d + 3, x.n, "out");
  }
  std::vector<int64_t> bad(T, -1), kind(T, 0);
  he::run_items(T, call.nthreads(), [&](int64_t d) {
    const Table& x = tables[d];
    for (int64_t i = 0; i < x.n; ++i) {
      const bool key_bad = x.keys[i] < 0 || x.keys[i] >= x.rows;
      if (key_bad || (x.counts && x.counts[i] < 1)) {
        bad[d] = i;
        kind[d] = key_bad ? 1 : 2;
        return;
      }
    }
  });
  for (int64_t d = 0; d < T; ++d)
    if (bad[d] >= 0) {
      call.detail({d, bad[d], kind[d]});
      call.fail(HE_BAD_VALUE, "table %lld: %s at position %lld", (long long)d, kind[d] == 1 ? "key out of range" :
                "count below 1", (long long)bad[d]);
    }
  he::run_items(T, call.nthreads(), [&](int64_t d) {
    const Table& x = tables[d];
    for (int64_t i = 0; i < x.n; ++i) {
      const int64_t k = x.keys[i];
      x.out[i] = k;
      x.meta[2 * k] += x.counts ? x.counts[i] : 1;
      x.meta[2 * k + 1] = step;
    }
  });
  return 0;
}
