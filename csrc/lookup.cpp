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
// Each stage is an internal function below; the exported kernels at the end of the
// file unpack and check their arguments (csrc/call.h) and call it.
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdio>
#include <mutex>
#include <type_traits>

#include "common.h"

namespace {

enum Combiner : int8_t { kSum = 0, kMean = 1, kSqrtn = 2, kNone = 3 };
enum OutOfRange : int8_t { kError = 0, kPrune = 1, kDefault = 2 };
enum Verdict { kDrop, kKeep, kMapDefault, kBadId, kBadWeight };

// Error codes reported in err[0]; err[1] = plan feature, err[2] = position of the
// id in `values`, err[3] = the id.
constexpr int64_t kErrOutOfRange = 1;
constexpr int64_t kErrWeight = 2;
constexpr int64_t kErrOffsets = 3;  // err[2] = sample, err[3] = offsets[bag]
constexpr int64_t kErrEnds = 4;     // (he_lookup_count) the offsets do not run from 0 to len(values)

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

// Static tables up to this many rows deduplicate by direct indexing (8 bytes per
// row of scratch, kept per table); larger or dynamic tables use a hash.
constexpr int64_t kDirectMaxRows = 1 << 16;

struct LookupContext {
  std::mutex mu;  // one lookup at a time per context: the scratch is shared
  std::vector<he::LocalDedup> dedup;    // per thread
  std::vector<he::DirectDedup> direct;  // per table
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

// What he_lookup_pool_direct did: pooled, or left it to the two-stage path (count +
// dedup + pool) because a bag holds bad offsets, an id or a weight to report, or a
// table is dynamic.  Must match hugeembed/functional/_native_stages.py::POOL_DIRECT_*.
enum PoolDirect : int64_t { kPooledDirect = 0, kTwoStage = 1 };

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

}  // namespace

// ---- The exported kernels (csrc/call.h) -------------------------------------------
//
// Every kernel begins with the plan's constant arrays, packed once per plan by
// hugeembed/functional/_native_stages.py::_plan_bufs (two buffers per call, not ten):
//   buf 0  plan_i64  table[F] default_id[F] table_feats[F] num_rows[T] dims[T] table_feat_ptr[T+1]
//   buf 1  plan_i8   prune_neg[F] oor[F] has_default[F] combiner[F]
// and its ints with B, F, T.  The tables' row storages go over as T trailing buffers
// (rows(): the span of a row-strided view) with their row strides W[T] among the ints;
// each kernel builds its own array of row addresses from them.
//
// Checked here, before anything is written: every buffer's type and length against
// B, F, T, D and the counts the earlier stages produced, and every index of the plan.
// Trusted (written by the earlier stages of the same lookup, checked there): the
// contents of out_offsets within each feature's span (he_lookup_count; the spans
// themselves are checked, O(F), and he_lookup_dedup checks every bag as it walks it), of inverse (he_lookup_dedup: each entry <
// capacity) and of slots (the caller: each a row of its table, or -1); checking each
// of those per id would cost the hot loops.

namespace {

// Bounds on sizes and positions from the caller, which keep every product the checks
// below form ((src+1)*B, F*B, row * stride + D, ...) inside int64.
constexpr int64_t kMaxIndex = int64_t(1) << 40;
constexpr int64_t kMaxDim = int64_t(1) << 20;

struct PlanView {
  int64_t B, F, T;
  const int64_t *table, *default_id, *table_feats, *num_rows, *dims, *table_feat_ptr;
  const int8_t *prune_neg, *oor, *has_default, *combiner;
};

PlanView plan_view(const he::Call& call) {
  const int64_t B = call.i(0), F = call.i(1), T = call.i(2);
  if (B < 0 || F < 0 || T < 0 || B > kMaxIndex || F > kMaxDim || T > kMaxDim)
    call.fail(HE_BAD_CALL, "B %lld, F %lld, T %lld out of bounds", (long long)B, (long long)F, (long long)T);
  const int64_t* p = call.buf<const int64_t>(0, 3 * F + 3 * T + 1, "plan_i64");
  const int8_t* q = call.buf<const int8_t>(1, 4 * F, "plan_i8");
  const PlanView v{B,         F,     T,         p,         p + F,     p + 2 * F, p + 3 * F, p + 3 * F + T,
                   p + 3 * F + 2 * T, q, q + F, q + 2 * F, q + 3 * F};
  for (int64_t f = 0; f < F; ++f)
    if (v.table[f] < 0 || v.table[f] >= T)
      call.fail(HE_BAD_CALL, "plan: feature %lld reads table %lld of %lld", (long long)f, (long long)v.table[f],
                (long long)T);
  for (int64_t t = 0; t < T; ++t)
    if (v.dims[t] < 0 || v.dims[t] > kMaxDim)
      call.fail(HE_BAD_CALL, "plan: table %lld has dim %lld", (long long)t, (long long)v.dims[t]);
  if (v.table_feat_ptr[0] != 0 || v.table_feat_ptr[T] > F)
    call.fail(HE_BAD_CALL, "plan: table_feat_ptr spans [%lld, %lld], not within [0, %lld]",
              (long long)v.table_feat_ptr[0], (long long)v.table_feat_ptr[T], (long long)F);
  for (int64_t t = 0; t < T; ++t)
    if (v.table_feat_ptr[t + 1] < v.table_feat_ptr[t])
      call.fail(HE_BAD_CALL, "plan: table_feat_ptr decreases at table %lld", (long long)t);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = v.table_feat_ptr[t]; k < v.table_feat_ptr[t + 1]; ++k)
      if (v.table_feats[k] < 0 || v.table_feats[k] >= F || v.table[v.table_feats[k]] != t)
        call.fail(HE_BAD_CALL, "plan: table_feats[%lld] = %lld, not a feature of table %lld (of %lld features)",
                  (long long)k, (long long)v.table_feats[k], (long long)t, (long long)F);
  // num_rows bounds the row products (table_rows) and the direct dedup's scratch; a
  // default_id a static table maps ids to must be one of its rows (the dedup indexes by it)
  for (int64_t t = 0; t < T; ++t)
    if (v.num_rows[t] < -1 || v.num_rows[t] > kMaxIndex)
      call.fail(HE_BAD_CALL, "plan: table %lld has %lld rows", (long long)t, (long long)v.num_rows[t]);
  for (int64_t f = 0; f < F; ++f) {
    const int64_t n = v.num_rows[v.table[f]];
    if (n >= 0 && (v.has_default[f] || v.oor[f] == kDefault) && (v.default_id[f] < 0 || v.default_id[f] >= n))
      call.fail(HE_BAD_CALL, "plan: feature %lld: default_id %lld outside the %lld rows of table %lld", (long long)f,
                (long long)v.default_id[f], (long long)n, (long long)v.table[f]);
  }
  return v;
}

// a * b + c + d (sizes and positions the checks form), failing where it leaves int64.
int64_t span(const he::Call& call, int64_t a, int64_t b, int64_t c, int64_t d, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r) || __builtin_add_overflow(r, c, &r) || __builtin_add_overflow(r, d, &r))
    call.fail(HE_BAD_CALL, "%s: %lld * %lld + %lld + %lld overflows", what, (long long)a, (long long)b, (long long)c,
              (long long)d);
  return r;
}

