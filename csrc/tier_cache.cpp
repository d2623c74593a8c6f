// Victim selection of the disk tier's row cache (hugeembed/store/_tiered.py,
// TieredStore._make_room_for).
//
// Candidates are the resident cache slots (owner[s] >= 0) not in `exclude` (the
// rows the fetch reads and the pinned ones).  The victims are the `want` smallest
// candidates in lexicographic order of
//   LRU (freq == nullptr): (tick[s], keys[s])
//   LFU:                   (freq[s], tick[s], keys[s])
// Keys are unique among resident slots, so the set is unique.
//
// Linear time, as lowest_k in hugeembed/store/_common.py does it with torch ops:
// one pass over the cache builds a compact array of (value, slot) for the
// candidates; nth_element on the first column finds the threshold; every candidate
// strictly below it is a victim; the candidates equal to it (compacted in place)
// are ranked by the next column the same way, until the group is taken whole.
// The victims are marked in a byte mask and written out in ascending slot order --
// the order the torch path produces (a boolean mask over ascending slots) -- so the
// free stack, and with it which slot each new row gets, is the same on both paths.
//
// Scratch (a byte mask of `cap` and 16 bytes per candidate) is thread-local and
// reused from call to call: eviction runs nearly every training step and faulting
// ~11 MB in afresh each time (C = 700 k) would cost more than the selection.
// The mask is all zero between calls.
#include "common.h"

namespace {

struct Cand {
  int64_t v;
  int64_t slot;
};

thread_local std::vector<uint8_t> t_mask;  // 1: excluded, 2: chosen; 0 between calls
thread_local std::vector<Cand> t_cand;

constexpr uint8_t kExcluded = 1, kChosen = 2;

// Writes the slots marked kChosen to out in ascending order and zeroes the mask
// (the excluded marks too).  Returns how many were written.
int64_t collect_and_clear(uint8_t* mask, int64_t cap, int64_t* out) {
  int64_t j = 0, s = 0;
  for (; s + 8 <= cap; s += 8) {
    uint64_t word;
    std::memcpy(&word, mask + s, 8);
    if (word == 0) continue;
    for (int64_t t = s; t < s + 8; ++t) {
      if (mask[t] == kChosen) out[j++] = t;
      mask[t] = 0;
    }
  }
  for (; s < cap; ++s) {
    if (mask[s] == kChosen) out[j++] = s;
    mask[s] = 0;
  }
  return j;
}

}  // namespace

// Returns the number of candidates, or a negative code for bad arguments (-1: a
// negative size or a missing buffer, -2: an exclude entry >= cap; nothing is
// written then).  When the count is >= min_take, writes the min(count, want)
// smallest candidates to out (ascending slots); otherwise writes nothing.
// Entries of exclude that are < 0 are ignored; repeats are fine.
HE_API int64_t he_cache_victims(int64_t cap, const int64_t* owner, const int64_t* tick, const int64_t* keys,
                                const int32_t* freq, const int64_t* exclude, int64_t n_exclude, int64_t min_take,
                                int64_t want, int64_t* out) {
  if (cap < 0 || n_exclude < 0) return -1;
  if (cap > 0 && (owner == nullptr || tick == nullptr || keys == nullptr)) return -1;
  if (n_exclude > 0 && exclude == nullptr) return -1;
  for (int64_t i = 0; i < n_exclude; ++i)
    if (exclude[i] >= cap) return -2;
  if (cap == 0) return 0;

  std::vector<uint8_t>& maskv = t_mask;
  if ((int64_t)maskv.size() < cap) maskv.resize(cap, 0);
  uint8_t* mask = maskv.data();
  for (int64_t i = 0; i < n_exclude; ++i)
    if (exclude[i] >= 0) mask[exclude[i]] = kExcluded;

  std::vector<Cand>& candv = t_cand;
  if ((int64_t)candv.size() < cap) candv.resize(cap);
  Cand* c = candv.data();
  int64_t n = 0;
  if (freq != nullptr) {
    for (int64_t s = 0; s < cap; ++s)
      if (owner[s] >= 0 && mask[s] == 0) c[n++] = Cand{freq[s], s};
  } else {
    for (int64_t s = 0; s < cap; ++s)
      if (owner[s] >= 0 && mask[s] == 0) c[n++] = Cand{tick[s], s};
  }

  const int64_t k = std::min(n, std::max<int64_t>(want, 0));
  if (n < min_take || k == 0) {
    for (int64_t i = 0; i < n_exclude; ++i)
      if (exclude[i] >= 0) mask[exclude[i]] = 0;
    return n;
  }
  if (out == nullptr) {
    for (int64_t i = 0; i < n_exclude; ++i)
      if (exclude[i] >= 0) mask[exclude[i]] = 0;
    return -1;
  }

  // The columns after the first one, in rank order.
  const int64_t* rest[2];
  int n_rest = 0;
  if (freq != nullptr) rest[n_rest++] = tick;
  rest[n_rest++] = keys;

  int64_t m = n, r = k;  // choose the r smallest of c[0, m); 0 < r <= m
  for (int col = 0; r < m; ++col) {
    if (col > n_rest) break;  // tied in every column (a repeated key): any r of them
    if (col > 0) {
      const int64_t* v = rest[col - 1];
      for (int64_t i = 0; i < m; ++i) c[i].v = v[c[i].slot];
    }
    std::nth_element(c, c + (r - 1), c + m, [](const Cand& a, const Cand& b) { return a.v < b.v; });
    const int64_t thr = c[r - 1].v;
    int64_t ties = 0, less = 0;
    for (int64_t i = 0; i < m; ++i) {
      if (c[i].v < thr) {
        mask[c[i].slot] = kChosen;
        ++less;
      } else if (c[i].v == thr) {
        c[ties++] = c[i];
      }
    }
    r -= less;  // >= 1: thr itself is among the r smallest
    m = ties;   // >= r
  }
  for (int64_t i = 0; i < r; ++i) mask[c[i].slot] = kChosen;
  return collect_and_clear(mask, cap, out) == k ? n : -3;
}
