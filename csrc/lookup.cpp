// Fused multi-table embedding lookup: the CPU kernels behind hugeembed.functional.
//
// One lookup over F "plan features" (each reads one input feature of a
// SparseFeatures batch and one table) runs as
//   1. he_lookup_count   clean: per bag, count the ids that survive TF's rules
//                        (id < 0 dropped, weight <= 0 dropped, out-of-range ids of
//                        static tables -> error / prune / default_id) plus the
//                        default_id filling an empty pooled bag;
//   2. he_lookup_dedup   dedup: per table, unique keys in first-seen order, their
//                        occurrence counts, and each kept id's index into them;
//   (the caller maps unique keys to row slots: identity for static tables,
//    find-or-insert for hash tables)
//   3. he_lookup_pool    pool: per dim group, gather rows by slot, clip to max_norm,
//                        weight, and reduce each bag with its combiner straight
//                        into the output [B, F_g, D] (or any strided layout);
//      he_lookup_unpooled  the same without reduction, one row per id;
//   4. he_lookup_backward  per table, the gradient of each unique row: the
//                        weighted segment sum of the output gradient, then the
//                        Jacobian of max_norm clipping.  Never a dense gradient.
// The torch twin of each stage is hugeembed/functional/_reference.py; the tests
// check both against a NumPy oracle of TF's documented semantics.
//
// Each stage is a function below (declared in lookup.h); the exported kernels in
// lookup_call.cpp unpack and check their arguments (csrc/call.h) and call it.
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdio>
#include <mutex>
#include <type_traits>

#include "lookup.h"