// The input batch: values [n_values], offsets (bags of input feature s are
// offsets[s*B .. s*B + B]), weights [n_values] or empty, src [F].
struct Batch {
  const int64_t* values;
  int64_t n_values;
  const int64_t* offsets;
  const float* weights;
  const int64_t* src;
};

Batch batch_view(const he::Call& call, const PlanView& v, int64_t k_values, int64_t k_offsets, int64_t k_weights,
                 int64_t k_src) {
  Batch in;
  in.n_values = call.numel(k_values);
  in.values = call.buf<const int64_t>(k_values, in.n_values, "values");
  in.weights = call.opt<const float>(k_weights, in.n_values, "weights");
  in.src = call.buf<const int64_t>(k_src, v.F, "src");
  const int64_t n_offsets = call.numel(k_offsets);
  int64_t need = 1;
  for (int64_t f = 0; f < v.F; ++f) {
    const int64_t s = in.src[f];
    if (s < 0 || (v.B > 0 && s >= n_offsets / v.B))
      call.fail(HE_BAD_CALL, "src[%lld] = %lld: offsets of %lld entries hold no such feature for B %lld",
                (long long)f, (long long)s, (long long)n_offsets, (long long)v.B);
    need = std::max(need, (s + 1) * v.B + 1);
  }
  in.offsets = call.buf<const int64_t>(k_offsets, need, "offsets");
  return in;
}

