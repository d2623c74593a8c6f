// The tiered cache's per-id loops (hugeembed/store/_tier_cache.py) and the victim chooser
// every store shares (hugeembed/store/_evict.py, choose_victims).
//
// The chooser: candidates are the indices s with valid[s] >= 0 (for the cache: the resident
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

// ---------------------------------------------------------------- bring-in and write-back
//
// The tier map (store/_tier_cache.py) is one record per logical row, int32 x 3: its cache slot
// (-1: not resident), its accesses while not resident, its record in the file (-1: none; the
// record space's `rec`).  One record is one cache line's share: a miss touches one line, not
// three arrays.  The loops below are the per-id passes of a fetch; the Python twin in
// store/_tier_cache.py does the same with torch ops (the tests compare them).
namespace {
constexpr int64_t kWhere = 0, kFreq = 1, kRec = 2, kMapWidth = 3;

void check_logical(const he::Call& call, const int64_t* logical, int64_t n, int64_t n_map, bool allow_negative) {
  for (int64_t i = 0; i < n; ++i)
    if (logical[i] >= n_map || (!allow_negative && logical[i] < 0)) {
      call.detail({i, logical[i], n_map});
      call.fail(HE_BAD_VALUE, "logical[%lld] = %lld is not a row of the tier map (%lld rows)", (long long)i,
                (long long)logical[i], (long long)n_map);
    }
}
}  // namespace

// Bring-in, first half (reads only): where each id's row is.
//   bufs: map int32 [N * 3], logical int64 [n] (-1: no row), cs int64 [n] (out), miss_pos int64 [n]
//         (out), miss_rec int64 [n] (out)
// cs[i] = the cache slot of logical[i]; -1 where logical[i] < 0; -2 - j where its row is the j-th
// missing one (the ids of one row share j: j counts distinct rows, in first-seen order).
// miss_pos[j] = the first position of the j-th missing row, miss_rec[j] = its record (-1: never
// written: a new row).  Returns the number of missing rows; changes nothing.
// Fails with HE_BAD_VALUE for a logical slot >= N (detail = (index, value, N)).
HE_KERNEL(he_tier_plan) {
  call.expect(5, 0, 0);
  const int64_t n_map = call.numel(0) / kMapWidth, n = call.numel(1);
  int32_t* map = call.buf<int32_t>(0, n_map * kMapWidth, "map");
  const int64_t* logical = call.buf<const int64_t>(1, n, "logical");
  int64_t* cs = call.buf<int64_t>(2, n, "cs");
  int64_t* miss_pos = call.buf<int64_t>(3, n, "miss_pos");
  int64_t* miss_rec = call.buf<int64_t>(4, n, "miss_rec");
  check_logical(call, logical, n, n_map, true);
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = logical[i];
    if (l < 0) {
      cs[i] = -1;
      continue;
    }
    int32_t* rec = map + l * kMapWidth;
    if (rec[kWhere] == -1) {  // a row missing, seen first here: marked with its number until the end
      miss_pos[m] = i;
      miss_rec[m] = rec[kRec];
      rec[kWhere] = (int32_t)(-2 - m);
      ++m;
    }
    cs[i] = rec[kWhere];
  }
  for (int64_t j = 0; j < m; ++j) map[logical[miss_pos[j]] * kMapWidth + kWhere] = -1;
  return m;
}

