// The victim chooser every store shares (hugeembed/store/_evict.py, choose_victims): the
// tiered cache's victims and the dynamic store's max_rows / pending eviction.
//
// Candidates are the indices s with valid[s] >= 0 (for the cache: the resident
// slots, owner[s] >= 0) not in `exclude` (the rows the fetch reads and the pinned ones).  The
// victims are the `want` smallest candidates in lexicographic order of up to three int32 /
// int64 columns, the policy's order (_evict.policy_columns), the last one unique among the
// candidates (the keys), so the set is unique.
//
// Linear time, as lowest_k in hugeembed/store/_common.py does it with torch ops, but
// without a sort or nth_element: one pass over the cache lists the candidate slots
// (ascending, 4 bytes each); histogram rounds
// (split_at_rth) find the r-th smallest value; every candidate below it is a victim;
// those equal to it stay listed, still ascending, and are ranked by the next column
// the same way, until the group is taken whole.  The columns are read through the
// list, so every pass walks them forwards.  The victims' ticks and counts are the
// smallest ones, so one round usually settles a column.  Each round appends its
// victims in ascending slot order; the runs are merged at the end, so the victims
// come out in ascending slot order -- the order of the torch path (a boolean mask
// over ascending slots) -- and the free stack, and with it the slot each new row
// gets, is the same on both paths.
//
// Scratch (an exclusion byte mask of `cap`, 8 bytes per candidate and a 256 KB
// histogram) is thread-local and reused from call to call: eviction runs nearly every
// training step, and faulting it in afresh each time would cost about as much as the
// selection.  The mask is all zero between calls.
#include "common.h"