// Ids table t reads after cleaning (its share of the unique-key buffer).
int64_t ids_of_table(const PlanView& v, const int64_t* out_offsets, int64_t t) {
  int64_t n = 0;
  for (int64_t k = v.table_feat_ptr[t]; k < v.table_feat_ptr[t + 1]; ++k) {
    const int64_t f = v.table_feats[k];
    n += out_offsets[(f + 1) * v.B] - out_offsets[f * v.B];
  }
  return n;
}

// out_offsets [F*B + 1] from he_lookup_count; returns n_kept (its last entry).
int64_t kept_ids(const he::Call& call, const PlanView& v, int64_t k, const int64_t** out_offsets) {
  *out_offsets = call.buf<const int64_t>(k, v.F * v.B + 1, "out_offsets");
  const int64_t n_kept = (*out_offsets)[v.F * v.B];
  if ((*out_offsets)[0] != 0 || n_kept < 0)
    call.fail(HE_BAD_CALL, "out_offsets runs from %lld to %lld", (long long)(*out_offsets)[0], (long long)n_kept);
  // each feature's span inside [0, n_kept] (O(F); the bags within are trusted, or, in
  // he_lookup_dedup, checked as it walks them)
  for (int64_t f = 0; f < v.F; ++f) {
    const int64_t lo = (*out_offsets)[f * v.B], hi = (*out_offsets)[(f + 1) * v.B];
    if (lo < 0 || hi < lo || hi > n_kept)
      call.fail(HE_BAD_CALL, "out_offsets: feature %lld spans [%lld, %lld) of %lld ids", (long long)f, (long long)lo,
                (long long)hi, (long long)n_kept);
  }
  return n_kept;
}

// Integers k .. k+n-1 of the call.
const int64_t* int_span(const he::Call& call, int64_t k, int64_t n, const char* what) {
  if (n > 0) call.i(k + n - 1);  // fails when not given
  (void)what;
  return call.raw()->ints + k;
}

// Row addresses of the T tables (buffers first .. first+T-1, row strides W[T] from
// int w0), as PoolArgs reads them.  Tables with used[t] must be given, with a row
// stride of at least `dims[t]` and, when min_rows[t] > 0, that many rows.
struct Tables {
  std::vector<int64_t> addr;
  const int64_t* stride;
};

template <class Used, class MinRows>
Tables table_rows(const he::Call& call, const PlanView& v, int64_t first, int64_t w0, Used&& used,
                  MinRows&& min_rows) {
  Tables tabs{std::vector<int64_t>(v.T, 0), int_span(call, w0, v.T, "row strides")};
  for (int64_t t = 0; t < v.T; ++t) {
    if (!used(t)) continue;
    const int64_t D = v.dims[t], W = tabs.stride[t], n = min_rows(t), numel = call.numel(first + t);
    if (W < 0 || W > kMaxIndex || (W < D && numel > D))
      call.fail(HE_BAD_CALL, "table %lld: row stride %lld for dim %lld", (long long)t, (long long)W, (long long)D);
    const float* rows = call.buf<const float>(first + t, n > 0 ? span(call, n - 1, W, D, 0, "table rows") : 0,
                                              "table rows");
    tabs.addr[t] = reinterpret_cast<int64_t>(rows);
  }
  return tabs;
}

// Plan features feats[n] (buffer k) of dim D, each with an int64 position (buffer
// k + 1: an output column or first output row, >= 0); returns n.
int64_t feature_list(const he::Call& call, const PlanView& v, int64_t k, int64_t D, const int64_t** feats,
                     const int64_t** where) {
  const int64_t n = call.numel(k);
  *feats = call.buf<const int64_t>(k, n, "feats");
  *where = call.buf<const int64_t>(k + 1, n, "feature positions");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t f = (*feats)[i];
    if (f < 0 || f >= v.F || v.dims[v.table[f]] != D || (*where)[i] < 0 || (*where)[i] > kMaxIndex)
      call.fail(HE_BAD_CALL, "feats[%lld] = %lld (position %lld) is not a plan feature of dim %lld", (long long)i,
                (long long)f, (long long)(*where)[i], (long long)D);
  }
  return n;
}

