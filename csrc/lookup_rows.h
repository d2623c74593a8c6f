// What the kernels that read table rows share (lookup_pool.cpp, lookup_pool_direct.cpp,
// lookup_backward.cpp): TF's clip, the row addresses, prefetching, the split of a
// pooling pass into work items, streaming stores, a bag's sum and its combined output row,
// and the dims the loops know at compile time.
#pragma once

#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdio>
#include <type_traits>

#include "lookup.h"

namespace he_lookup {

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

// The general pooling loops' end of a bag (lookup_pool.cpp, lookup_pool_direct.cpp): the
// weighted sum `acc` divided by the combiner's divisor (mean: the sum of the weights, sqrtn: the
// square root of the sum of their squares) into the output row `o`; a divisor of 0 (an empty bag)
// and sum write the sum itself.  Inlined, so a loop's compile-time D stays a constant here.
__attribute__((always_inline)) inline void write_combined(float* __restrict o, const float* __restrict acc,
                                                          int64_t D, int8_t c, float wsum, float w2sum) {
  if (c == kMean && wsum > 0.0f) {
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / wsum;
  } else if (c == kSqrtn && w2sum > 0.0f) {
    const float sq = std::sqrt(w2sum);
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / sq;
  } else {
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d];
  }
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

}  // namespace he_lookup