namespace he_lookup {

struct Plan {
  int64_t B, F;
  const int64_t* src;        // [F] input feature read by each plan feature
  const int64_t* table;      // [F] table of each plan feature
  const int64_t* num_rows;   // [T] rows of static tables, -1 for dynamic
  const int8_t* prune_neg;   // [F] drop ids < 0
  const int8_t* oor;         // [F] OutOfRange policy
  const int8_t* has_default; // [F]
  const int64_t* default_id; // [F]
  const int8_t* combiner;    // [F]
};

inline Verdict classify(const Plan& p, int64_t f, int64_t id, const float* w, int64_t i) {
  if (w) {
    float x = w[i];
    if (!std::isfinite(x)) return kBadWeight;
    if (!(x > 0.0f)) return kDrop;
  }
  if (id < 0 && p.prune_neg[f]) return kDrop;
  int64_t n = p.num_rows[p.table[f]];
  if (n >= 0 && (id < 0 || id >= n)) {
    switch (p.oor[f]) {
      case kPrune: return kDrop;
      case kDefault: return kMapDefault;
      default: return kBadId;
    }
  }
  return kKeep;
}

inline bool fills_empty(const Plan& p, int64_t f) {
  return p.has_default[f] && p.combiner[f] != kNone;
}

// First error by (feature, position), whichever thread finds it.
struct ErrorSlot {
  std::mutex mu;
  int64_t* err;
  void report(int64_t code, int64_t f, int64_t pos, int64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    if (err[0] == 0 || f < err[1] || (f == err[1] && pos < err[2])) {
      err[0] = code;
      err[1] = f;
      err[2] = pos;
      err[3] = id;
    }
  }
};

// Stage 1.  out_lengths[f*B + b] = ids of bag (f, b) kept after cleaning.
// Returns 0, or an error code with err[0..3] filled.
int64_t count_ids(const int64_t* values, int64_t n_values, const int64_t* offsets,
                  const float* weights, int64_t B, int64_t F, const int64_t* src, const int64_t* table,
                  const int64_t* num_rows, const int8_t* prune_neg, const int8_t* oor,
                  const int8_t* has_default, const int64_t* default_id,
                  const int8_t* combiner, int64_t* out_offsets, int64_t T,
                  const int64_t* table_feat_ptr, const int64_t* table_feats, int64_t* unique_base,
                  int64_t* totals, int64_t* err, int nthreads) {
  // Bag lengths go to out_offsets[1..], then a prefix sum turns them into offsets:
  // no torch op between the kernels (each would wake torch's OpenMP workers, which
  // then spin on the core our threads need).
  int64_t* out_lengths = out_offsets + 1;
  Plan p{B, F, src, table, num_rows, prune_neg, oor, has_default, default_id, combiner};
  ErrorSlot errs{{}, err};
  err[0] = 0;
  he::parallel_for(F * B, nthreads, 4096, [&](int64_t begin, int64_t end, int) {
    for (int64_t bag = begin; bag < end; ++bag) {
      int64_t f = bag / B, b = bag % B;
      int64_t in_bag = src[f] * B + b;
      int64_t kept = 0;
      // Bounds first: later stages index values[] by these offsets.
      if (offsets[in_bag] < 0 || offsets[in_bag + 1] < offsets[in_bag] || offsets[in_bag + 1] > n_values) {
        errs.report(kErrOffsets, f, b, offsets[in_bag + 1]);
        out_lengths[bag] = 0;
        continue;
      }
      for (int64_t i = offsets[in_bag]; i < offsets[in_bag + 1]; ++i) {
        Verdict v = classify(p, f, values[i], weights, i);
        if (v == kKeep || v == kMapDefault) {
          ++kept;
        } else if (v == kBadId) {
          errs.report(kErrOutOfRange, f, i, values[i]);
        } else if (v == kBadWeight) {
          errs.report(kErrWeight, f, i, values[i]);
        }
      }
      if (kept == 0 && fills_empty(p, f)) kept = 1;
      out_lengths[bag] = kept;
    }
  });
  if (err[0]) return err[0];
  out_offsets[0] = 0;
  for (int64_t i = 1; i <= F * B; ++i) out_offsets[i] += out_offsets[i - 1];
  // Each table's share of the unique-key buffer: at most the number of ids it reads.
  int64_t capacity = 0;
  for (int64_t t = 0; t < T; ++t) {
    unique_base[t] = capacity;
    for (int64_t k = table_feat_ptr[t]; k < table_feat_ptr[t + 1]; ++k) {
      const int64_t f = table_feats[k];
      capacity += out_offsets[(f + 1) * B] - out_offsets[f * B];
    }
  }
  totals[0] = out_offsets[F * B];
  totals[1] = capacity;
  return 0;
}

// The ids of table t's features, deduplicated by `d` (a LocalDedup or DirectDedup).
// Returns false, having written at most inside the bags it was given, when the batch
// does not match out_offsets (a bag's offsets outside values, out_offsets decreasing or
// past its feature's end, or a bag whose kept ids are more or fewer than out_offsets
// counted): each bag's ids are written only to [out_offsets[f*B+b], out_offsets[f*B+b+1]),
// which the caller checked lie inside its feature's span (kept_ids), so the unique keys
// of table t number at most its share of the unique-key buffer.
template <class Dedup>
bool dedup_table(const Plan& p, Dedup& d, int64_t t, int64_t B, const int64_t* values, int64_t n_values,
                 const int64_t* offsets, const float* weights, const int64_t* table_feat_ptr, const int64_t* table_feats,
                 const int64_t* out_offsets, const int64_t* unique_base, int32_t* inverse, float* out_weights,
                 int64_t* unique_keys, int32_t* unique_counts, int64_t* unique_count) {
  const int64_t base = unique_base[t];
  int64_t* ukeys = unique_keys + base;
  int32_t* ucounts = unique_counts + base;
  auto add = [&](int64_t key) -> int32_t {
    bool is_new;
    int32_t u = d.find_or_add(key, is_new);
    if (is_new) {
      ukeys[u] = key;
      ucounts[u] = 1;
    } else {
      ++ucounts[u];
    }
    return (int32_t)(base + u);
  };
  for (int64_t k = table_feat_ptr[t]; k < table_feat_ptr[t + 1]; ++k) {
    const int64_t f = table_feats[k];
    const int64_t f_end = out_offsets[(f + 1) * B];
    for (int64_t b = 0; b < B; ++b) {
      const int64_t in_bag = p.src[f] * B + b;
      const int64_t lo = out_offsets[f * B + b], hi = out_offsets[f * B + b + 1];
      const int64_t i0 = offsets[in_bag], i1 = offsets[in_bag + 1];
      if (hi < lo || hi > f_end || i0 < 0 || i1 < i0 || i1 > n_values) return false;
      int64_t j = lo;
      for (int64_t i = i0; i < i1; ++i) {
        Verdict v = classify(p, f, values[i], weights, i);
        if (v != kKeep && v != kMapDefault) continue;  // errors were raised by stage 1
        if (j == hi) return false;  // more kept ids than counted
        inverse[j] = add(v == kKeep ? values[i] : p.default_id[f]);
        if (out_weights) out_weights[j] = weights[i];
        ++j;
      }
      if (j == lo && fills_empty(p, f)) {
        if (j == hi) return false;
        inverse[j] = add(p.default_id[f]);
        if (out_weights) out_weights[j] = 1.0f;
        ++j;
      }
      if (j != hi) return false;  // fewer: inverse[j..hi) would stay unwritten
    }
  }
  unique_count[t] = d.count;
  return true;
}

// Stage 2 (with deduplicate = 0: every kept id gets its own entry, for forward-only
// lookups).  Writes, for each kept id at output position j (bags laid out by
// out_offsets), inverse[j] = unique_base[t] + its index among table t's unique
// keys and out_weights[j]; unique_keys/unique_counts[unique_base[t] + u] for
// each table; unique_count[t] = number of unique keys of table t.
// table_feat_ptr/table_feats list the plan features of each table (CSR).  Returns
// false when the batch does not match out_offsets (dedup_table; the outputs are then
// partly written).
bool dedup_ids(LookupContext* ctx, const int64_t* values, int64_t n_values, const int64_t* offsets,
               const float* weights, int64_t B, int64_t F, int64_t T,
               const int64_t* src, const int64_t* table, const int64_t* num_rows,
               const int8_t* prune_neg, const int8_t* oor,
               const int8_t* has_default, const int64_t* default_id,
               const int8_t* combiner, const int64_t* table_feat_ptr,
               const int64_t* table_feats, const int64_t* out_offsets,
               const int64_t* unique_base, int32_t* inverse, float* out_weights,
               int64_t* unique_keys, int32_t* unique_counts,
               int64_t* unique_count, int64_t deduplicate, int nthreads) {
  std::lock_guard<std::mutex> lock(ctx->mu);
  Plan p{B, F, src, table, num_rows, prune_neg, oor, has_default, default_id, combiner};
  int threads = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, T));
  if ((int)ctx->dedup.size() < threads) ctx->dedup.resize(threads);
  if ((int64_t)ctx->direct.size() < T) ctx->direct.resize(T);
  std::atomic<bool> ok{true};
  he::parallel_items(T, threads, [&](int64_t t, int tid) {
    int64_t n_ids = 0;
    for (int64_t k = table_feat_ptr[t]; k < table_feat_ptr[t + 1]; ++k) {
      int64_t f = table_feats[k];
      n_ids += out_offsets[(f + 1) * B] - out_offsets[f * B];
    }
    const int64_t rows = num_rows[t];
    if (!deduplicate) {
      he::NoDedup d;
      if (!dedup_table(p, d, t, B, values, n_values, offsets, weights, table_feat_ptr, table_feats, out_offsets,
                       unique_base, inverse, out_weights, unique_keys, unique_counts, unique_count))
        ok.store(false);
    } else if (rows >= 0 && rows <= kDirectMaxRows) {
      he::DirectDedup& d = ctx->direct[t];
      d.reset(rows);
      if (!dedup_table(p, d, t, B, values, n_values, offsets, weights, table_feat_ptr, table_feats, out_offsets,
                       unique_base, inverse, out_weights, unique_keys, unique_counts, unique_count))
        ok.store(false);
    } else {
      he::LocalDedup& d = ctx->dedup[tid];
      d.reset(n_ids);
      if (!dedup_table(p, d, t, B, values, n_values, offsets, weights, table_feat_ptr, table_feats, out_offsets,
                       unique_base, inverse, out_weights, unique_keys, unique_counts, unique_count))
        ok.store(false);
    }
  });
  return ok.load();
}

