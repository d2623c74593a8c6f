// The serving lookup's pooling of quantized rows (csrc/serve.cpp's he_serve_pool): each bag's rows, in
// torch's embedding_bag_byte_prepack / embedding_bag_4bit_prepack layouts, dequantized and summed to the
// floats torch's quantized embedding_bag ops (FBGEMM's kernels) give, bit for bit: per row and value
// out = fma(scale, q, out + bias), rows in bag order, from out = 0.
//   int8: D bytes, then float32 scale and bias.  int4: D / 2 bytes (value 2k the low nibble of byte k,
//   2k + 1 the high one), then float16 scale and bias.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace he::serve {

// IEEE half to float, exactly (every half is a float).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) bits = sign | 0x7F800000 | (man << 13);  // inf, nan
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) bits = sign;
  else {  // subnormal: man * 2^-24
    const float v = (float)man * 0x1p-24f;
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct QuantRows {
  const uint8_t* data;
  int64_t width;  // bytes a row
  int64_t dim;
  int bits;  // 8 or 4

  const uint8_t* row(int64_t r) const { return data + r * width; }
  // Both ends of the row: a row of int8 d64 (72 bytes) spans two cache lines.
  void prefetch(int64_t r) const {
    const uint8_t* p = row(r);
    __builtin_prefetch(p);
    __builtin_prefetch(p + width - 1);
  }
  void scale_bias(const uint8_t* p, float* scale, float* bias) const {
    if (bits == 8) {
      std::memcpy(scale, p + dim, 4);
      std::memcpy(bias, p + dim + 4, 4);
    } else {
      uint16_t h[2];
      std::memcpy(h, p + dim / 2, 4);
      *scale = half_to_float(h[0]);
      *bias = half_to_float(h[1]);
    }
  }
  uint8_t value(const uint8_t* p, int64_t j) const { return bits == 8 ? p[j] : (uint8_t)((p[j >> 1] >> ((j & 1) * 4)) & 15); }
};

// Values [j0, D) of row p into acc, one at a time (the portable build; the vector path's tail).
inline void accumulate_scalar(const QuantRows& q, const uint8_t* p, float scale, float bias, int64_t j0, float* acc) {
  for (int64_t j = j0; j < q.dim; ++j) acc[j] = std::fma(scale, (float)q.value(p, j), acc[j] + bias);
}

#if defined(__AVX2__)
// FMA is not implied by -mavx2: these functions ask for it, and callers check the CPU has it (every AVX2 x86
// CPU we know of does).
inline bool has_fma() {
  static const bool yes = __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
}

// 8 values of row p from value j as floats.
template <int kBits>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load8(const uint8_t* p, int64_t j) {
  __m128i b;
  if constexpr (kBits == 8) {
    b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + j));
  } else {  // 4 bytes -> 8 values: low nibble first
    int32_t w;
    std::memcpy(&w, p + j / 2, 4);
    const __m128i x = _mm_cvtsi32_si128(w), m = _mm_set1_epi8(15);
    b = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
}

// 32 values of an int4 row p from value j (16 bytes) as 4 x 8 floats: one load, the nibbles split and
// interleaved 16 bytes at a time (per 8 values: a load and the split of 4 bytes each, ~2x the instructions).
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void load32_int4(const uint8_t* p, int64_t j,
                                                                                 __m256 v[4]) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j / 2)), m = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
  const __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);  // values 0-15, 16-31
  v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
  v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
  v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
}

template <int kBits>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void scale_bias_of(const uint8_t* p, int64_t dim, float* scale, float* bias) {
  if constexpr (kBits == 8) {
    std::memcpy(scale, p + dim, 4);
    std::memcpy(bias, p + dim + 4, 4);
  } else {
    uint16_t h[2];
    std::memcpy(h, p + dim / 2, 4);
    *scale = _cvtsh_ss(h[0]);
    *bias = _cvtsh_ss(h[1]);
  }
}

// Outputs from this size on are written around the cache (kStream): batch 4096 x 26 features x d64 writes 27 MB a
// call, which no cache holds for the reader, and plain stores first read each line in (a miss per 64 bytes, as
// many as the rows' own); a small request's output stays in the cache for the dense layers that read it next.
constexpr int64_t kStreamBytes = 4 << 20;

