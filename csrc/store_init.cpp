// Deterministic, counter-based initial rows for embedding tables.
//
// Every value is a pure function of (seed, key, column): no generator state, so a
// key gets the same initial row whatever the batch order, the shard or the device.
// The torch twin is hugeembed/store/_init.py; both evaluate the same double
// expressions, so rows agree to within one float32 ulp (libm vs. torch's log/cos).
//
//   base(key)      = mix64(key ^ mix64(seed + GOLDEN))
//   u(key, stream) = (mix64(base + stream * STREAM) >> 11) * 2^-53      in [0, 1)
//   uniform col j  : low + (high - low) * u(key, j)
//   normal  col j  : pair q = j / 2, attempt a, stream s = a * 2^40 + 2q
//                    r = sqrt(-2 log(1 - u(s))), t = 2 pi u(s + 1)
//                    z = r cos t (j even) or r sin t (j odd)      (Box-Muller)
//   truncated      : z outside [lo, hi] std is redrawn with attempt a + 1; after
//                    kMaxAttempts it is clamped into [lo, hi] (probability ~1e-80)
#include <cmath>

#include "common.h"
#include "common.h"

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kStream = 0xD1B54A32D192ED03ULL;
constexpr double kTwoPi = 6.283185307179586;  // the double nearest 2 pi, as in torch
constexpr int kMaxAttempts = 64;

inline double unit(uint64_t base, uint64_t stream) {
  return (double)(he::mix64(base + stream * kStream) >> 11) * 0x1.0p-53;
}

inline double normal(uint64_t base, int64_t col, int64_t attempt) {
  uint64_t s = ((uint64_t)attempt << 40) + 2 * (uint64_t)(col >> 1);
  double r = std::sqrt(-2.0 * std::log(1.0 - unit(base, s)));
  double t = kTwoPi * unit(base, s + 1);
  return (col & 1) ? r * std::sin(t) : r * std::cos(t);
}

}  // namespace

// kind: 0 constant(p0), 1 uniform(low p0, high p1), 2 normal(mean p0, std p1),
// 3 truncated normal(mean p0, std p1, lo p2, hi p3 in std units).
// Writes row i into out + (rows ? rows[i] : i) * stride, columns [0, dim).
HE_API int64_t he_init_rows(int64_t kind, const double* params, int64_t seed, const int64_t* keys, int64_t n,
                            int64_t dim, float* out, int64_t stride, const int64_t* rows, int64_t nthreads) {
  if (kind < 0 || kind > 3) return 1;
  const double p0 = params[0], p1 = params[1], p2 = params[2], p3 = params[3];
  const uint64_t seed_mix = he::mix64((uint64_t)seed + kGolden);
  const int64_t chunk = 512;  // rows per work item
  he::run_items((n + chunk - 1) / chunk, nthreads, [&](int64_t c) {
    for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) {
      float* row = out + (rows ? rows[i] : i) * stride;
      const uint64_t base = he::mix64((uint64_t)keys[i] ^ seed_mix);
      switch (kind) {
        case 0:
          for (int64_t j = 0; j < dim; ++j) row[j] = (float)p0;
          break;
        case 1:
          for (int64_t j = 0; j < dim; ++j) row[j] = (float)(p0 + (p1 - p0) * unit(base, (uint64_t)j));
          break;
        case 2:
          for (int64_t j = 0; j < dim; j += 2) {
            // One Box-Muller pair gives columns j and j + 1.
            double r = std::sqrt(-2.0 * std::log(1.0 - unit(base, (uint64_t)j)));
            double t = kTwoPi * unit(base, (uint64_t)j + 1);
            row[j] = (float)(p0 + p1 * (r * std::cos(t)));
            if (j + 1 < dim) row[j + 1] = (float)(p0 + p1 * (r * std::sin(t)));
          }
          break;
        case 3:
          for (int64_t j = 0; j < dim; j += 2) {
            double r = std::sqrt(-2.0 * std::log(1.0 - unit(base, (uint64_t)j)));
            double t = kTwoPi * unit(base, (uint64_t)j + 1);
            double z[2] = {r * std::cos(t), r * std::sin(t)};
            for (int64_t c = j; c < std::min(dim, j + 2); ++c) {
              double v = z[c - j];
              for (int a = 1; (v < p2 || v > p3) && a < kMaxAttempts; ++a) v = normal(base, c, a);
              v = std::min(std::max(v, p2), p3);
              row[c] = (float)(p0 + p1 * v);
            }
          }
          break;
      }
    }
  });
  return 0;
}