// The tables that plan features feats[n] read (the others' rows need not be given), as
// table_rows; min_rows(t) rows each.
template <class MinRows>
Tables tables_read(const he::Call& call, const PlanView& v, int64_t first, int64_t w0, const int64_t* feats,
                   int64_t n, MinRows&& min_rows) {
  std::vector<char> used(v.T, 0);
  for (int64_t k = 0; k < n; ++k) used[v.table[feats[k]]] = 1;
  return table_rows(call, v, first, w0, [&](int64_t t) { return used[t] != 0; }, min_rows);
}

// Buffer k as a pooled output: B rows `ors` apart, feature k's D columns at out_col[k].
float* pooled_out(const he::Call& call, const PlanView& v, int64_t k, int64_t n, const int64_t* out_col, int64_t D,
                  int64_t ors) {
  if (ors < 0 || ors > kMaxDim * kMaxDim) call.fail(HE_BAD_CALL, "out_row_stride %lld", (long long)ors);
  int64_t need = 0;
  for (int64_t i = 0; i < n; ++i)
    if (v.B > 0 && D > 0) need = std::max(need, span(call, v.B - 1, ors, out_col[i], D, "out"));
  return call.buf<float>(k, need, "out");
}

}  // namespace

// Returns a new lookup context (dedup scratch, reused across batches), as an integer
// handle: the one address that crosses the boundary, given back as int 4 of
// he_lookup_dedup and to he_lookup_ctx_free (int 0), which deletes it.
HE_KERNEL(he_lookup_ctx_new) {
  call.expect(0, 0, 0);
  return reinterpret_cast<int64_t>(new LookupContext());
}

HE_KERNEL(he_lookup_ctx_free) {
  call.expect(0, 1, 0);
  delete reinterpret_cast<LookupContext*>(call.i(0));
  return 0;
}

// Stage 1 (count_ids).
//   bufs  0, 1 plan  2 values  3 offsets  4 weights or empty  5 src [F]
//         6 out_offsets [F*B + 1] (out)  7 unique_base [T] (out)  8 totals [2] (out: n_kept, capacity)
//   ints  B F T
// Fails with HE_BAD_VALUE for a bag the cleaning refuses, detail = {code, plan feature,
// position, value}: code kErrOutOfRange or kErrWeight (position of the id in values,
// the id), or kErrOffsets (the sample, offsets[bag + 1]); the first by (feature,
// position).  out_offsets then holds partial counts (nothing else is written).
HE_KERNEL(he_lookup_count) {
  call.expect(9, 3, 0);
  const PlanView v = plan_view(call);
  const Batch in = batch_view(call, v, 2, 3, 4, 5);
  int64_t* out_offsets = call.buf<int64_t>(6, v.F * v.B + 1, "out_offsets");
  int64_t* unique_base = call.buf<int64_t>(7, v.T, "unique_base");
  int64_t* totals = call.buf<int64_t>(8, 2, "totals");
  // The batch's offsets run from 0 to len(values), bags the plan does not read included: a
  // batch that stops short would be pooled without the ids past its end.
  const int64_t n_offsets = call.numel(3);
  if (in.offsets[0] != 0 || in.offsets[n_offsets - 1] != in.n_values) {
    call.detail({kErrEnds, 0, in.offsets[0], in.offsets[n_offsets - 1]});
    call.fail(HE_BAD_VALUE, "offsets run from %lld to %lld, not from 0 to %lld", (long long)in.offsets[0],
              (long long)in.offsets[n_offsets - 1], (long long)in.n_values);
  }
  int64_t err[4] = {0, 0, 0, 0};
  if (count_ids(in.values, in.n_values, in.offsets, in.weights, v.B, v.F, in.src, v.table, v.num_rows, v.prune_neg,
                v.oor, v.has_default, v.default_id, v.combiner, out_offsets, v.T, v.table_feat_ptr, v.table_feats,
                unique_base, totals, err, call.nthreads())) {
    call.detail({err[0], err[1], err[2], err[3]});
    if (err[0] == kErrOffsets)
      call.fail(HE_BAD_VALUE, "plan feature %lld: bag of sample %lld has bad offsets (next offset %lld)",
                (long long)err[1], (long long)err[2], (long long)err[3]);
    call.fail(HE_BAD_VALUE, "plan feature %lld: %s of id %lld at position %lld", (long long)err[1],
              err[0] == kErrWeight ? "non-finite weight" : "out-of-range value", (long long)err[3],
              (long long)err[2]);
  }
  return 0;
}

