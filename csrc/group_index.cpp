// Native CPU kernels of a dynamic table group's key index (layout in group_index.h): find,
// find-or-insert with admission and row creation, insert, erase (backward shift) and rehash,
// every one over the keys of all the group's tables at once (a table column beside the keys).
// Called by hugeembed/store/_index_native.py; the plain-PyTorch reference of the same contract is
// hugeembed/store/_index_torch.py.
//
// Find-or-insert runs in phases; a call that fails (capacity, duplicate key, a chain too long,
// arrays to grow) leaves the group exactly as it was:
//   A (threads)  probe every key and count the hit of each key found in its record, records
//                prefetched kDist keys ahead; keys are unique per table, so no two threads touch
//                one record.  Each chunk lists its keys to insert or promote, per table;
//   B (serial)   sum what the batch needs, check that no key to insert comes twice, each table's
//                row limit, the longest probe and the arrays' room; on failure undo A;
//   C (serial)   hand out row slots in batch order (the reference hands them out alike), promote
//                pending keys;
//   D (threads)  place the new records: each thread owns a contiguous bucket range;
//   E (threads)  initialise the new rows: weights per (table seed, key, column), optimizer state
//                from the table's one-row template.
#include <vector>

#include "common.h"
#include "group_index.h"

namespace he {
int64_t init_rows(int64_t kind, const double* params, int64_t seed, const int64_t* keys, int64_t n, int64_t dim,
                  float* out, int64_t stride, const int64_t* rows, int64_t nthreads);  // store_init.cpp
}