// Bring-in, second half, once the missing rows are in their cache slots: the map and the
// cache's metadata say so, every id's access is stamped (and, training, counted and its row
// marked dirty, its record then garbage).
//   bufs: 0 map int32 [N * 3], 1 logical int64 [n], 2 keys int64 [n], 3 counts int64 [n]
//         (optional: 1 each), 4 cs int64 [n] (he_tier_plan's; out: every id's cache slot, -1
//         where logical < 0), 5 miss_pos int64 [m], 6 slots int64 [m] (the missing rows' new
//         slots), 7 owner int64 [C], 8 keys of the slots int64 [C], 9 tick int64 [C], 10 dirty
//         uint8 [C], 11 slot_freq int32 [C], 12 live int64 [segments], 13 out int64 [3 + m + n]
//         (accesses, hits, records released, then the segments that became empty)
//   ints: clock, training (0/1), records per segment
// Returns the number of segments that became empty.
HE_KERNEL(he_tier_admit) {
  call.expect(14, 3, 0);
  const int64_t n_map = call.numel(0) / kMapWidth, n = call.numel(1), m = call.numel(5), C = call.numel(7);
  const int64_t clock = call.i(0), training = call.i(1), S = call.i(2);
  int32_t* map = call.buf<int32_t>(0, n_map * kMapWidth, "map");
  const int64_t* logical = call.buf<const int64_t>(1, n, "logical");
  const int64_t* keys = call.buf<const int64_t>(2, n, "keys");
  const int64_t* counts = call.opt<const int64_t>(3, n, "counts");
  int64_t* cs = call.buf<int64_t>(4, n, "cs");
  const int64_t* miss_pos = call.buf<const int64_t>(5, m, "miss_pos");
  const int64_t* slots = call.buf<const int64_t>(6, m, "slots");
  int64_t* owner = call.buf<int64_t>(7, C, "owner");
  int64_t* ckeys = call.buf<int64_t>(8, C, "slot keys");
  int64_t* tick = call.buf<int64_t>(9, C, "tick");
  uint8_t* dirty = call.bytes<uint8_t>(10, C, "dirty");
  int32_t* slot_freq = call.buf<int32_t>(11, C, "slot_freq");
  const int64_t n_seg = call.numel(12);
  int64_t* live = call.buf<int64_t>(12, n_seg, "live");
  int64_t* out = call.buf<int64_t>(13, 3 + m + n, "out");
  if (S < 1) call.fail(HE_BAD_CALL, "records per segment %lld", (long long)S);
  check_logical(call, logical, n, n_map, true);
  for (int64_t j = 0; j < m; ++j)
    if (miss_pos[j] < 0 || miss_pos[j] >= n || slots[j] < 0 || slots[j] >= C || logical[miss_pos[j]] < 0) {
      call.detail({j, miss_pos[j], slots[j]});
      call.fail(HE_BAD_VALUE, "missing row %lld: position %lld, slot %lld (internal error)", (long long)j,
                (long long)miss_pos[j], (long long)slots[j]);
    }
  for (int64_t i = 0; i < n; ++i)
    if (cs[i] >= C || (cs[i] < -1 && -2 - cs[i] >= m) || (cs[i] >= 0 && logical[i] < 0)) {
      call.detail({i, cs[i], C});
      call.fail(HE_BAD_VALUE, "cs[%lld] = %lld: no slot of the cache (%lld) nor a missing row", (long long)i,
                (long long)cs[i], (long long)C);
    }
  for (int64_t j = 0; j < m; ++j) {
    const int64_t i = miss_pos[j], l = logical[i], s = slots[j];
    int32_t* rec = map + l * kMapWidth;
    owner[s] = l;
    ckeys[s] = keys[i];
    slot_freq[s] = rec[kFreq];
    rec[kWhere] = (int32_t)s;
    dirty[s] = rec[kRec] < 0;  // not on disk: must be written if it leaves
  }
  int64_t accesses = 0, missed = 0, released = 0, emptied = 0;
  int64_t* empty_segs = out + 3;
  for (int64_t i = 0; i < n; ++i) {
    if (logical[i] < 0) continue;
    const int64_t c = counts ? counts[i] : 1;
    accesses += c;
    int64_t s = cs[i];
    if (s < 0) {
      s = slots[-2 - s];
      missed += c;
    }
    cs[i] = s;
    tick[s] = clock;
    if (!training) continue;
    if (!dirty[s]) {  // newer than its copy on disk from now on: that record is garbage
      dirty[s] = 1;
      int32_t* rec = map + logical[i] * kMapWidth;
      const int64_t r = rec[kRec];
      if (r >= 0) {
        rec[kRec] = -1;
        const int64_t seg = r / S;
        if (seg < n_seg && --live[seg] == 0) empty_segs[emptied++] = seg;
        ++released;
      }
    }
    slot_freq[s] = (int32_t)std::min<int64_t>((int64_t)slot_freq[s] + c, INT32_MAX);
  }
  out[0] = accesses, out[1] = accesses - missed, out[2] = released;
  return emptied;
}