// Stage 2 (dedup_ids).
//   bufs  0, 1 plan  2 values  3 offsets  4 weights or empty  5 src [F]
//         6 out_offsets [F*B + 1]  7 unique_base [T] (from he_lookup_count)
//         8 inverse int32 [n_kept] (out)  9 out_weights [n_kept] (out; read only with weights)
//         10 unique_keys [capacity] (out)  11 unique_counts int32 [capacity] (out)  12 unique_count [T] (out)
//   ints  B F T deduplicate ctx (he_lookup_ctx_new's handle)
// Fails with HE_BAD_CALL when the batch does not match out_offsets (a bag's offsets
// outside values, or more or fewer kept ids than counted): found while walking the ids,
// so, unlike the other kernels, it may then have written part of inverse, out_weights,
// unique_keys, unique_counts and unique_count (always inside their bounds); the caller
// discards them.  Checking before the walk would cost a second pass over every id.
HE_KERNEL(he_lookup_dedup) {
  call.expect(13, 5, 0);
  const PlanView v = plan_view(call);
  const Batch in = batch_view(call, v, 2, 3, 4, 5);
  const int64_t* out_offsets;
  const int64_t n_kept = kept_ids(call, v, 6, &out_offsets);
  const int64_t* unique_base = call.buf<const int64_t>(7, v.T, "unique_base");
  int64_t capacity = 0;
  for (int64_t t = 0; t < v.T; ++t) {
    int64_t end;
    if (unique_base[t] < 0 || __builtin_add_overflow(unique_base[t], ids_of_table(v, out_offsets, t), &end))
      call.fail(HE_BAD_CALL, "unique_base[%lld] = %lld", (long long)t, (long long)unique_base[t]);
    capacity = std::max(capacity, end);
  }
  int32_t* inverse = call.buf<int32_t>(8, n_kept, "inverse");
  float* out_weights = in.weights ? call.buf<float>(9, n_kept, "out_weights") : nullptr;
  int64_t* unique_keys = call.buf<int64_t>(10, capacity, "unique_keys");
  int32_t* unique_counts = call.buf<int32_t>(11, capacity, "unique_counts");
  int64_t* unique_count = call.buf<int64_t>(12, v.T, "unique_count");
  auto* ctx = reinterpret_cast<LookupContext*>(call.i(4));
  if (!ctx) call.fail(HE_BAD_CALL, "no lookup context");
  if (!dedup_ids(ctx, in.values, in.n_values, in.offsets, in.weights, v.B, v.F, v.T, in.src, v.table, v.num_rows, v.prune_neg, v.oor,
            v.has_default, v.default_id, v.combiner, v.table_feat_ptr, v.table_feats, out_offsets, unique_base,
                 inverse, out_weights, unique_keys, unique_counts, unique_count, call.i(3), call.nthreads()))
    call.fail(HE_BAD_CALL, "the batch does not match out_offsets (not the batch he_lookup_count counted)");
  return 0;
}

// Stage 3 (pool_rows): pools plan features feats (all of dim D): feature feats[k],
// sample b goes to out[b*out_row_stride + out_col[k] .. + D].
//   bufs  0, 1 plan  2 max_norm float32 [T]  3 feats [n]  4 out_col [n]  5 out_offsets [F*B + 1]
//         6 inverse int32 [n_kept]  7 weights [n_kept] or empty  8 slots [capacity]  9 out (out)
//         10 .. 10+T-1 the tables' rows
//   ints  B F T D capacity out_row_stride W[T]
HE_KERNEL(he_lookup_pool) {
  const PlanView v = plan_view(call);
  call.expect(10 + v.T, 6 + v.T, 0);
  const int64_t D = call.i(3), capacity = call.i(4), ors = call.i(5);
  const float* max_norm = call.buf<const float>(2, v.T, "max_norm");
  const int64_t *feats, *out_col;
  const int64_t n = feature_list(call, v, 3, D, &feats, &out_col);
  const int64_t* out_offsets;
  const int64_t n_kept = kept_ids(call, v, 5, &out_offsets);
  const int32_t* inverse = call.buf<const int32_t>(6, n_kept, "inverse");
  const float* weights = call.opt<const float>(7, n_kept, "weights");
  const int64_t* slots = call.buf<const int64_t>(8, capacity, "slots");
  float* out = pooled_out(call, v, 9, n, out_col, D, ors);
  const Tables tabs = tables_read(call, v, 10, 6, feats, n, [](int64_t) { return 0; });
  pool_rows(v.B, n, feats, out_offsets, inverse, weights, slots, v.table, tabs.addr.data(), tabs.stride, max_norm,
            v.combiner, D, out, ors, out_col, call.nthreads());
  return 0;
}

