// The serving lookup's bags pass (csrc/serve.cpp's he_serve_bags and he_serve_index_bags, serve_pool.cpp's
// he_serve_pool): each id's row written to its batch-major bag, over either key index of serve_index.h;
// static tables (key base -1) read the id as the row.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "serve_index.h"

namespace he::serve {

// What the bags pass reads and writes (checked by bags_args); O: int32 or int64, the type of the
// starts, rows and counts it writes (int32 halves what it writes and the kernel after it reads).
template <class O>
struct Bags {
  const int64_t *values, *offsets, *feature_pos, *feature_table, *meta;
  const O* starts;
  int64_t B, F, zero_row;
  O* idx;
  O* kept;  // null: not written (every feature sums)
};

// Samples per block of the bags pass: a block's bags are F * kBlock consecutive batch-major bags, so
// their starts, counts and row indices are written into a few kB (the cache), while each feature's
// offsets and ids are read in runs of kBlock.  Visiting all bags feature-major instead (offsets in
// order, outputs written F * 8 bytes apart over the whole batch) cost ~20 ns a bag at 4096 x 26: the
// cache misses of that transpose, more than a static table's lookup.
constexpr int64_t kBlock = 64;

// Dynamic ids waiting for their rows: probed a batch at a time, in three stages that each run over
// the batch (home slots fetched; the artifact's index: slots read and the keys they name fetched; keys
// compared, chains walked), the batch before's last stage between this one's first two.  So the reads
// of an id overlap with those of the other ids instead of following each other (the index and keys are
// far larger than the cache: each read is a miss).
template <class Index, class O, class Pool>
struct Probes {
  static constexpr int kBatch = 32;
  struct Entry {
    int64_t id, t, s;
    uint64_t h;
    O* out;
  };
  const Index& index;
  const int64_t* meta;
  const Pool& pool;
  Entry batch[2][kBatch];
  int n[2] = {0, 0}, cur = 0;

  void add(int64_t id, int64_t t, O* out) {
    Entry& e = batch[cur][n[cur]++];
    e.id = id, e.t = t, e.out = out;
    if (n[cur] == kBatch) step();
  }
  void step() {  // the current batch's first two stages, the previous one's last
    Entry* now = batch[cur];
    const int k = n[cur];
    for (int i = 0; i < k; ++i) {
      now[i].h = index.home(now[i].id, now[i].t);
      index.prefetch_slot(now[i].h);
    }
    finish(1 - cur);
    for (int i = 0; i < k; ++i) now[i].s = index.fetch(now[i].h);
    cur = 1 - cur;
  }
  void finish(int which) {
    Entry* e = batch[which];
    for (int i = 0; i < n[which]; ++i) {
      const int64_t* m = meta + 5 * e[i].t;
      const int64_t s = index.position_from(e[i].id, e[i].t, m, e[i].h, e[i].s);
      const int64_t row = s >= 0 ? m[0] + (s - m[2]) : m[3];
      *e[i].out = (O)row;
      pool.prefetch(row);  // its miss overlaps the probes still to come
    }
    n[which] = 0;
  }
  void drain() {
    step();  // the last batch's first two stages (and the one before's last)
    finish(1 - cur);
  }
};

// What bags() does with a block's rows once they are written: nothing (he_serve_bags), or pools them
// (PoolRows, he_serve_pool).
struct NoPool {
  static constexpr bool kPools = false;
  void prefetch(int64_t) const {}
  void operator()(int64_t, int64_t) const {}
};

// Blocks of kBlock samples, each block's bags feature by feature (each feature's offsets and ids read in
// order), each id's row written to its batch-major place; static ids at once, dynamic ones through Probes.
// A pool (PoolRows) then sums the block's bags, its rows just read or prefetched: the probes are drained
// at the end of each block for it.
template <class Index, class O, class Pool = NoPool>
void bags(const Bags<O>& a, const Index& index, int64_t nthreads, const Pool& pool = Pool{}) {
  const int64_t B = a.B, F = a.F;
  if (B == 0 || F == 0) return;
  const int64_t blocks = (B + kBlock - 1) / kBlock;
  // one thread per ~16 k bags at least: a 64-row request runs on the caller alone
  he::parallel_for(blocks, (int)nthreads, std::max<int64_t>(1, 16384 / (kBlock * F)), [&](int64_t k0, int64_t k1, int) {
    Probes<Index, O, Pool> probes{index, a.meta, pool};
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t b0 = k * kBlock, b1 = std::min(B, b0 + kBlock);
      for (int64_t f = 0; f < F; ++f) {
        const int64_t t = a.feature_table[f];
        const int64_t* m = a.meta + 5 * t;  // ROW_BASE, NUM, KEY_BASE, MISS_ROW, MAX_PROBE
        const bool dynamic = m[2] >= 0;
        const int64_t* bounds = a.offsets + a.feature_pos[f] * B;
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t j = b * F + f;
          O* out = a.idx + a.starts[j];
          int64_t n = 0;
          for (int64_t i = bounds[b]; i < bounds[b + 1]; ++i, ++out) {
            const int64_t id = a.values[i];
            if (id < 0) {  // dropped: reads the zero row, not counted
              *out = (O)a.zero_row;
              continue;
            }
            ++n;
            if (dynamic) {
              probes.add(id, t, out);
            } else {  // static: the id is the row, fetched now (the pool reads it once the block's probes end)
              const int64_t row = id < m[1] ? m[0] + id : m[3];
              *out = (O)row;
              pool.prefetch(row);
            }
          }
          if (a.kept) a.kept[j] = (O)n;
        }
      }
      if constexpr (Pool::kPools) {
        probes.drain();
        pool(b0 * F, b1 * F);
      }
    }
    if constexpr (!Pool::kPools) probes.drain();
  });
}