namespace {

using namespace he::gi;

// What a find-or-insert did.  Must match hugeembed/store/_index.py::Outcome.
enum Outcome : int64_t { kDone = 0, kMustGrow = 1, kOverLimit = 2, kDuplicateKey = 3, kLongProbe = 4 };

// need[] of a find-or-insert: totals, per table (new rows, new pending keys), then the group after
// the call (entries, row_hwm, free rows listed) and per table (rows, pending keys): the caller
// reads everything it decides on with one read.
enum Need : int {
  kNeedEntries = 0, kNeedRows = 1, kNeedPending = 2, kNeedMade = 3, kNeedDupKey = 4, kNeedDupTable = 5,
  kNeedLongTable = 6, kNeedLongProbe = 7, kNeedHead = 8,
};

constexpr int64_t kDist = 16;     // prefetch distance in keys (as hash_store.cpp: 8..64 within noise)
constexpr int64_t kChunk = 8192;  // keys per work item of the probe phase

inline void prefetch_record(const int64_t* r, uint64_t i) { __builtin_prefetch(r + kWords * i, 1); }

struct alignas(64) Needs {
  int64_t entries = 0, rows = 0, pending = 0, longest = 0, long_table = -1;
  std::vector<int64_t> per_table;  // [2T]: new rows, new pending keys
  std::vector<int64_t> todo;       // keys to insert or promote, in batch order
};

// Probes (tids[i], keys[i]) for i in [b, e) (tids[i] < 0: skipped, code -1): codes[i] = row slot,
// -2 pending, -1 absent; pos[i] = the key's bucket or the first empty one on its path.  With
// kApply, adds counts[i] to the hits of each key found and sets its last step (the old words kept
// in saved for undo_hits), and fills `needs`.  admit[i] == 0: an absent key is left absent.
template <bool kApply>
void probe_range(const Group& g, const int64_t* keys, const int64_t* tids, const int64_t* counts, const uint8_t* admit,
                 int64_t step, int64_t b, int64_t e, int64_t* codes, int64_t* pos, int64_t* saved, int64_t* hits,
                 Needs* needs) {
  const uint64_t nb = (uint64_t)g.nbuckets;
  int64_t* r = g.buckets;
  Needs local;
  if (kApply) local.per_table.assign(2 * g.T, 0);
  uint64_t ring[kDist];
  auto start = [&](int64_t j) -> uint64_t {
    const int64_t t = tids[j];
    return t < 0 ? 0 : home(keys[j], g.table(t)[kHashKey], nb);
  };
  for (int64_t j = b; j < std::min(e, b + kDist); ++j) {
    ring[j % kDist] = start(j);
    prefetch_record(r, ring[j % kDist]);
  }
  for (int64_t i = b; i < e; ++i) {
    uint64_t p = ring[i % kDist];
    const int64_t j = i + kDist;
    if (j < e) {
      ring[j % kDist] = start(j);
      prefetch_record(r, ring[j % kDist]);
    }
    const int64_t t = tids[i];
    if (t < 0) {
      codes[i] = kAbsent;
      if (pos) pos[i] = -1;
      continue;
    }
    const int64_t key = keys[i];
    int64_t* w = nullptr;  // words 2 and 3 of the key's record, if present
    int64_t probes = 1;
    while (true) {
      const int64_t* rec = r + kWords * p;
      if (rec[1] == kFreeBucket) break;
      if (rec[0] == key && rec[1] == t) {
        w = r + kWords * p + 2;
        break;
      }
      p = next(p, nb);
      ++probes;
    }
    if (pos) pos[i] = (int64_t)p;
    const int64_t code = w ? code_of(w[0]) : kAbsent;
    codes[i] = code;
    if (!kApply) continue;
    if (probes > local.longest) {
      local.longest = probes;
      local.long_table = t;
    }
    const int64_t c = counts ? counts[i] : 1;
    const int64_t admit_k = g.table(t)[kAdmitK];
    if (w) {
      saved[2 * i] = w[0];
      saved[2 * i + 1] = w[1];
      const int64_t n = (int64_t)count_of(w[0]) + c;
      w[0] = pack((int32_t)code, n);
      w[1] = step;
      if (hits) hits[i] = std::min<int64_t>(n, INT32_MAX);
      if (code < 0) {
        local.todo.push_back(i);
        if (n >= admit_k) ++local.per_table[2 * t];  // a pending key reaching admission
      }
    } else if (admit && !admit[i]) {
      if (hits) hits[i] = 0;  // not drawn: leaves no trace
    } else {
      if (hits) hits[i] = std::min<int64_t>(c, INT32_MAX);
      local.todo.push_back(i);
      ++local.entries;
      ++local.per_table[2 * t + (c >= admit_k ? 0 : 1)];
    }
  }
  if (kApply) *needs = std::move(local);
}

// Reverts what probe_range<true> did to the keys found (a failed call changes nothing).
void undo_hits(const Group& g, const int64_t* tids, int64_t n, const int64_t* codes, const int64_t* pos,
               const int64_t* saved) {
  for (int64_t i = n - 1; i >= 0; --i) {
    if (tids[i] < 0 || codes[i] == kAbsent) continue;
    int64_t* w = g.buckets + kWords * pos[i] + 2;
    w[0] = saved[2 * i];
    w[1] = saved[2 * i + 1];
  }
}

// True (and the pair in *dup_key, *dup_table) when a (table, key) listed in `todo` occurs twice:
// a small open-addressing set in the caller's scratch (cap keys, cap tables, then cap byte flags).
bool find_duplicate(const int64_t* keys, const int64_t* tids, const std::vector<int64_t>& todo, int64_t* scratch,
                    int64_t cap, int64_t* dup_key, int64_t* dup_table) {
  uint64_t size = he::next_pow2((uint64_t)std::max<int64_t>(16, 2 * (int64_t)todo.size()));
  if ((int64_t)size > cap) size = (uint64_t)cap;  // cap >= 2n: never fuller than half
  int64_t *set_keys = scratch, *set_tabs = scratch + cap;
  uint8_t* used = reinterpret_cast<uint8_t*>(scratch + 2 * cap);
  std::memset(used, 0, size);
  const uint64_t mask = size - 1;
  for (int64_t i : todo) {
    uint64_t p = he::mix64((uint64_t)keys[i] ^ ((uint64_t)tids[i] * 0x9E3779B97F4A7C15ULL)) & mask;
    while (used[p] && !(set_keys[p] == keys[i] && set_tabs[p] == tids[i])) p = (p + 1) & mask;
    if (used[p]) {
      *dup_key = keys[i];
      *dup_table = tids[i];
      return true;
    }
    used[p] = 1;
    set_keys[p] = keys[i];
    set_tabs[p] = tids[i];
  }
  return false;
}

inline int32_t alloc_row(Group& g) {
  int64_t* st = g.st;
  if (st[kNumFree] > 0) return g.free_rows[--st[kNumFree]];
  return (int32_t)st[kRowHwm]++;
}

// Places n records (known absent and unique) at the first empty bucket from their start on.
// src(i, rec, start) fills record i's 4 words and returns false for a record to skip.  Threads own
// contiguous bucket ranges; a record whose probe would leave its thread's range is placed after.
template <class Src>
int64_t place_all(Group& g, int64_t n, Src&& src, int64_t nthreads) {
  if (n == 0) return 0;
  const uint64_t nb = (uint64_t)g.nbuckets;
  int64_t* r = g.buckets;
  const int regions = (int)std::max<int64_t>(1, std::min<int64_t>({nthreads, (int64_t)nb / 1024, n / 2048 + 1}));
  std::vector<std::vector<int64_t>> deferred(regions);
  std::vector<int64_t> placed(regions, 0);
  he::run_items(regions, regions, [&](int64_t reg) {
    const uint64_t lo = nb / regions * reg, hi = (reg == regions - 1) ? nb : lo + nb / regions;
    int64_t rec[kWords];
    uint64_t p = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (i + kDist < n && src(i + kDist, rec, p) && p >= lo && p < hi) prefetch_record(r, p);
      if (!src(i, rec, p) || p < lo || p >= hi) continue;
      while (p < hi && r[kWords * p + 1] != kFreeBucket) ++p;
      if (p == hi) {
        deferred[reg].push_back(i);
        continue;
      }
      std::memcpy(r + kWords * p, rec, sizeof rec);
      ++placed[reg];
    }
  });
  int64_t total = 0;
  for (int reg = 0; reg < regions; ++reg) {
    total += placed[reg];
    for (int64_t i : deferred[reg]) {
      int64_t rec[kWords];
      uint64_t p = 0;
      src(i, rec, p);
      while (r[kWords * p + 1] != kFreeBucket) p = next(p, nb);
      std::memcpy(r + kWords * p, rec, sizeof rec);
      ++total;
    }
  }
  g.st[kEntries] += total;
  return total;
}