// TF's clip_by_norm, elementwise exactly as TF computes it:
//   out = (x * c) / max(||x||, c)
// applied only when the table has a max_norm (c > 0).
struct Clip {
  float c = 0.0f;
  float denom = 1.0f;
  bool active = false;
  inline void setup(float max_norm, const float* row, int64_t D) {
    active = max_norm > 0.0f;
    if (!active) return;
    float ss = 0.0f;
    for (int64_t d = 0; d < D; ++d) ss += row[d] * row[d];
    float norm = ss > 0.0f ? std::sqrt(ss) : 0.0f;
    c = max_norm;
    denom = std::max(norm, max_norm);
  }
  inline float operator()(float x) const { return active ? (x * c) / denom : x; }
};

struct PoolArgs {
  int64_t B;
  const int64_t* out_offsets;  // [F*B + 1]
  const int32_t* inverse;
  const float* weights;        // nullable
  const int64_t* slots;        // global unique index -> row slot (-1: zero row)
  const int64_t* table;
  const int64_t* storage;      // [T] base addresses of float32 row storage
  const int64_t* row_stride;   // [T] W
  const float* max_norm;       // [T] 0 = none
  const int8_t* combiner;      // [F]
};

inline const float* row_of(const PoolArgs& a, int64_t t, int64_t slot) {
  return reinterpret_cast<const float*>(a.storage[t]) + slot * a.row_stride[t];
}

// Rows are read at random (Zipf ids over tables of millions of rows): the loop is
// bound by memory latency, not arithmetic.  Prefetching the row of the id this
// many positions ahead overlaps those misses.
constexpr int64_t kPrefetch = 16;

// Samples per work item of the pooling kernels when items are feature-major.
constexpr int64_t kPoolSamples = 512;

// Runs fn(k, b0, b1) over every (feature k, sample range) of a pooling kernel.  Long
// bags (mean >= 4 ids) go feature-major: the threads walk one table at a time
// together, so its hot rows (Zipf ids) stay in cache instead of competing with the
// other tables' (d64 P20: 36 -> 28 ms).  Short bags go sample-major: then writing
// the output rows in order matters more (d64 P1: feature-major was 1.6x slower).
template <class F>
void pool_items(int64_t B, int64_t n_feats, int64_t n_ids, int nthreads, F&& fn) {
  if (n_ids >= 4 * B * n_feats) {
    const int64_t chunks = (B + kPoolSamples - 1) / kPoolSamples;
    he::parallel_items(n_feats * chunks, nthreads, [&](int64_t item, int) {
      const int64_t k = item / chunks, b0 = item % chunks * kPoolSamples;
      fn(k, b0, std::min(B, b0 + kPoolSamples));
    });
  } else {
    he::parallel_for(B, nthreads, 64, [&](int64_t b0, int64_t b1, int) {
      for (int64_t k = 0; k < n_feats; ++k) fn(k, b0, b1);
    });
  }
}

inline void prefetch_row(const float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d, 0, 1);
}

// The size of the L3 cache a core shares, as Linux reports it
// (/sys/devices/system/cpu/cpu0/cache/index3/size, e.g. "32768K"); 32 MiB where it does
// not.  (sysconf's figure comes from CPUID, which a VM may fill with the whole host's:
// 320 MiB here, for 32 MiB seen by the guest.)
inline int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t v = 0;
    if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
      long n = 0;
      char unit = 0;
      if (std::fscanf(f, "%ld%c", &n, &unit) >= 1 && n > 0)
        v = int64_t(n) * (unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1);
      std::fclose(f);
    }
    return v > 0 ? v : int64_t(32) << 20;
  }();
  return bytes;
}

// Whether the pooled rows at out + b*ors + col (b < B) are written with streaming stores
// (write_pooled): an output larger than the last-level cache (a smaller one stays there
// for the next layer), AVX, a dim the loops know at compile time that fills whole vectors,
// and every row 32-byte aligned.
template <int DC>
inline bool streams(const float* out, int64_t B, int64_t ors, int64_t col) {
#if defined(__AVX__)
  return DC != 0 && DC % 8 == 0 && ors % 8 == 0 && reinterpret_cast<uintptr_t>(out + col) % 32 == 0 &&
         B * ors * int64_t(sizeof(float)) >= last_level_cache_bytes();
#else
  (void)out, (void)B, (void)ors, (void)col;
  return false;
#endif
}

// Writes a pooled row from `acc` to its output with streaming stores (where streams()
// said so): an output row is written once and read by the next layer long after, so a
// plain store would first read each of its lines from memory (read for ownership) and
// push table rows out of the cache (d64 P1 forward, 54 MB: 1.7-2x faster streamed).  The
// caller ends its pass with end_streams().
template <int DC>
inline void write_pooled(float* __restrict o, const float* __restrict acc) {
#if defined(__AVX__)
  if constexpr (DC != 0 && DC % 8 == 0)
    for (int64_t d = 0; d < DC; d += 8) _mm256_stream_ps(o + d, _mm256_loadu_ps(acc + d));
#else
  (void)o, (void)acc;
#endif
}