// Bags [j0, j1) (pool_bags), row idx[i + kAhead] prefetched while row idx[i] is added.  kD > 0: D == kD, the
// sums held in registers (kStream: stored with non-temporal stores, out 32-byte aligned); else in out's row.  One
// call a range of bags: a call and its set-up per bag cost as much as a row (most bags hold one id).
template <int kBits, int kD, bool kStream, class O>
__attribute__((target("avx2,fma,f16c"))) void pool_avx2(const QuantRows& q, const O* idx, const O* starts, int64_t j0,
                                                        int64_t j1, int64_t n_bags, int64_t total, float* out) {
  constexpr int64_t kAhead = 8;  // 4 and 16-32 were no faster (int8 d64, Criteo-26)
  const int64_t D = kD > 0 ? kD : q.dim, vec = D / 8 * 8, width = q.width;
  const uint8_t* data = q.data;
  const int64_t end = j1 < n_bags ? (int64_t)starts[j1] : total;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t i0 = starts[j], i1 = j + 1 < n_bags ? (int64_t)starts[j + 1] : total;
    float* o = out + j * D;
    if constexpr (kD > 0) {
      __m256 acc[kD / 8];
      for (int v = 0; v < kD / 8; ++v) acc[v] = _mm256_setzero_ps();
      for (int64_t i = i0; i < i1; ++i) {
        if (i + kAhead < end) {
          const uint8_t* ahead = data + (int64_t)idx[i + kAhead] * width;
          __builtin_prefetch(ahead);
          __builtin_prefetch(ahead + width - 1);
        }
        const uint8_t* p = data + (int64_t)idx[i] * width;
        float s, b;
        scale_bias_of<kBits>(p, D, &s, &b);
        const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
        if constexpr (kBits == 4 && kD % 32 == 0) {
          for (int v = 0; v < kD / 8; v += 4) {
            __m256 x[4];
            load32_int4(p, 8 * v, x);
            for (int u = 0; u < 4; ++u) acc[v + u] = _mm256_fmadd_ps(x[u], vs, _mm256_add_ps(acc[v + u], vb));
          }
        } else {
          for (int v = 0; v < kD / 8; ++v) acc[v] = _mm256_fmadd_ps(load8<kBits>(p, 8 * v), vs, _mm256_add_ps(acc[v], vb));
        }
      }
      for (int v = 0; v < kD / 8; ++v) {
        if constexpr (kStream) _mm256_stream_ps(o + 8 * v, acc[v]);
        else _mm256_storeu_ps(o + 8 * v, acc[v]);
      }
    } else {
      for (int64_t k = 0; k < D; ++k) o[k] = 0.0f;
      for (int64_t i = i0; i < i1; ++i) {
        if (i + kAhead < end) q.prefetch(idx[i + kAhead]);
        const uint8_t* p = data + (int64_t)idx[i] * width;
        float s, b;
        scale_bias_of<kBits>(p, D, &s, &b);
        const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
        int64_t k = 0;
        if constexpr (kBits == 4) {
          for (; k + 32 <= D; k += 32) {
            __m256 x[4];
            load32_int4(p, k, x);
            for (int u = 0; u < 4; ++u)
              _mm256_storeu_ps(o + k + 8 * u, _mm256_fmadd_ps(x[u], vs, _mm256_add_ps(_mm256_loadu_ps(o + k + 8 * u), vb)));
          }
        }
        for (; k < vec; k += 8)
          _mm256_storeu_ps(o + k, _mm256_fmadd_ps(load8<kBits>(p, k), vs, _mm256_add_ps(_mm256_loadu_ps(o + k), vb)));
        for (int64_t k = vec; k < D; ++k) o[k] = std::fma(s, (float)q.value(p, k), o[k] + b);
      }
    }
  }
  if constexpr (kStream) _mm_sfence();  // the streamed sums reach memory before the caller reads them
}
#endif

// The sums of bags [j0, j1) (bag j: ids idx[starts[j], starts[j + 1]), the last one's end `end`) into
// out[j * D, (j + 1) * D).
template <class O>
void pool_bags(const QuantRows& q, const O* idx, const O* starts, int64_t j0, int64_t j1, int64_t n_bags,
               int64_t total, float* out) {
#if defined(__AVX2__)
  if (has_fma()) {
    const bool stream = n_bags * q.dim * 4 >= kStreamBytes && reinterpret_cast<uintptr_t>(out) % 32 == 0;
    if (q.bits == 8 && q.dim == 64) {
      if (stream) pool_avx2<8, 64, true>(q, idx, starts, j0, j1, n_bags, total, out);
      else pool_avx2<8, 64, false>(q, idx, starts, j0, j1, n_bags, total, out);
    } else if (q.bits == 4 && q.dim == 64) {
      if (stream) pool_avx2<4, 64, true>(q, idx, starts, j0, j1, n_bags, total, out);
      else pool_avx2<4, 64, false>(q, idx, starts, j0, j1, n_bags, total, out);
    } else if (q.bits == 8) {
      pool_avx2<8, 0, false>(q, idx, starts, j0, j1, n_bags, total, out);
    } else {
      pool_avx2<4, 0, false>(q, idx, starts, j0, j1, n_bags, total, out);
    }
    return;
  }
#endif
  const int64_t end = j1 < n_bags ? (int64_t)starts[j1] : total;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t i0 = starts[j], i1 = j + 1 < n_bags ? (int64_t)starts[j + 1] : total;
    float* o = out + j * q.dim;
    std::memset(o, 0, sizeof(float) * q.dim);
    for (int64_t i = i0; i < i1; ++i) {
      if (i + 8 < end) q.prefetch(idx[i + 8]);
      const uint8_t* p = q.row(idx[i]);
      float s, b;
      q.scale_bias(p, &s, &b);
      accumulate_scalar(q, p, s, b, 0, o);
    }
  }
}

}  // namespace he::serve