namespace {

thread_local std::vector<uint8_t> t_mask;  // 1: excluded; 0 between calls
thread_local std::vector<uint32_t> t_cand;
thread_local std::vector<uint32_t> t_count;

// The victims found so far: runs of ascending slots, one per round that chose some.
struct Chosen {
  uint32_t* slots;  // room for every candidate + 1 (branch-free appends)
  int64_t n = 0;
  std::vector<int64_t> runs;  // start of each run
};
thread_local std::vector<uint32_t> t_chosen;

// One histogram-and-partition round over the listed slots c[0, m): bucket(v) is
// nondecreasing in v, below nbuckets.  Appends to `chosen` the slots of the buckets below
// the one holding the r-th smallest value, keeps that bucket's slots at the front of
// c (in their order), sets m to their count and r to how many of them are still to
// choose; returns the bucket.
template <class T, class B>
uint64_t round_of(const T* col, uint32_t* c, int64_t& m, int64_t& r, uint64_t nbuckets, B bucket, Chosen& chosen) {
  std::vector<uint32_t>& countv = t_count;
  if (countv.size() < nbuckets) countv.resize(nbuckets);
  uint32_t* count = countv.data();
  std::fill(count, count + nbuckets, 0u);
  for (int64_t i = 0; i < m; ++i) ++count[bucket(col[c[i]])];
  uint64_t b = 0;
  int64_t below = 0;
  while (below + count[b] < r) below += count[b++];
  if (below > 0) chosen.runs.push_back(chosen.n);
  int64_t ties = 0;
  uint32_t* out = chosen.slots + chosen.n;
  int64_t j = 0;
  for (int64_t i = 0; i < m; ++i) {
    // branch-free: a random half may fall either way
    const uint32_t s = c[i];
    const uint64_t d = bucket(col[s]);
    out[j] = s;
    j += d < b;
    c[ties] = s;  // ties <= i: overwrites a slot already read
    ties += d == b;
  }
  chosen.n += j;
  r -= below;
  m = ties;
  return b;
}

// The listed slots c[0, m) (0 < r < m), whose values col[] lie in [lo, hi]: appends
// to `chosen` every slot whose value is below the r-th smallest value, keeps those equal
// to it at the front of c (in their order) and returns how many they are; r becomes
// how many of them are still to choose (1 <= r <= the returned count).
//
// The first round counts the values lo, lo + 1, ... one bucket each, all from
// lo + W - 1 up in the last bucket: the victims' ticks and counts are the smallest
// ones, so this settles the column in one round unless the r-th smallest value is
// W or more above the smallest.  Then radix rounds, from the top digit of the span
// of what is left, split the last bucket.
template <class T>
int64_t split_at_rth(const T* col, uint32_t* c, int64_t m, int64_t& r, int64_t lo, int64_t hi, Chosen& chosen) {
  if (lo == hi) return m;
  // wide rounds for many slots, narrow ones for a small group (the fill is the cost)
  auto width = [](int64_t n) { return n >= (1 << 18) ? 16 : n >= (1 << 12) ? 11 : 8; };
  uint64_t base = (uint64_t)lo;  // u = v - base in [0, 2^64): no overflow for any pair of int64
  const uint64_t last = (uint64_t(1) << width(m)) - 1;
  const uint64_t b = round_of(col, c, m, r, last + 1, [&](T v) { return std::min((uint64_t)(int64_t)v - base, last); },
                              chosen);
  if (b < last || r == m) return m;
  base += last;  // what is left: values >= lo + last
  int bits = hi == (int64_t)base ? 0 : 64 - __builtin_clzll((uint64_t)hi - base);
  while (bits > 0 && r < m) {
    const int w = std::min(bits, width(m));
    bits -= w;
    const uint64_t dmask = (uint64_t(1) << w) - 1;
    round_of(col, c, m, r, dmask + 1, [&](T v) { return (((uint64_t)(int64_t)v - base) >> bits) & dmask; }, chosen);
  }
  return m;
}

template <class T>
void span_of(const T* col, const uint32_t* c, int64_t m, int64_t& lo, int64_t& hi) {
  lo = hi = (int64_t)col[c[0]];
  for (int64_t i = 1; i < m; ++i) {
    const int64_t v = (int64_t)col[c[i]];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
}

// Lists the candidates (resident, not masked) into c, ascending; returns how many.
inline int64_t list_candidates(int64_t cap, const int64_t* owner, const uint8_t* mask, uint32_t* c) {
  int64_t n = 0;
  for (int64_t s = 0; s < cap; ++s) {  // branch-free: c has room for cap + 1 entries
    c[n] = (uint32_t)s;
    n += (owner[s] >= 0) & (mask[s] == 0);
  }
  return n;
}

// A column of the order: int32 or int64 values, one per candidate index.
struct Col {
  const void* p = nullptr;
  bool i32 = false;
};

template <class F>
auto visit(const Col& c, F&& f) {
  return c.i32 ? f(static_cast<const int32_t*>(c.p)) : f(static_cast<const int64_t*>(c.p));
}

Col col_of(const he::Call& call, int64_t k, int64_t n, const char* what, bool optional) {
  Col c;
  if (optional && call.numel(k) == 0) return c;
  c.i32 = call.type(k) == HE_I32;
  c.p = c.i32 ? (const void*)call.buf<const int32_t>(k, n, what) : (const void*)call.buf<const int64_t>(k, n, what);
  return c;
}

}  // namespace

// The victim chooser of every store (store/_evict.py, choose_victims): the tiered cache's
// victims and the dynamic store's max_rows / pending eviction.
//   bufs: valid int64 [n] (index s is a candidate when valid[s] >= 0: a cache slot's owner),
//         exclude int64 [n_exclude] (indices that are no candidates), col0, col1, col2 (int32 or
//         int64 [n] each; col1 and col2 optional, empty), out int64 [min(n, want)] (out)
//   ints: min_take, want
// Returns the number of candidates.  When it is >= min_take, writes the min(count, want) smallest
// candidates in lexicographic order of (col0, col1, col2) to out, ascending indices (the last
// column given is unique among candidates, so the set is unique); otherwise writes nothing.
// Entries of exclude that are < 0 are ignored; repeats are fine.
// Fails, writing nothing, with HE_BAD_VALUE for 2^32 indices or more (detail = (n)) or an exclude
// entry >= n (detail = (its index, its value, n)).
HE_KERNEL(he_choose_victims) {
  call.expect(6, 2, 0);
  const int64_t cap = call.numel(0), n_exclude = call.numel(1);
  const int64_t min_take = call.i(0), want = call.i(1);
  const int64_t* owner = call.buf<const int64_t>(0, cap, "valid");
  const int64_t* exclude = call.buf<const int64_t>(1, n_exclude, "exclude");
  Col cols[3] = {col_of(call, 2, cap, "col0", false), col_of(call, 3, cap, "col1", true),
                 col_of(call, 4, cap, "col2", true)};
  if (cols[1].p == nullptr && cols[2].p != nullptr) call.fail(HE_BAD_CALL, "col2 given without col1");
  const int n_cols = cols[2].p != nullptr ? 3 : cols[1].p != nullptr ? 2 : 1;
  int64_t* out = call.buf<int64_t>(5, std::min(cap, std::max<int64_t>(want, 0)), "out");
  if (cap > (int64_t)UINT32_MAX) {
    call.detail({cap});
    call.fail(HE_BAD_VALUE, "%lld indices: at most 2^32 - 1", (long long)cap);
  }
  for (int64_t i = 0; i < n_exclude; ++i)
    if (exclude[i] >= cap) {
      call.detail({i, exclude[i], cap});
      call.fail(HE_BAD_VALUE, "exclude[%lld] = %lld is not an index of the %lld candidates", (long long)i,
                (long long)exclude[i], (long long)cap);
    }
  if (cap == 0) return 0;

  std::vector<uint8_t>& maskv = t_mask;
  if ((int64_t)maskv.size() < cap) maskv.resize(cap, 0);
  uint8_t* mask = maskv.data();
  std::vector<uint32_t>& candv = t_cand;  // sized before the mask is marked: an allocation that fails leaves it clean
  if ((int64_t)candv.size() < cap + 1) candv.resize(cap + 1);
  uint32_t* c = candv.data();
  for (int64_t i = 0; i < n_exclude; ++i)
    if (exclude[i] >= 0) mask[exclude[i]] = 1;
  const int64_t n = list_candidates(cap, owner, mask, c);

  for (int64_t i = 0; i < n_exclude; ++i)  // the mask is all zero between calls
    if (exclude[i] >= 0) mask[exclude[i]] = 0;

  const int64_t k = std::min(n, std::max<int64_t>(want, 0));
  if (n < min_take || k == 0) return n;

  int64_t m = n, r = k;  // choose the r smallest of c[0, m); 0 < r <= m
  std::vector<uint32_t>& chosenv = t_chosen;
  if ((int64_t)chosenv.size() < n + 1) chosenv.resize(n + 1);
  Chosen chosen;
  chosen.slots = chosenv.data();
  for (int j = 0; j < n_cols && r < m; ++j)  // column by column, in rank order
    m = visit(cols[j], [&](auto col) {
      int64_t lo, hi;
      span_of(col, c, m, lo, hi);
      return split_at_rth(col, c, m, r, lo, hi, chosen);
    });
  // r == m: the group is taken whole; else tied in every column (a repeated key): any r of them
  chosen.runs.push_back(chosen.n);
  std::copy(c, c + r, chosen.slots + chosen.n);
  chosen.n += r;
  if (chosen.n != k) call.fail(HE_BAD_CALL, "internal error: chose %lld victims of %lld, not %lld", (long long)chosen.n,
                               (long long)n, (long long)k);
  // the runs (ascending each) merged into one ascending list: a few passes over the victims
  uint32_t* v = chosen.slots;
  for (size_t i = 1; i < chosen.runs.size(); ++i)
    std::inplace_merge(v, v + chosen.runs[i], i + 1 < chosen.runs.size() ? v + chosen.runs[i + 1] : v + k);
  for (int64_t i = 0; i < k; ++i) out[i] = v[i];
  return n;
}