// Unpooled features (unpooled_rows): one row per kept id; feature feats[k]'s rows
// start at out[out_row0[k] * D] (row-major, D columns).
//   bufs  as he_lookup_pool, with 4 out_row0 [n] for out_col
//   ints  B F T D capacity W[T]
HE_KERNEL(he_lookup_unpooled) {
  const PlanView v = plan_view(call);
  call.expect(10 + v.T, 5 + v.T, 0);
  const int64_t D = call.i(3), capacity = call.i(4);
  const float* max_norm = call.buf<const float>(2, v.T, "max_norm");
  const int64_t *feats, *out_row0;
  const int64_t n = feature_list(call, v, 3, D, &feats, &out_row0);
  const int64_t* out_offsets;
  const int64_t n_kept = kept_ids(call, v, 5, &out_offsets);
  const int32_t* inverse = call.buf<const int32_t>(6, n_kept, "inverse");
  const float* weights = call.opt<const float>(7, n_kept, "weights");
  const int64_t* slots = call.buf<const int64_t>(8, capacity, "slots");
  int64_t need = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t f = feats[k];
    need = std::max(need, span(call, out_row0[k] + out_offsets[(f + 1) * v.B] - out_offsets[f * v.B], D, 0, 0, "out"));
  }
  float* out = call.buf<float>(9, need, "out");
  const Tables tabs = tables_read(call, v, 10, 5, feats, n, [](int64_t) { return 0; });
  unpooled_rows(v.B, n, feats, out_offsets, inverse, weights, slots, v.table, tabs.addr.data(), tabs.stride,
                max_norm, v.combiner, D, out, out_row0, call.nthreads());
  return 0;
}