// Write-back, first half: the dirty rows among the cache `slots` (victims), gathered.
//   bufs: slots int64 [m], owner int64 [C], dirty uint8 [C], rows bytes [C * row_bytes],
//         out_slots int64 [m] (out), out_logical int64 [m] (out), out_rows bytes [m * row_bytes] (out)
//   ints: row_bytes
// Returns d, the dirty ones: out_slots[:d] (in the order of `slots`), their logical rows and rows.
HE_KERNEL(he_tier_dirty_rows) {
  call.expect(7, 1, 0);
  const int64_t m = call.numel(0), C = call.numel(1), rb = call.i(0);
  if (rb < 1) call.fail(HE_BAD_CALL, "row_bytes %lld", (long long)rb);
  const int64_t* slots = call.buf<const int64_t>(0, m, "slots");
  const int64_t* owner = call.buf<const int64_t>(1, C, "owner");
  const uint8_t* dirty = call.bytes<const uint8_t>(2, C, "dirty");
  const char* rows = call.bytes<const char>(3, C * rb, "rows");
  int64_t* out_slots = call.buf<int64_t>(4, m, "out_slots");
  int64_t* out_logical = call.buf<int64_t>(5, m, "out_logical");
  char* out_rows = call.bytes<char>(6, m * rb, "out_rows");
  for (int64_t j = 0; j < m; ++j)
    if (slots[j] < 0 || slots[j] >= C) {
      call.detail({j, slots[j], C});
      call.fail(HE_BAD_VALUE, "slots[%lld] = %lld is not a slot of the cache (%lld)", (long long)j,
                (long long)slots[j], (long long)C);
    }
  int64_t d = 0;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t s = slots[j];
    if (!dirty[s]) continue;
    out_slots[d] = s;
    out_logical[d] = owner[s];
    std::memcpy(out_rows + d * rb, rows + s * rb, (size_t)rb);
    ++d;
  }
  return d;
}

// Write-back, second half (the dirty ones are on disk): cache `slots` back to the free stack.
// Their rows' accesses go to the map, which forgets their slots.
//   bufs: map int32 [N * 3], slots int64 [m], owner int64 [C], dirty uint8 [C], slot_freq int32 [C],
//         free int64 [C] (a stack)
//   ints: nfree (its height)
// Returns the new height.
HE_KERNEL(he_tier_release) {
  call.expect(6, 1, 0);
  const int64_t n_map = call.numel(0) / kMapWidth, m = call.numel(1), C = call.numel(2), nfree = call.i(0);
  int32_t* map = call.buf<int32_t>(0, n_map * kMapWidth, "map");
  const int64_t* slots = call.buf<const int64_t>(1, m, "slots");
  int64_t* owner = call.buf<int64_t>(2, C, "owner");
  uint8_t* dirty = call.bytes<uint8_t>(3, C, "dirty");
  const int32_t* slot_freq = call.buf<const int32_t>(4, C, "slot_freq");
  int64_t* free = call.buf<int64_t>(5, C, "free");
  if (nfree < 0 || nfree + m > C) call.fail(HE_BAD_CALL, "%lld free + %lld released > %lld slots", (long long)nfree,
                                            (long long)m, (long long)C);
  for (int64_t j = 0; j < m; ++j)
    if (slots[j] < 0 || slots[j] >= C || owner[slots[j]] < 0 || owner[slots[j]] >= n_map) {
      call.detail({j, slots[j], C});
      call.fail(HE_BAD_VALUE, "slots[%lld] = %lld holds no row (internal error)", (long long)j, (long long)slots[j]);
    }
  int64_t top = nfree;
  for (int64_t j = 0; j < m; ++j) {
    const int64_t s = slots[j];
    int32_t* rec = map + owner[s] * kMapWidth;
    rec[kFreq] = slot_freq[s];
    rec[kWhere] = -1;
    owner[s] = -1;
    dirty[s] = 0;
    free[top++] = s;
  }
  return top;
}