// Orders the streaming stores before whatever the thread does next (they are weakly
// ordered: another thread could otherwise miss them).
inline void end_streams() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

// How the fast pooling loops (no weights, no max_norm) sum a bag's rows: start(o) for the
// bag's output row o, add(row) per row, divide(n) for mean / sqrtn, finish() to write o.
// Each sum makes the same float additions in the same order (0 + x first), so all give
// the same bits.
//
// RegisterSum keeps the sum in ymm registers (AVX, dims 8..64).  A sum kept in memory is
// a load, an add and a store per 8 lanes and row, and each row's loads wait on the
// previous row's stores (d64 P20 forward: 23-27 -> 18 ms).  Stream: finish() writes o
// with streaming stores (see write_pooled), else with plain ones.
#if defined(__AVX__)
template <int DC, bool Stream>
struct RegisterSum {
  static constexpr int N = DC / 8;
  __m256 v[N];
  float* __restrict o = nullptr;
  RegisterSum(float*, int64_t) {}
  inline void start(float* __restrict out) {
    o = out;
    for (int j = 0; j < N; ++j) v[j] = _mm256_setzero_ps();
  }
  inline void add(const float* __restrict row) {
    for (int j = 0; j < N; ++j) v[j] = _mm256_add_ps(v[j], _mm256_loadu_ps(row + 8 * j));
  }
  inline void divide(float n) {
    const __m256 s = _mm256_set1_ps(n);
    for (int j = 0; j < N; ++j) v[j] = _mm256_div_ps(v[j], s);
  }
  inline void finish() {
    for (int j = 0; j < N; ++j) {
      if constexpr (Stream)
        _mm256_stream_ps(o + 8 * j, v[j]);
      else
        _mm256_storeu_ps(o + 8 * j, v[j]);
    }
  }
};
#endif

// The sum in memory: in the output row itself (plain stores, any dim), or, Stream, in a
// buffer written to the output row with streaming stores at the end (dims too wide for the
// registers).
template <int DC, bool Stream>
struct MemorySum {
  const int64_t D_;
  float* acc;      // Stream: the buffer
  float* o = nullptr;
  float* sum = nullptr;  // acc (Stream) or o
  MemorySum(float* acc_, int64_t D) : D_(D), acc(acc_) {}
  inline int64_t dim() const { return DC ? DC : D_; }
  inline void start(float* out) {
    o = out;
    sum = Stream ? acc : out;
    for (int64_t d = 0; d < dim(); ++d) sum[d] = 0.0f;
  }
  inline void add(const float* __restrict row) {
    float* __restrict s = sum;
    for (int64_t d = 0; d < dim(); ++d) s[d] += row[d];
  }
  inline void divide(float n) {
    for (int64_t d = 0; d < dim(); ++d) sum[d] = sum[d] / n;
  }
  inline void finish() {
    if constexpr (Stream) write_pooled<DC>(o, acc);
  }
};

#if defined(__AVX__)
template <int DC>
constexpr bool kFitsRegisters = DC >= 8 && DC <= 64 && DC % 8 == 0;
template <int DC>
using PlainSum = std::conditional_t<kFitsRegisters<DC>, RegisterSum<DC, false>, MemorySum<DC, false>>;
template <int DC>
using StreamedSum = std::conditional_t<kFitsRegisters<DC>, RegisterSum<DC, true>, MemorySum<DC, true>>;
#else
template <int DC>
using PlainSum = MemorySum<DC, false>;
template <int DC>
using StreamedSum = MemorySum<DC, true>;  // never called: streams() is false without AVX
#endif

// The bags of pool_feature's common case (no per-id weights, no max_norm), summed by Sum
// (PlainSum or StreamedSum): rows are summed straight into the output (or registers), a
// one-id bag is a row copy.  Same float operations as pool_feature's general loop
// (0 + x == x exactly), so the results are identical.
template <int DC, class Sum>
inline void pool_bags_fast(const PoolArgs& a, int64_t f, int64_t b0, int64_t b1, int64_t D, float* out,
                           int64_t ors, int64_t col, float* acc) {
  const int64_t t = a.table[f];
  const float* base = reinterpret_cast<const float*>(a.storage[t]);
  const int64_t W = a.row_stride[t];
  const int8_t c = a.combiner[f];
  const int64_t* offs = a.out_offsets + f * a.B;
  const int32_t* inv = a.inverse;
  const int64_t* slots = a.slots;
  const int64_t j_end = offs[b1];
  Sum sum(acc, D);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t j0 = offs[b], j1 = offs[b + 1];
    sum.start(out + b * ors + col);
    for (int64_t j = j0; j < j1; ++j) {
      if (j + kPrefetch < j_end) {
        const int64_t sp = slots[inv[j + kPrefetch]];
        if (sp >= 0) prefetch_row(base + sp * W, D);
      }
      const int64_t s = slots[inv[j]];
      if (s < 0) continue;
      sum.add(base + s * W);
    }
    const float n = (float)(j1 - j0);
    if (c == kMean && n > 0.0f) {
      sum.divide(n);
    } else if (c == kSqrtn && n > 0.0f) {
      sum.divide(std::sqrt(n));
    }
    sum.finish();
  }
}