// The arguments of a find-or-insert after the group's arrays.
struct Batch {
  const int64_t *keys, *tids, *counts;
  const uint8_t* admit;
  int64_t n;
  int64_t *out, *hits, *scratch, *set;
  int64_t set_cap;
};

// How new rows start (phase E): per table an initializer (kind < 0: the caller initialises that
// table's rows), its parameters and seed, and its state template row.
struct RowInit {
  float* storage;  // [r_cap, W] or null: the caller initialises every new row
  int64_t W, dim, state_width;
  const int64_t* kinds;   // [T, 2]: initializer kind, seed
  const double* params;   // [T, 6]
  const float* state;     // [T, state_width]
};

void init_new_rows(const Group& g, const RowInit& init, const int64_t* slots, const int64_t* keys,
                   const int64_t* tabs, int64_t made, int64_t* sorted, int nthreads) {
  if (!init.storage || made == 0) return;
  // counting sort of the new rows by table (stable: batch order within a table)
  std::vector<int64_t> start(g.T + 1, 0);
  for (int64_t j = 0; j < made; ++j) ++start[tabs[j] + 1];
  for (int64_t t = 0; t < g.T; ++t) start[t + 1] += start[t];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  int64_t *s_slots = sorted, *s_keys = sorted + made;
  for (int64_t j = 0; j < made; ++j) {
    const int64_t at = fill[tabs[j]]++;
    s_slots[at] = slots[j];
    s_keys[at] = keys[j];
  }
  he::run_items(g.T, nthreads, [&](int64_t t) {
    const int64_t b = start[t], n = start[t + 1] - b, kind = init.kinds[2 * t];
    if (n == 0 || kind < 0) return;
    he::init_rows(kind, init.params + 6 * t, init.kinds[2 * t + 1], s_keys + b, n, init.dim, init.storage, init.W,
                  s_slots + b, 1);
    if (init.state_width > 0)
      for (int64_t j = b; j < b + n; ++j)
        std::memcpy(init.storage + s_slots[j] * init.W + init.dim, init.state + t * init.state_width,
                    init.state_width * sizeof(float));
  });
}

// The group's state after a call, into need[] behind the per-table needs.
void report_state(const Group& g, int64_t* need) {
  int64_t* after = need + kNeedHead + 2 * g.T;
  after[0] = g.st[kEntries];
  after[1] = g.st[kRowHwm];
  after[2] = g.st[kNumFree];
  for (int64_t t = 0; t < g.T; ++t) {
    after[3 + 2 * t] = g.table(t)[kRows];
    after[3 + 2 * t + 1] = g.table(t)[kPending];
  }
}

