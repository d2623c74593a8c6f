// What the kernels of a dynamic group's key index share (group_index.cpp,
// group_find_or_insert.cpp): probing a batch of keys, placing new records, and reading a
// group and a batch from a call's buffers (csrc/call.h).
#pragma once

#include <vector>

#include "common.h"
#include "group_index.h"

namespace he::gi {

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

// ---- argument unpacking (csrc/call.h) ----

// A group is four buffers in a row from buffer k: buckets int64 [B, 4], free rows int32
// [>= num_free], scalars int64 [kGroupLen], tables int64 [T, kTableLen]; with the rows of its
// storage (r_cap) as an integer.  Arrays that do not fit together fail with HE_BAD_VALUE.
constexpr int64_t kGroupBufs = 4;

inline Group group_of(const he::Call& call, int64_t k, int64_t r_cap) {
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
inline void check_batch(const he::Call& call, const Group& g, const int64_t* tids, const int64_t* counts, int64_t n) {
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

}  // namespace he::gi
