// The tiered cache's per-id loops (hugeembed/store/_tier_cache.py): the bring-in and the
// write-back over the tier map; the victims are chosen by csrc/victims.cpp.
#include "common.h"

// The tier map (store/_tier_cache.py) is one record per logical row, int32 x 3: its cache slot
// (-1: not resident), its accesses while not resident, its record in the file (-1: none; the
// record space's `rec`).  One record is one cache line's share: a miss touches one line, not
// three arrays.  The loops below are the per-id passes of a fetch; the Python twin in
// store/_tier_cache.py does the same with torch ops (the tests compare them).
namespace {
constexpr int64_t kWhere = 0, kFreq = 1, kRec = 2, kMapWidth = 3;
// Prefetch distance of the loops below, in ids: a batch's rows are scattered over the map (74 MB at
// bench/tiered.py's d64) and the cache (192 MB), so nearly every record is a miss to memory.
constexpr int64_t kAhead = 16;

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
    if (i + kAhead < n && logical[i + kAhead] >= 0) __builtin_prefetch(map + logical[i + kAhead] * kMapWidth, 1);
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
    if (i + kAhead < n && cs[i + kAhead] >= 0) {  // a resident row's slot metadata (the missing ones' are fresh)
      const int64_t a = cs[i + kAhead];
      __builtin_prefetch(tick + a, 1), __builtin_prefetch(slot_freq + a, 1), __builtin_prefetch(dirty + a, 1);
    }
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
//         out_slots int64 [m] (out), out_logical int64 [m] (out), out_rows bytes [m * row_bytes] (out;
//         empty: the rows are not gathered, the write-back writes them from their slots)
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
  char* out_rows = call.numel(6) == 0 ? nullptr : call.bytes<char>(6, m * rb, "out_rows");
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
    if (out_rows) std::memcpy(out_rows + d * rb, rows + s * rb, (size_t)rb);
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
    if (j + kAhead < m) __builtin_prefetch(map + owner[slots[j + kAhead]] * kMapWidth, 1);
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

// Rows copied between two row arrays by index: dst row dst_idx[i] = src row src_idx[i], for i in
// [0, n) (the misses read through the file's mapping into their cache slots, store/_tier_map.py).
// torch's index_select + index_copy_ moved 11 k rows of 260 B at ~1.3 us a row (an element loop
// per row, and a buffer between); here one memcpy a row, the rows kAhead ids on prefetched.
//   bufs: src bytes [N * row_bytes], src_idx int64 [n], dst bytes [C * row_bytes], dst_idx int64 [n]
//   ints: row_bytes
// Returns 0; fails with HE_BAD_VALUE, copying nothing, for an index outside its rows (detail =
// (i, index, rows); which array: the message).
HE_KERNEL(he_copy_rows) {
  call.expect(4, 1, 0);
  const int64_t rb = call.i(0);
  if (rb < 1) call.fail(HE_BAD_CALL, "row_bytes %lld", (long long)rb);
  const int64_t N = call.numel(0) / rb, n = call.numel(1), C = call.numel(2) / rb;
  const char* src = call.bytes<const char>(0, N * rb, "src");
  const int64_t* si = call.buf<const int64_t>(1, n, "src_idx");
  char* dst = call.bytes<char>(2, C * rb, "dst");
  const int64_t* di = call.buf<const int64_t>(3, n, "dst_idx");
  for (int64_t i = 0; i < n; ++i)
    if (si[i] < 0 || si[i] >= N || di[i] < 0 || di[i] >= C) {
      const bool s = si[i] < 0 || si[i] >= N;
      call.detail({i, s ? si[i] : di[i], s ? N : C});
      call.fail(HE_BAD_VALUE, "%s[%lld] = %lld is not a row (%lld rows)", s ? "src_idx" : "dst_idx", (long long)i,
                (long long)(s ? si[i] : di[i]), (long long)(s ? N : C));
    }
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const char* p = src + si[i + kAhead] * rb;
      char* q = dst + di[i + kAhead] * rb;
      for (int64_t b = 0; b < rb; b += 64) __builtin_prefetch(p + b), __builtin_prefetch(q + b, 1);
    }
    std::memcpy(dst + di[i] * rb, src + si[i] * rb, (size_t)rb);
  }
  return 0;
}