// Find-or-insert of a batch over every table of the group (see the file comment for the phases).
// need[]: see Need; per table t at kNeedHead + 2t: new rows, new pending keys; then report_state.  out[i]: row slot,
// -1 (not admitted, skipped); hits[i] (optional): the key's hit count after the call.
// probe_limit: a probe longer than this fails the call with kLongProbe (need: the table).
int64_t find_or_insert(Group& g, const Batch& a, int64_t step, int64_t max_entries, int64_t probe_limit,
                       const RowInit& init, int64_t* need, int nthreads) {
  const int64_t n = a.n, T = g.T;
  int64_t* st = g.st;
  int64_t *pos = a.scratch, *saved = a.scratch + n;  // saved: 2n
  int64_t *new_slots = a.scratch + 3 * n, *new_keys = a.scratch + 4 * n, *new_tabs = a.scratch + 5 * n;
  int64_t* sorted = a.scratch + 6 * n;  // 2n, phase E
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<Needs> parts(nchunks);
  he::run_items(nchunks, nthreads, [&](int64_t c) {
    probe_range<true>(g, a.keys, a.tids, a.counts, a.admit, step, c * kChunk, std::min(n, (c + 1) * kChunk), a.out,
                      pos, saved, a.hits, &parts[c]);
  });
  // B
  for (int k = 0; k < kNeedHead + 2 * T; ++k) need[k] = 0;
  need[kNeedLongTable] = -1;
  std::vector<int64_t> todo;
  for (auto& p : parts) {
    need[kNeedEntries] += p.entries;
    for (int64_t t = 0; t < T && !p.per_table.empty(); ++t) {
      need[kNeedHead + 2 * t] += p.per_table[2 * t];
      need[kNeedHead + 2 * t + 1] += p.per_table[2 * t + 1];
    }
    if (p.longest > need[kNeedLongProbe]) {
      need[kNeedLongProbe] = p.longest;
      need[kNeedLongTable] = p.long_table;
    }
    todo.insert(todo.end(), p.todo.begin(), p.todo.end());
  }
  bool over = false;
  for (int64_t t = 0; t < T; ++t) {
    need[kNeedRows] += need[kNeedHead + 2 * t];
    need[kNeedPending] += need[kNeedHead + 2 * t + 1];
    const int64_t* tab = g.table(t);
    over |= tab[kRows] + need[kNeedHead + 2 * t] > tab[kRowLimit];
  }
  int64_t rc = kDone;
  if (todo.size() > 1 && find_duplicate(a.keys, a.tids, todo, a.set, a.set_cap, &need[kNeedDupKey],
                                        &need[kNeedDupTable])) {
    rc = kDuplicateKey;
  } else if (over) {
    rc = kOverLimit;
  } else if (need[kNeedLongProbe] > probe_limit) {
    rc = kLongProbe;
  } else if (st[kEntries] + need[kNeedEntries] > max_entries ||
             st[kRowHwm] + std::max<int64_t>(0, need[kNeedRows] - st[kNumFree]) > g.r_cap) {
    rc = kMustGrow;
  }
  if (rc != kDone) {
    undo_hits(g, a.tids, n, a.out, pos, saved);
    report_state(g, need);
    return rc;
  }
  // C: slots in batch order; the records to place reuse `saved` (their word 2) and `pos` (start)
  int64_t made = 0, placed = 0;
  int64_t* place_w = saved;
  std::vector<int64_t> place_idx;
  place_idx.reserve(need[kNeedEntries]);
  for (int64_t i : todo) {
    const int64_t t = a.tids[i];
    int64_t* tab = g.table(t);
    if (a.out[i] == kAbsent) {
      const int64_t c = a.counts ? a.counts[i] : 1;
      int32_t code = kPendingCode;
      if (c >= tab[kAdmitK]) {
        code = alloc_row(g);
        tab[kRows] += 1;
        new_slots[made] = code;
        new_keys[made] = a.keys[i];
        new_tabs[made++] = t;
        a.out[i] = code;
      } else {
        tab[kPending] += 1;
      }
      place_w[placed++] = pack(code, c);
      place_idx.push_back(i);
    } else {  // a pending key: promoted once its count (updated in A) reaches admit_k
      int64_t* w = g.buckets + kWords * pos[i] + 2;
      if (count_of(w[0]) >= tab[kAdmitK]) {
        const int32_t s = alloc_row(g);
        w[0] = pack(s, count_of(w[0]));
        tab[kRows] += 1;
        tab[kPending] -= 1;
        new_slots[made] = s;
        new_keys[made] = a.keys[i];
        new_tabs[made++] = t;
        a.out[i] = s;
      } else {
        a.out[i] = kAbsent;
      }
    }
  }
  // D
  place_all(g, placed, [&](int64_t j, int64_t* rec, uint64_t& p) {
    const int64_t i = place_idx[j];
    rec[0] = a.keys[i];
    rec[1] = a.tids[i];
    rec[2] = place_w[j];
    rec[3] = step;
    p = (uint64_t)pos[i];
    return true;
  }, nthreads);
  // E
  init_new_rows(g, init, new_slots, new_keys, new_tabs, made, sorted, nthreads);
  need[kNeedMade] = made;
  report_state(g, need);
  return kDone;
}