// bags() on the index's type; apart from the checked call (and compiled apart from it).
template <class Index, class O, class Pool = NoPool>
__attribute__((noinline)) void run_bags(const Bags<O>& a, const Index& index, int64_t nthreads,
                                        const Pool& pool = Pool{}) {
  bags(a, index, nthreads, pool);
}

// The index, buffer k: int32 or int64 slots, a power-of-two count of them (else HE_BAD_VALUE,
// detail = (kServeBadIndex, capacity)).  Returns the element size.
inline int64_t index_of(const he::Call& call, int64_t k, const void** index, int64_t* cap) {
  *cap = call.numel(k);
  const int64_t type = call.type(k);
  if (type == HE_I32) *index = call.buf<const int32_t>(k, *cap, "index");
  else if (type == HE_I64) *index = call.buf<const int64_t>(k, *cap, "index");
  else call.fail(HE_BAD_CALL, "buffer %lld (index) has element type %lld, expected int32 or int64", (long long)k,
                 (long long)type);
  if (*cap < 1 || (*cap & (*cap - 1)) != 0) {
    call.detail({kServeBadIndex, *cap});
    call.fail(HE_BAD_VALUE, "index capacity %lld is not a power of two", (long long)*cap);
  }
  return type == HE_I32 ? 4 : 8;
}