// Pools bags [b0, b1) of plan feature f into out[b*ors + col].  DC is the
// embedding dim when known at compile time (0: use D) so the inner loops unroll.
template <int DC>
void pool_feature(const PoolArgs& a, int64_t f, int64_t b0, int64_t b1, int64_t D_, float* __restrict out,
                  int64_t ors, int64_t col, float* __restrict acc) {
  const int64_t D = DC ? DC : D_;
  const int64_t t = a.table[f], B = a.B;
  const float* base = reinterpret_cast<const float*>(a.storage[t]);
  const int64_t W = a.row_stride[t];
  const float mn = a.max_norm[t];
  const int8_t c = a.combiner[f];
  const int64_t* offs = a.out_offsets + f * B;
  const int32_t* inv = a.inverse;
  const int64_t* slots = a.slots;
  const float* w = a.weights;
  const int64_t j_end = offs[b1];
  if (!w && !(mn > 0.0f)) {
    pool_bags_fast<DC, PlainSum<DC>>(a, f, b0, b1, D, out, ors, col, acc);
    return;
  }
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    float wsum = 0.0f, w2sum = 0.0f;
    for (int64_t j = offs[b]; j < offs[b + 1]; ++j) {
      if (j + kPrefetch < j_end) {
        int64_t sp = slots[inv[j + kPrefetch]];
        if (sp >= 0) prefetch_row(base + sp * W, D);
      }
      const float wj = w ? w[j] : 1.0f;
      wsum += wj;
      w2sum += wj * wj;
      const int64_t s = slots[inv[j]];
      if (s < 0) continue;  // unknown / not admitted id: a zero row, still counted
      const float* __restrict row = base + s * W;
      if (mn > 0.0f) {
        Clip clip;
        clip.setup(mn, row, D);
        for (int64_t d = 0; d < D; ++d) acc[d] += wj * clip(row[d]);
      } else if (w) {
        for (int64_t d = 0; d < D; ++d) acc[d] += wj * row[d];
      } else {
        for (int64_t d = 0; d < D; ++d) acc[d] += row[d];
      }
    }
    float* __restrict o = out + b * ors + col;
    if (c == kMean && wsum > 0.0f) {
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / wsum;
    } else if (c == kSqrtn && w2sum > 0.0f) {
      const float sq = std::sqrt(w2sum);
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / sq;
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d];
    }
  }
}

// pool_feature's common case (no weights, no max_norm) with each pooled row written with
// streaming stores (streams() said so); anything else is pool_feature's.  Its own
// instance of the loop on purpose: one loop with the target chosen at run time made GCC's
// code for the plain loop 2x slower at d16.
template <int DC>
__attribute__((noinline)) void pool_feature_streamed(const PoolArgs& a, int64_t f, int64_t b0, int64_t b1, int64_t D_,
                                                     float* __restrict out, int64_t ors, int64_t col,
                                                     float* __restrict acc) {
  if (a.weights || a.max_norm[a.table[f]] > 0.0f) return pool_feature<DC>(a, f, b0, b1, D_, out, ors, col, acc);
  pool_bags_fast<DC, StreamedSum<DC>>(a, f, b0, b1, DC ? DC : D_, out, ors, col, acc);
  end_streams();
}

// Calls body.template operator()<DC>() with DC = D for the common dims, else 0.
template <class Body>
void dispatch_dim(int64_t D, Body&& body) {
  switch (D) {
    case 4: body.template operator()<4>(); break;
    case 8: body.template operator()<8>(); break;
    case 16: body.template operator()<16>(); break;
    case 32: body.template operator()<32>(); break;
    case 64: body.template operator()<64>(); break;
    case 128: body.template operator()<128>(); break;
    default: body.template operator()<0>(); break;
  }
}

// Stage 3.  Pools the plan features `feats` (all of dim D) into out: feature
// feats[k], sample b goes to out + b*out_row_stride + out_col[k].  Threads take
// ranges of samples; within a range each feature's ids are walked in order.
void pool_rows(int64_t B, int64_t n_feats, const int64_t* feats,
               const int64_t* out_offsets, const int32_t* inverse,
               const float* weights, const int64_t* slots, const int64_t* table,
               const int64_t* storage, const int64_t* row_stride,
               const float* max_norm, const int8_t* combiner, int64_t D, float* out,
               int64_t out_row_stride, const int64_t* out_col, int nthreads) {
  PoolArgs a{B, out_offsets, inverse, weights, slots, table, storage, row_stride, max_norm, combiner};
  int64_t n_ids = 0;
  for (int64_t k = 0; k < n_feats; ++k) n_ids += out_offsets[(feats[k] + 1) * B] - out_offsets[feats[k] * B];
  pool_items(B, n_feats, n_ids, nthreads, [&](int64_t k, int64_t b0, int64_t b1) {
    std::vector<float> acc(D);
    dispatch_dim(D, [&]<int DC>() {
      if (streams<DC>(out, B, out_row_stride, out_col[k]))
        pool_feature_streamed<DC>(a, feats[k], b0, b1, D, out, out_row_stride, out_col[k], acc.data());
      else
        pool_feature<DC>(a, feats[k], b0, b1, D, out, out_row_stride, out_col[k], acc.data());
    });
  });
}

// Unpooled (sequence) features: one output row per kept id, weighted and clipped.
// Feature feats[k]'s rows start at out + out_row0[k]*D (row-major, D columns).
void unpooled_rows(int64_t B, int64_t n_feats, const int64_t* feats,
                   const int64_t* out_offsets, const int32_t* inverse,
                   const float* weights, const int64_t* slots, const int64_t* table,
                   const int64_t* storage, const int64_t* row_stride,
                   const float* max_norm, const int8_t* combiner, int64_t D,
                   float* out, const int64_t* out_row0, int nthreads) {
  PoolArgs a{B, out_offsets, inverse, weights, slots, table, storage, row_stride, max_norm, combiner};
  for (int64_t k = 0; k < n_feats; ++k) {
    int64_t f = feats[k], t = table[f];
    int64_t first = out_offsets[f * B], n = out_offsets[(f + 1) * B] - first;
    float* o = out + out_row0[k] * D;
    he::parallel_for(n, nthreads, 4096, [&](int64_t i0, int64_t i1, int) {
      for (int64_t i = i0; i < i1; ++i) {
        int64_t j = first + i;
        float w = weights ? weights[j] : 1.0f;
        int64_t s = slots[inverse[j]];
        float* dst = o + i * D;
        if (s < 0) {
          std::fill(dst, dst + D, 0.0f);
          continue;
        }
        const float* row = row_of(a, t, s);
        Clip clip;
        clip.setup(max_norm[t], row, D);
        for (int64_t d = 0; d < D; ++d) dst[d] = w * clip(row[d]);
      }
    });
  }
}

