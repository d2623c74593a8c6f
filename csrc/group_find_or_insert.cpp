// Find-or-insert over a dynamic group's key index (layout in group_index.h), with admission and
// row creation, over the keys of all the group's tables at once.
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

#include "group_probe.h"

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

}  // namespace

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