// ---- argument unpacking (csrc/call.h) ----

// A group is four buffers in a row from buffer k: buckets int64 [B, 4], free rows int32
// [>= num_free], scalars int64 [kGroupLen], tables int64 [T, kTableLen]; with the rows of its
// storage (r_cap) as an integer.  Arrays that do not fit together fail with HE_BAD_VALUE.
constexpr int64_t kGroupBufs = 4;

Group group_of(const he::Call& call, int64_t k, int64_t r_cap) {
  const int64_t words = call.numel(k), twords = call.numel(k + 3);
  if (words % kWords != 0 || words < kWords || words / kWords > (int64_t(1) << 32) || twords % kTableLen != 0)
    call.fail(HE_BAD_VALUE, "group index arrays are inconsistent: %lld bucket words, %lld table words",
              (long long)words, (long long)twords);
  Group g{call.buf<int64_t>(k, words, "buckets"), words / kWords, r_cap, call.opt<int32_t>(k + 1, 0, "free rows"),
          call.buf<int64_t>(k + 2, kGroupLen, "scalars"), call.opt<int64_t>(k + 3, 0, "tables"),
          twords / kTableLen};
  if (g.st[kNumFree] < 0 || g.st[kNumFree] > call.numel(k + 1) || g.st[kRowHwm] < 0 || g.st[kRowHwm] > r_cap ||
      r_cap < 0 || r_cap > INT32_MAX)
    call.fail(HE_BAD_VALUE, "group index arrays are inconsistent: %lld free rows listed in %lld, %lld of %lld rows used",
              (long long)g.st[kNumFree], (long long)call.numel(k + 1), (long long)g.st[kRowHwm], (long long)r_cap);
  return g;
}

// Checks the table column (each entry -1 or a table of the group: else our bug) and the counts
// (each >= 1: else a bad value, detail {position, count, 1}).
void check_batch(const he::Call& call, const Group& g, const int64_t* tids, const int64_t* counts, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (tids[i] < -1 || tids[i] >= g.T)
      call.fail(HE_BAD_CALL, "table %lld at position %lld is not one of the group's %lld tables", (long long)tids[i],
                (long long)i, (long long)g.T);
    if (counts && tids[i] >= 0 && counts[i] < 1) {
      call.detail({i, counts[i], 1});
      call.fail(HE_BAD_VALUE, "count %lld at position %lld is below 1", (long long)counts[i], (long long)i);
    }
  }
}

}  // namespace

// codes[i] = code of (tids[i], keys[i]) (row slot >= 0, pending -2, absent -1; tids[i] = -1: -1);
// rows_only: pending keys read -1 too; hits (optional): the key's hit count (0 when absent).
//   bufs  group (4), keys int64 [n], tids int64 [n], codes int64 [n], hits int64 [n] or empty
//   ints  r_cap, rows_only
HE_KERNEL(he_group_find) {
  call.expect(kGroupBufs + 4, 2, 0);
  const Group g = group_of(call, 0, call.i(0));
  const int64_t n = call.numel(kGroupBufs);
  const int64_t* keys = call.buf<const int64_t>(kGroupBufs, n, "keys");
  const int64_t* tids = call.buf<const int64_t>(kGroupBufs + 1, n, "tables");
  int64_t* codes = call.buf<int64_t>(kGroupBufs + 2, n, "codes");
  int64_t* hits = call.opt<int64_t>(kGroupBufs + 3, n, "hits");
  check_batch(call, g, tids, nullptr, n);
  const bool rows_only = call.i(1) != 0;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  std::vector<int64_t> pos(hits ? n : 0);
  he::run_items(nchunks, call.nthreads(), [&](int64_t c) {
    const int64_t b = c * kChunk, e = std::min(n, (c + 1) * kChunk);
    probe_range<false>(g, keys, tids, nullptr, nullptr, 0, b, e, codes, hits ? pos.data() : nullptr, nullptr,
                       nullptr, nullptr);
    for (int64_t i = b; i < e; ++i) {
      if (hits) hits[i] = codes[i] == kAbsent ? 0 : count_of(g.buckets[kWords * pos[i] + 2]);
      if (rows_only) codes[i] = std::max(codes[i], kAbsent);
    }
  });
  return 0;
}