// Stage 4.  For each table t, grad rows of its unique keys:
//   gbuf[gbase[t] + u*D_t + d] = sum over uses j of u: coef_j * grad_out(j)[d]
// with coef_j = w_j (sum), w_j / sum_w (mean), w_j / sqrt(sum_w2) (sqrtn); then,
// for tables with max_norm, the transpose Jacobian of TF's clip_by_norm.
// grad_ptr[f] is the address of feature f's gradient for sample 0 (pooled) or id
// 0 (unpooled); grad_stride[f] the distance between samples (or ids).
template <int DC>
void backward_table(int64_t t, int64_t B, const int64_t* table_feat_ptr, const int64_t* table_feats,
                    const int64_t* out_offsets, const int32_t* inverse, const float* weights,
                    const int64_t* slots, const int64_t* storage, const int64_t* row_stride,
                    const float* max_norm, const int8_t* combiner, const int64_t* unique_base,
                    const int64_t* unique_count, int64_t D_, const int64_t* grad_ptr,
                    const int64_t* grad_stride, float* __restrict g) {
  const int64_t D = DC ? DC : D_;
  const int64_t base = unique_base[t], U = unique_count[t];
  std::fill(g, g + U * D, 0.0f);
  for (int64_t k = table_feat_ptr[t]; k < table_feat_ptr[t + 1]; ++k) {
    const int64_t f = table_feats[k];
    const float* gf = reinterpret_cast<const float*>(grad_ptr[f]);
    const int64_t gs = grad_stride[f];
    const int64_t first = out_offsets[f * B], last = out_offsets[(f + 1) * B];
    if (combiner[f] == kNone) {
      for (int64_t j = first; j < last; ++j) {
        if (j + kPrefetch < last) __builtin_prefetch(g + (int64_t)(inverse[j + kPrefetch] - base) * D, 1, 1);
        const float w = weights ? weights[j] : 1.0f;
        const float* __restrict go = gf + (j - first) * gs;
        float* __restrict dst = g + (int64_t)(inverse[j] - base) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += w * go[d];
      }
      continue;
    }
    if (!weights) {
      // No per-id weights: one coefficient per bag, 1 / denom (= w_j / denom with w_j = 1,
      // the same float as the general loop below).
      const int8_t c = combiner[f];
      for (int64_t b = 0; b < B; ++b) {
        const int64_t j0 = out_offsets[f * B + b], j1 = out_offsets[f * B + b + 1];
        if (j0 == j1) continue;
        const float n = (float)(j1 - j0);
        const float coef = 1.0f / (c == kMean ? n : c == kSqrtn ? std::sqrt(n) : 1.0f);
        const float* __restrict go = gf + b * gs;
        for (int64_t j = j0; j < j1; ++j) {
          if (j + kPrefetch < last) __builtin_prefetch(g + (int64_t)(inverse[j + kPrefetch] - base) * D, 1, 1);
          float* __restrict dst = g + (int64_t)(inverse[j] - base) * D;
          if (coef == 1.0f) {
            for (int64_t d = 0; d < D; ++d) dst[d] += go[d];
          } else {
            for (int64_t d = 0; d < D; ++d) dst[d] += coef * go[d];
          }
        }
      }
      continue;
    }
    for (int64_t b = 0; b < B; ++b) {
      const int64_t j0 = out_offsets[f * B + b], j1 = out_offsets[f * B + b + 1];
      if (j0 == j1) continue;
      float wsum = 0.0f, w2sum = 0.0f;
      if (weights) {
        for (int64_t j = j0; j < j1; ++j) {
          wsum += weights[j];
          w2sum += weights[j] * weights[j];
        }
      } else {
        wsum = w2sum = (float)(j1 - j0);
      }
      const float denom = combiner[f] == kMean ? wsum : combiner[f] == kSqrtn ? std::sqrt(w2sum) : 1.0f;
      const float* __restrict go = gf + b * gs;
      for (int64_t j = j0; j < j1; ++j) {
        if (j + kPrefetch < last) __builtin_prefetch(g + (int64_t)(inverse[j + kPrefetch] - base) * D, 1, 1);
        const float coef = (weights ? weights[j] : 1.0f) / denom;
        float* __restrict dst = g + (int64_t)(inverse[j] - base) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += coef * go[d];
      }
    }
  }
  if (max_norm[t] > 0.0f) {
    const float c = max_norm[t];
    const float* rows = reinterpret_cast<const float*>(storage[t]);
    const int64_t W = row_stride[t];
    for (int64_t u = 0; u < U; ++u) {
      const int64_t s = slots[base + u];
      if (s < 0) continue;
      const float* x = rows + s * W;
      float* gu = g + u * D;
      float ss = 0.0f;
      for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
      const float n = ss > 0.0f ? std::sqrt(ss) : 0.0f;
      if (n >= c && n > 0.0f) {
        // d/dx (x c / n) = (c/n) (I - x x^T / n^2), symmetric.
        float xg = 0.0f;
        for (int64_t d = 0; d < D; ++d) xg += x[d] * gu[d];
        const float a = c / n, bcoef = xg / (n * n);
        for (int64_t d = 0; d < D; ++d) gu[d] = a * (gu[d] - x[d] * bcoef);
      }
      // n < c: out = x c / c, whose derivative is exactly the identity.
    }
  }
}