// The checks and the `starts` of a bags call whose index is buffer 5 (read by the caller): see he_serve_bags.
template <class O>
Bags<O> bags_args(const he::Call& call, int64_t nkeys_min_for_meta, int64_t* total_out) {
  const int64_t B = call.i(0), T = call.i(1), n_rows = call.i(2);
  const int64_t F = call.numel(2);
  if (B < 0 || T < 0 || T > INT64_MAX / 5 || (F > 0 && B > INT64_MAX / F))
    call.fail(HE_BAD_CALL, "B %lld, T %lld, F %lld: need B >= 0, T >= 0", (long long)B, (long long)T, (long long)F);
  const int64_t n_values = call.numel(0), n_offsets = call.numel(1), nkeys = nkeys_min_for_meta;
  Bags<O> a;
  a.B = B;
  a.F = F;
  a.values = call.buf<const int64_t>(0, n_values, "values");
  a.offsets = call.buf<const int64_t>(1, n_offsets, "offsets");
  a.feature_pos = call.buf<const int64_t>(2, F, "feature_pos");
  a.feature_table = call.buf<const int64_t>(3, F, "feature_table");
  const int64_t* meta = call.buf<const int64_t>(6, 5 * T, "meta");
  a.meta = meta;
  O* starts = call.buf<O>(7, B * F, "starts");
  a.starts = starts;
  a.kept = call.opt<O>(9, B * F, "kept");
  if (n_rows < 1) {
    call.detail({kServeBadRows, n_rows});
    call.fail(HE_BAD_VALUE, "no zero row (%lld rows)", (long long)n_rows);
  }
  a.zero_row = n_rows - 1;
  for (int64_t t = 0; t < T; ++t) {  // every row an id can read lies in `rows`
    const int64_t* m = meta + 5 * t;
    if (m[0] < 0 || m[1] < 0 || m[0] + m[1] > n_rows || m[3] < 0 || m[3] >= n_rows || m[4] < 0 ||
        (m[2] >= 0 && m[2] + m[1] > nkeys)) {
      call.detail({kServeBadMeta, t, m[0], m[1], m[2], m[3]});
      call.fail(HE_BAD_VALUE, "table %lld: rows [%lld, +%lld), keys from %lld, miss row %lld, probes %lld outside "
                "%lld rows, %lld keys", (long long)t, (long long)m[0], (long long)m[1], (long long)m[2],
                (long long)m[3], (long long)m[4], (long long)n_rows, (long long)nkeys);
    }
  }
  for (int64_t f = 0; f < F; ++f)
    if (a.feature_table[f] < 0 || a.feature_table[f] >= T || a.feature_pos[f] < 0 ||
        (B > 0 && a.feature_pos[f] >= n_offsets / B)) {  // so feature_pos[f] * B + b stays in int64
      call.detail({kServeBadFeature, f, a.feature_table[f], a.feature_pos[f]});
      call.fail(HE_BAD_VALUE, "feature %lld: table %lld of %lld, input feature %lld", (long long)f,
                (long long)a.feature_table[f], (long long)T, (long long)a.feature_pos[f]);
    }
  // Checked first, feature-major (each feature's offsets read in order), nothing written.
  int64_t total = 0;
  for (int64_t f = 0; f < F; ++f)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t in_bag = a.feature_pos[f] * B + b;
      const bool inside = in_bag + 1 < n_offsets;
      const int64_t i0 = inside ? a.offsets[in_bag] : -1, i1 = inside ? a.offsets[in_bag + 1] : -1;
      if (!inside || i0 < 0 || i1 < i0 || i1 > n_values) {
        const int64_t j = b * F + f;
        call.detail({kServeBadOffsets, j, in_bag, i0, i1});
        call.fail(HE_BAD_VALUE, "bag %lld (input bag %lld): offsets [%lld, %lld) outside %lld values (%lld offsets)",
                  (long long)j, (long long)in_bag, (long long)i0, (long long)i1, (long long)n_values,
                  (long long)n_offsets);
      }
      total += i1 - i0;
    }
  if (total > call.numel(8)) {
    call.detail({kServeBadCapacity, total, call.numel(8)});
    call.fail(HE_BAD_VALUE, "the bags read %lld ids, idx holds %lld", (long long)total, (long long)call.numel(8));
  }
  if (sizeof(O) == 4 && (total > INT32_MAX || n_rows > INT32_MAX)) {
    call.detail({kServeBadCapacity, total, n_rows});
    call.fail(HE_BAD_VALUE, "%lld ids, %lld rows: past int32 starts and rows", (long long)total, (long long)n_rows);
  }
  a.idx = call.buf<O>(8, total, "idx");
  // Each bag's length to its batch-major place in `starts`, a block of samples at a time (see kBlock: the
  // writes of a block fall within a few kB), then summed in place.
  total = 0;
  for (int64_t b0 = 0; b0 < B; b0 += kBlock) {
    const int64_t b1 = std::min(B, b0 + kBlock);
    for (int64_t f = 0; f < F; ++f) {
      const int64_t* at = a.offsets + a.feature_pos[f] * B;
      for (int64_t b = b0; b < b1; ++b) starts[b * F + f] = (O)(at[b + 1] - at[b]);
    }
    for (int64_t j = b0 * F; j < b1 * F; ++j) {  // while the block is in the cache
      const O len = starts[j];
      starts[j] = (O)total;
      total += len;
    }
  }
  *total_out = total;
  return a;
}

// fn(O{}) with O the type of the outputs (starts, buffer 7: int32 or int64; idx and kept must match).
template <class Fn>
void with_outputs(const he::Call& call, Fn&& fn) {
  if (call.type(7) == HE_I32) fn(int32_t{});
  else fn(int64_t{});
}

}  // namespace he::serve