// Find-or-insert over the group's tables (find_or_insert above); returns an Outcome.
//   bufs  group (4); keys int64 [n], tids int64 [n] (-1: skipped), counts int64 [n] or empty,
//         admit uint8 [n] or empty (0: an absent key stays absent), out int64 [n], hits int64 [n] or
//         empty, scratch int64 [>= 8n] (new rows' slots at 3n, keys at 4n, tables at 5n), the
//         duplicate set int64 [>= 3 * set_cap] (set_cap a power of two >= 2n), need int64
//         [8 + 4T + 3]; storage float32 [r_cap, W] or empty, inits int64 [T, 2], params float64
//         [T, 6], state rows float32 [T, state_width] or empty
//   ints  r_cap, step, max_entries, probe_limit, W, dim, state_width
// A count below 1 fails with HE_BAD_VALUE, detail {position, count, 1}.
HE_KERNEL(he_group_find_or_insert) {
  call.expect(kGroupBufs + 13, 7, 0);
  const int64_t r_cap = call.i(0);
  Group g = group_of(call, 0, r_cap);
  constexpr int64_t k = kGroupBufs;
  Batch a{};
  a.n = call.numel(k);
  a.keys = call.buf<const int64_t>(k, a.n, "keys");
  a.tids = call.buf<const int64_t>(k + 1, a.n, "tables");
  a.counts = call.opt<const int64_t>(k + 2, a.n, "counts");
  a.admit = call.opt<const uint8_t>(k + 3, a.n, "admit");
  a.out = call.buf<int64_t>(k + 4, a.n, "out");
  a.hits = call.opt<int64_t>(k + 5, a.n, "hits");
  a.scratch = call.buf<int64_t>(k + 6, 8 * a.n, "scratch");
  a.set_cap = he::next_pow2((uint64_t)std::max<int64_t>(16, 2 * a.n));
  a.set = call.buf<int64_t>(k + 7, 3 * a.set_cap, "duplicate set");
  int64_t* need = call.buf<int64_t>(k + 8, kNeedHead + 4 * g.T + 3, "need");
  RowInit init{};
  init.W = call.i(4);
  init.dim = call.i(5);
  init.state_width = call.i(6);
  const int64_t swords = call.numel(k + 9);
  if (swords > 0) {
    if (init.W < 1 || init.dim < 1 || init.state_width < 0 || init.dim + init.state_width > init.W ||
        swords != r_cap * init.W)
      call.fail(HE_BAD_CALL, "storage of %lld floats is not [%lld, %lld] holding %lld + %lld columns",
                (long long)swords, (long long)r_cap, (long long)init.W, (long long)init.dim,
                (long long)init.state_width);
    init.storage = call.buf<float>(k + 9, swords, "storage");
    init.kinds = call.buf<const int64_t>(k + 10, 2 * g.T, "initializers");
    init.params = call.buf<const double>(k + 11, 6 * g.T, "initializer params");
    init.state = call.opt<const float>(k + 12, g.T * init.state_width, "state rows");
    if (init.state_width > 0 && !init.state) call.fail(HE_BAD_CALL, "no state rows");
    for (int64_t t = 0; t < g.T; ++t)
      if (init.kinds[2 * t] > 3) call.fail(HE_BAD_CALL, "table %lld: initializer kind %lld", (long long)t,
                                           (long long)init.kinds[2 * t]);
  }
  check_batch(call, g, a.tids, a.counts, a.n);
  return find_or_insert(g, a, call.i(1), call.i(2), call.i(3), init, need, call.nthreads());
}