void backward_rows(int64_t B, int64_t F, int64_t T, const int64_t* table_feat_ptr,
                   const int64_t* table_feats, const int64_t* out_offsets,
                   const int32_t* inverse, const float* weights, const int64_t* slots,
                   const int64_t* storage, const int64_t* row_stride,
                   const float* max_norm, const int8_t* combiner,
                   const int64_t* unique_base, const int64_t* unique_count,
                   const int64_t* dims, const int64_t* grad_ptr,
                   const int64_t* grad_stride, float* gbuf, const int64_t* gbase,
                   int nthreads) {
  he::parallel_items(T, nthreads, [&](int64_t t, int) {
    dispatch_dim(dims[t], [&]<int DC>() {
      backward_table<DC>(t, B, table_feat_ptr, table_feats, out_offsets, inverse, weights, slots, storage,
                         row_stride, max_norm, combiner, unique_base, unique_count, dims[t], grad_ptr,
                         grad_stride, gbuf + gbase[t]);
    });
  });
}

// The bags of pool_direct_feature's common case (no per-id weights, no max_norm): the loop
// of pool_bags_fast, reading the ids themselves; false when a bag holds something the
// two-stage path must report.
template <int DC, class Sum>
inline bool pool_direct_bags_fast(const Plan& p, const int64_t* values, int64_t n_values, const int64_t* offsets,
                                  const PoolArgs& a, int64_t f, int64_t b0, int64_t b1, int64_t D, float* out,
                                  int64_t ors, int64_t col, float* acc) {
  const int64_t t = p.table[f], B = p.B, nrows = p.num_rows[t];
  const float* base = reinterpret_cast<const float*>(a.storage[t]);
  const int64_t W = a.row_stride[t];
  const int8_t c = p.combiner[f];
  const bool fill = fills_empty(p, f);
  const int64_t fill_id = p.default_id[f];
  if (fill && (fill_id < 0 || fill_id >= nrows)) return false;
  const bool prune_neg = p.prune_neg[f];
  const int8_t oor = p.oor[f];
  // Prefetch across bags: a bag of pooling 1-20 is shorter than the prefetch distance.
  const int64_t i_end = std::min(n_values, std::max<int64_t>(0, offsets[p.src[f] * B + b1]));
  Sum sum(acc, D);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t in_bag = p.src[f] * B + b;
    const int64_t i0 = offsets[in_bag], i1 = offsets[in_bag + 1];
    if (i0 < 0 || i1 < i0 || i1 > n_values) return false;
    sum.start(out + b * ors + col);
    int64_t kept = 0;
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kPrefetch < i_end) {
        const int64_t q = values[i + kPrefetch];
        if ((uint64_t)q < (uint64_t)nrows) prefetch_row(base + q * W, D);
      }
      int64_t id = values[i];
      if ((uint64_t)id >= (uint64_t)nrows) {
        if ((id < 0 && prune_neg) || oor == kPrune) continue;
        if (oor != kDefault || (uint64_t)fill_id >= (uint64_t)nrows) return false;
        id = fill_id;
      }
      ++kept;
      sum.add(base + id * W);
    }
    if (kept == 0 && fill) {
      sum.add(base + fill_id * W);
      kept = 1;
    }
    const float n = (float)kept;
    if (c == kMean && n > 0.0f) {
      sum.divide(n);
    } else if (c == kSqrtn && n > 0.0f) {
      sum.divide(std::sqrt(n));
    }
    sum.finish();
  }
  return true;
}

// Pools bags [b0, b1) of plan feature f of a static table straight from the input
// batch: the ids are cleaned as he_lookup_count cleans them and summed in the same
// order with the same float operations as pool_feature, so the output is
// bit-identical to count + dedup(no dedup) + pool.  Returns false when a bag holds
// something the two-stage path must report (bad offsets, id or weight).
template <int DC>
bool pool_direct_feature(const Plan& p, const int64_t* values, int64_t n_values, const int64_t* offsets,
                         const float* w, const PoolArgs& a, int64_t f, int64_t b0, int64_t b1, int64_t D_,
                         float* __restrict out, int64_t ors, int64_t col, float* __restrict acc) {
  const int64_t D = DC ? DC : D_;
  const int64_t t = p.table[f], B = p.B, nrows = p.num_rows[t];
  const float* base = reinterpret_cast<const float*>(a.storage[t]);
  const int64_t W = a.row_stride[t];
  const float mn = a.max_norm[t];
  const int8_t c = p.combiner[f];
  const bool fill = fills_empty(p, f);
  const int64_t fill_id = p.default_id[f];
  if (fill && (fill_id < 0 || fill_id >= nrows)) return false;
  const bool fast = !w && !(mn > 0.0f);
  const bool prune_neg = p.prune_neg[f];
  const int8_t oor = p.oor[f];
  // Prefetch across bags: a bag of pooling 1-20 is shorter than the prefetch distance.
  const int64_t i_end = std::min(n_values, std::max<int64_t>(0, offsets[p.src[f] * B + b1]));
  // pool_direct_bags_fast and the general loop below repeat the id handling on purpose:
  // sharing it (a lambda or inline helpers) made GCC's code for the loop 1.6x slower
  // (measured, d64 P20), so each stays written out.
  if (fast) return pool_direct_bags_fast<DC, PlainSum<DC>>(p, values, n_values, offsets, a, f, b0, b1, D, out, ors, col, acc);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t in_bag = p.src[f] * B + b;
    const int64_t i0 = offsets[in_bag], i1 = offsets[in_bag + 1];
    if (i0 < 0 || i1 < i0 || i1 > n_values) return false;
    float* __restrict o = out + b * ors + col;
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    float wsum = 0.0f, w2sum = 0.0f;  // weighted bags only: else both are `kept`
    int64_t kept = 0;
    // One unsigned compare per id in the common case; TF's rules (as classify) otherwise.
    for (int64_t i = i0; i < i1; ++i) {
      if (i + kPrefetch < i_end) {
        const int64_t q = values[i + kPrefetch];
        if ((uint64_t)q < (uint64_t)nrows) prefetch_row(base + q * W, D);
      }
      int64_t id = values[i];
      float wj = 1.0f;
      if (w) {
        wj = w[i];
        if (!std::isfinite(wj)) return false;
        if (!(wj > 0.0f)) continue;
      }
      if ((uint64_t)id >= (uint64_t)nrows) {
        if (id < 0 && prune_neg) continue;
        if (oor == kPrune) continue;
        if (oor != kDefault || (uint64_t)fill_id >= (uint64_t)nrows) return false;
        id = fill_id;
      }
      ++kept;
      const float* __restrict row = base + id * W;
      if (w) {
        wsum += wj;
        w2sum += wj * wj;
      }
      if (mn > 0.0f) {
        Clip clip;
        clip.setup(mn, row, D);
        for (int64_t d = 0; d < D; ++d) acc[d] += wj * clip(row[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) acc[d] += wj * row[d];
      }
    }
    if (kept == 0 && fill) {  // an empty pooled bag reads default_id's row, weight 1
      const float* __restrict row = base + fill_id * W;
      kept = 1;
      wsum = w2sum = 1.0f;
      if (mn > 0.0f) {
        Clip clip;
        clip.setup(mn, row, D);
        for (int64_t d = 0; d < D; ++d) acc[d] += 1.0f * clip(row[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) acc[d] += 1.0f * row[d];
      }
    }
    if (!w) wsum = w2sum = (float)kept;  // a sum of `kept` ones, exactly
    if (c == kMean && wsum > 0.0f) {
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / wsum;
    } else if (c == kSqrtn && w2sum > 0.0f) {
      const float sq = std::sqrt(w2sum);
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / sq;
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d];
    }
  }
  return true;
}

