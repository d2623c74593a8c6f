// Native CPU kernels of a dynamic table group's key index (layout in group_index.h): find,
// find-or-insert with admission and row creation, insert, erase (backward shift) and rehash,
// every one over the keys of all the group's tables at once (a table column beside the keys).
// Called by hugeembed/store/_index_native.py; the plain-PyTorch reference of the same contract is
// hugeembed/store/_index_torch.py.
//
// Find and the maintenance kernels (insert, erase, rehash) are here; find-or-insert, in phases,
// in group_find_or_insert.cpp; what they share in group_probe.h.
#include <cstring>

#include "group_probe.h"

using namespace he::gi;

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