// Inserts (table, key) pairs known to be absent and unique with their code (row slot or -2), count
// and last step (import, rebuild).
//   bufs  group (4), keys int64 [n], tids int64 [n], codes int32 [n], counts int64 [n], lasts int64 [n]
//   ints  r_cap
HE_KERNEL(he_group_insert) {
  call.expect(kGroupBufs + 5, 1, 0);
  Group g = group_of(call, 0, call.i(0));
  const int64_t n = call.numel(kGroupBufs);
  const int64_t* keys = call.buf<const int64_t>(kGroupBufs, n, "keys");
  const int64_t* tids = call.buf<const int64_t>(kGroupBufs + 1, n, "tables");
  const int32_t* codes = call.buf<const int32_t>(kGroupBufs + 2, n, "codes");
  const int64_t* counts = call.buf<const int64_t>(kGroupBufs + 3, n, "counts");
  const int64_t* lasts = call.buf<const int64_t>(kGroupBufs + 4, n, "last steps");
  check_batch(call, g, tids, nullptr, n);
  const uint64_t nb = (uint64_t)g.nbuckets;
  place_all(g, n, [&](int64_t i, int64_t* rec, uint64_t& p) {
    rec[0] = keys[i];
    rec[1] = tids[i];
    rec[2] = pack(codes[i], counts[i]);
    rec[3] = lasts[i];
    if (tids[i] < 0) return false;
    p = home(keys[i], g.table(tids[i])[kHashKey], nb);
    return true;
  }, call.nthreads());
  return 0;
}

// Removes (table, key) pairs from the index by backward-shift deletion (no tombstones); row and
// count bookkeeping is the caller's.  Returns how many were not present.
//   bufs  group (4), keys int64 [n], tids int64 [n];  ints  r_cap
HE_KERNEL(he_group_erase) {
  call.expect(kGroupBufs + 2, 1, 0);
  Group g = group_of(call, 0, call.i(0));
  const int64_t n = call.numel(kGroupBufs);
  const int64_t* keys = call.buf<const int64_t>(kGroupBufs, n, "keys");
  const int64_t* tids = call.buf<const int64_t>(kGroupBufs + 1, n, "tables");
  check_batch(call, g, tids, nullptr, n);
  const uint64_t nb = (uint64_t)g.nbuckets;
  int64_t* r = g.buckets;
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = keys[i], t = tids[i];
    if (t < 0) continue;
    uint64_t p = home(key, g.table(t)[kHashKey], nb);
    while (r[kWords * p + 1] != kFreeBucket && !(r[kWords * p] == key && r[kWords * p + 1] == t)) p = next(p, nb);
    if (r[kWords * p + 1] == kFreeBucket) {
      ++missing;
      continue;
    }
    // Knuth's algorithm R: move later records of the cluster back into the hole when the hole
    // lies between their home and where they sit.
    uint64_t hole = p, j = p;
    while (true) {
      j = next(j, nb);
      const int64_t tj = r[kWords * j + 1];
      if (tj == kFreeBucket) break;
      const uint64_t h = home(r[kWords * j], g.table(tj)[kHashKey], nb);
      const uint64_t dh = j >= h ? j - h : j + nb - h, dhole = j >= hole ? j - hole : j + nb - hole;
      if (dh >= dhole) {
        std::memcpy(r + kWords * hole, r + kWords * j, kWords * sizeof(int64_t));
        hole = j;
      }
    }
    r[kWords * hole] = 0;
    r[kWords * hole + 1] = kFreeBucket;
    r[kWords * hole + 2] = pack(-1, 0);
    r[kWords * hole + 3] = 0;
    g.st[kEntries] -= 1;
  }
  return missing;
}