// pool_direct_feature's fast case (no weights, no max_norm) with each pooled row written
// with streaming stores (streams() said so); anything else is pool_direct_feature's.  Its
// own instance of the loop for the reason pool_feature_streamed is.
template <int DC>
__attribute__((noinline)) bool pool_direct_feature_streamed(const Plan& p, const int64_t* values, int64_t n_values,
                                                            const int64_t* offsets, const float* w, const PoolArgs& a,
                                                            int64_t f, int64_t b0, int64_t b1, int64_t D_,
                                                            float* __restrict out, int64_t ors, int64_t col,
                                                            float* __restrict acc) {
  if (w || a.max_norm[p.table[f]] > 0.0f)
    return pool_direct_feature<DC>(p, values, n_values, offsets, w, a, f, b0, b1, D_, out, ors, col, acc);
  const bool ok =
      pool_direct_bags_fast<DC, StreamedSum<DC>>(p, values, n_values, offsets, a, f, b0, b1, DC ? DC : D_, out, ors,
                                                 col, acc);
  end_streams();  // also when a bag stops the pass: the rows streamed so far are ordered
  return ok;
}

// Forward-only lookup of static tables in one pass over the input (no count, no
// dedup, no intermediate arrays): for inference and evaluation, where no gradient
// needs the per-table unique rows.  Same arguments as count_ids (the plan) and
// pool_rows (the output) together.  Returns kTwoStage when a bag holds bad offsets,
// an id or a weight the caller must report: it then runs the two-stage path, which
// raises with the details (the output is then garbage).
int64_t pool_direct(const int64_t* values, int64_t n_values, const int64_t* offsets,
                    const float* weights, int64_t B, int64_t F, const int64_t* src,
                    const int64_t* table, const int64_t* num_rows, const int8_t* prune_neg,
                    const int8_t* oor, const int8_t* has_default, const int64_t* default_id,
                    const int8_t* combiner, int64_t n_feats, const int64_t* feats,
                    const int64_t* storage, const int64_t* row_stride, const float* max_norm,
                    int64_t D, float* out, int64_t out_row_stride, const int64_t* out_col,
                    int nthreads) {
  Plan p{B, F, src, table, num_rows, prune_neg, oor, has_default, default_id, combiner};
  PoolArgs a{B, nullptr, nullptr, nullptr, nullptr, table, storage, row_stride, max_norm, combiner};
  for (int64_t k = 0; k < n_feats; ++k)
    if (num_rows[table[feats[k]]] < 0) return kTwoStage;  // a dynamic table: not for this path
  std::atomic<bool> bad{false};
  int64_t n_ids = 0;
  for (int64_t k = 0; k < n_feats; ++k) {
    const int64_t f = feats[k];
    const int64_t lo = offsets[src[f] * B], hi = offsets[(src[f] + 1) * B];
    if (lo < 0 || hi < lo || hi > n_values) return kTwoStage;
    n_ids += hi - lo;
  }
  pool_items(B, n_feats, n_ids, nthreads, [&](int64_t k, int64_t b0, int64_t b1) {
    if (bad.load(std::memory_order_relaxed)) return;
    std::vector<float> acc(D);
    dispatch_dim(D, [&]<int DC>() {
      const bool ok =
          streams<DC>(out, B, out_row_stride, out_col[k])
              ? pool_direct_feature_streamed<DC>(p, values, n_values, offsets, weights, a, feats[k], b0, b1, D, out,
                                                 out_row_stride, out_col[k], acc.data())
              : pool_direct_feature<DC>(p, values, n_values, offsets, weights, a, feats[k], b0, b1, D, out,
                                        out_row_stride, out_col[k], acc.data());
      if (!ok) bad.store(true);
    });
  });
  return bad.load() ? kTwoStage : kPooledDirect;
}

}  // namespace he_lookup