// Stage 4 (backward_rows): table t's gradient rows go to gbuf[gbase[t] ..
// + unique_count[t] * dims[t]].  Feature f's output gradient is gradient buffer
// g_f, from element off_f on, one sample (pooled) or kept id (unpooled) every
// stride_f elements.
//   bufs  0, 1 plan  2 max_norm float32 [T]  3 out_offsets [F*B + 1]  4 inverse int32 [n_kept]
//         5 weights [n_kept] or empty  6 slots [capacity]  7 gbuf (out)
//         8 .. 8+G-1 the output gradients (float32), then T buffers: the tables' rows
//   ints  B F T capacity G  W[T]  unique_base[T]  unique_count[T]  gbase[T]  (g_f, off_f, stride_f) for each f
HE_KERNEL(he_lookup_backward) {
  const PlanView v = plan_view(call);
  const int64_t T = v.T, F = v.F, B = v.B, capacity = call.i(3), G = call.i(4);
  if (G < 0 || G > kMaxDim) call.fail(HE_BAD_CALL, "%lld gradient buffers", (long long)G);
  call.expect(8 + G + T, 5 + 4 * T + 3 * F, 0);
  const int64_t* unique_base = int_span(call, 5 + T, T, "unique_base");
  const int64_t* unique_count = unique_base + T;
  const int64_t* gbase = unique_count + T;
  const int64_t* where = gbase + T;
  const float* max_norm = call.buf<const float>(2, T, "max_norm");
  const int64_t* out_offsets;
  const int64_t n_kept = kept_ids(call, v, 3, &out_offsets);
  const int32_t* inverse = call.buf<const int32_t>(4, n_kept, "inverse");
  const float* weights = call.opt<const float>(5, n_kept, "weights");
  const int64_t* slots = call.buf<const int64_t>(6, capacity, "slots");
  int64_t need = 0;
  if (capacity < 0) call.fail(HE_BAD_CALL, "capacity %lld", (long long)capacity);
  for (int64_t t = 0; t < T; ++t) {
    if (unique_base[t] < 0 || unique_count[t] < 0 || unique_base[t] > capacity ||
        unique_count[t] > capacity - unique_base[t] || gbase[t] < 0 || gbase[t] > kMaxIndex * kMaxDim)
      call.fail(HE_BAD_CALL, "table %lld: unique rows [%lld, +%lld) of %lld, gbase %lld", (long long)t,
                (long long)unique_base[t], (long long)unique_count[t], (long long)capacity, (long long)gbase[t]);
    need = std::max(need, span(call, unique_count[t], v.dims[t], gbase[t], 0, "gbuf"));
  }
  float* gbuf = call.buf<float>(7, need, "gbuf");
  std::vector<int64_t> grad_ptr(F, 0), grad_stride(F, 0);
  for (int64_t f = 0; f < F; ++f) {
    const int64_t g = where[3 * f], off = where[3 * f + 1], stride = where[3 * f + 2];
    const int64_t D = v.dims[v.table[f]];
    // a pooled feature reads one gradient row per sample, an unpooled one per kept id
    const int64_t n = v.combiner[f] == kNone ? out_offsets[(f + 1) * B] - out_offsets[f * B] : B;
    if (g < 0 || g >= G || off < 0 || off > kMaxIndex || stride < 0 || stride > kMaxIndex)
      call.fail(HE_BAD_CALL, "feature %lld: gradient %lld of %lld, offset %lld, stride %lld", (long long)f,
                (long long)g, (long long)G, (long long)off, (long long)stride);
    if (n == 0 || D == 0) continue;
    const float* grad = call.buf<const float>(8 + g, span(call, n - 1, stride, off, D, "output gradient"),
                                              "output gradient");
    grad_ptr[f] = reinterpret_cast<int64_t>(grad + off);
    grad_stride[f] = stride;
  }
  const Tables tabs =
      table_rows(call, v, 8 + G, 5, [&](int64_t t) { return max_norm[t] > 0.0f; }, [](int64_t) { return 0; });
  backward_rows(B, F, T, v.table_feat_ptr, v.table_feats, out_offsets, inverse, weights, slots, tabs.addr.data(),
                tabs.stride, max_norm, v.combiner, unique_base, unique_count, v.dims, grad_ptr.data(), grad_stride.data(),
                gbuf, gbase, call.nthreads());
  return 0;
}

// The one-pass forward of static tables (pool_direct).  Returns kPooledDirect, or
// kTwoStage: the caller then runs count + dedup + pool, which reports the bag at
// fault (out is then garbage).  Every table it reads must hold its num_rows rows.
//   bufs  0, 1 plan  2 max_norm float32 [T]  3 feats [n]  4 out_col [n]  5 values  6 offsets
//         7 weights or empty  8 src [F]  9 out (out)  10 .. 10+T-1 the tables' rows
//   ints  B F T D out_row_stride W[T]
HE_KERNEL(he_lookup_pool_direct) {
  const PlanView v = plan_view(call);
  call.expect(10 + v.T, 5 + v.T, 0);
  const int64_t D = call.i(3), ors = call.i(4);
  const float* max_norm = call.buf<const float>(2, v.T, "max_norm");
  const int64_t *feats, *out_col;
  const int64_t n = feature_list(call, v, 3, D, &feats, &out_col);
  const Batch in = batch_view(call, v, 5, 6, 7, 8);
  float* out = pooled_out(call, v, 9, n, out_col, D, ors);
  // ids are checked against num_rows in the loops: rows up to there are all it reads
  const Tables tabs = tables_read(call, v, 10, 5, feats, n, [&](int64_t t) { return v.num_rows[t]; });
  return pool_direct(in.values, in.n_values, in.offsets, in.weights, v.B, v.F, in.src, v.table, v.num_rows,
                     v.prune_neg, v.oor, v.has_default, v.default_id, v.combiner, n, feats, tabs.addr.data(),
                     tabs.stride, max_norm, D, out, ors, out_col, call.nthreads());
}