// Re-inserts every record of the old buckets into the group's new buckets (homes from the
// tables' hash keys now, which may have changed).  Returns the records moved.
//   bufs  new group (4), old buckets int64 [B_old, 4];  ints  r_cap
HE_KERNEL(he_group_rehash) {
  call.expect(kGroupBufs + 1, 1, 0);
  Group g = group_of(call, 0, call.i(0));
  const int64_t words = call.numel(kGroupBufs);
  if (words % kWords != 0) call.fail(HE_BAD_CALL, "old buckets of %lld words", (long long)words);
  const int64_t* old = call.buf<const int64_t>(kGroupBufs, words, "old buckets");
  const int64_t on = words / kWords;
  for (int64_t i = 0; i < on; ++i)
    if (old[kWords * i + 1] < -1 || old[kWords * i + 1] >= g.T)
      call.fail(HE_BAD_VALUE, "old bucket %lld holds table %lld of %lld", (long long)i,
                (long long)old[kWords * i + 1], (long long)g.T);
  int64_t* nr = g.buckets;
  const int64_t empty_w = pack(-1, 0);
  const int64_t fill_chunk = 1 << 16;
  he::run_items((g.nbuckets + fill_chunk - 1) / fill_chunk, call.nthreads(), [&](int64_t c) {
    for (int64_t i = c * fill_chunk; i < std::min(g.nbuckets, (c + 1) * fill_chunk); ++i) {
      nr[kWords * i] = 0;
      nr[kWords * i + 1] = kFreeBucket;
      nr[kWords * i + 2] = empty_w;
      nr[kWords * i + 3] = 0;
    }
  });
  const uint64_t nb = (uint64_t)g.nbuckets;
  g.st[kEntries] = 0;
  return place_all(g, on, [&](int64_t i, int64_t* rec, uint64_t& p) {
    std::memcpy(rec, old + kWords * i, kWords * sizeof(int64_t));
    if (rec[1] == kFreeBucket) return false;
    p = home(rec[0], g.table(rec[1])[kHashKey], nb);
    return true;
  }, call.nthreads());
}

// The training fetch of a group of static tables: table t's key k lives at row
// first[t] + k / shards[t] when k is one of its keys (0 <= k < rows[t], k mod shards[t] == shard[t]).
// Every key is checked first; then, only if all are good, out = the row and (with count) its hit
// count grows by counts[i] (1 without counts) and its last step becomes `step`.  tids[i] = -1:
// skipped (out -1).
//   bufs  meta int64 [R, 2], tables int64 [T, 4] (first, rows, shard, shards), keys int64 [n],
//         tids int64 [n], counts int64 [n] or empty, out int64 [n]
//   ints  step, count (0: only the rows, nothing written to meta), unique (1: no key of a table
//         comes twice, so the rows are written from several threads)
// A bad key or count fails with HE_BAD_VALUE, detail {position, 1 (key) or 2 (count)}, nothing written.
HE_KERNEL(he_static_touch) {
  call.expect(6, 3, 0);
  const int64_t R = call.numel(0) / 2, T = call.numel(1) / 4, n = call.numel(2);
  int64_t* meta = call.buf<int64_t>(0, 2 * R, "meta");
  const int64_t* tab = call.buf<const int64_t>(1, 4 * T, "tables");
  const int64_t* keys = call.buf<const int64_t>(2, n, "keys");
  const int64_t* tids = call.buf<const int64_t>(3, n, "tables of keys");
  const int64_t* counts = call.opt<const int64_t>(4, n, "counts");
  int64_t* out = call.buf<int64_t>(5, n, "out");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* x = tab + 4 * t;
    if (x[0] < 0 || x[1] < 0 || x[3] < 1 || x[2] < 0 || x[2] >= x[3] || x[0] + (x[1] + x[3] - 1 - x[2]) / x[3] > R)
      call.fail(HE_BAD_CALL, "table %lld: first row %lld, %lld rows, shard %lld of %lld do not fit %lld rows",
                (long long)t, (long long)x[0], (long long)x[1], (long long)x[2], (long long)x[3], (long long)R);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tids[i];
    if (t < -1 || t >= T)
      call.fail(HE_BAD_CALL, "table %lld at position %lld is not one of the group's %lld", (long long)t,
                (long long)i, (long long)T);
    if (t < 0) continue;
    const int64_t* x = tab + 4 * t;
    const int64_t k = keys[i];
    const bool bad_key = k < 0 || k >= x[1] || k % x[3] != x[2];
    if (bad_key || (counts && counts[i] < 1)) {
      call.detail({i, bad_key ? 1 : 2});
      call.fail(HE_BAD_VALUE, "%s at position %lld", bad_key ? "key out of range" : "count below 1", (long long)i);
    }
  }
  const int64_t step = call.i(0);
  const bool count = call.i(1) != 0;
  he::parallel_for(n, call.i(2) ? call.nthreads() : 1, 1 << 14, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = tids[i];
      if (t < 0) {
        out[i] = -1;
        continue;
      }
      const int64_t* x = tab + 4 * t;
      const int64_t s = x[0] + keys[i] / x[3];
      out[i] = s;
      if (count) {
        meta[2 * s] += counts ? counts[i] : 1;
        meta[2 * s + 1] = step;
      }
    }
  });
  return 0;
}
