// Deterministic, counter-based initial rows for embedding tables.
//
// Every value is a pure function of (seed, key, column): no generator state, so a
// key gets the same initial row whatever the batch order, the shard or the device.
// The torch twin is hugeembed/store/_init.py; both evaluate the same double
// expressions, so rows agree to within one float32 ulp (libm vs. torch's log).
//
//   base(key)      = mix64(key ^ mix64(seed + GOLDEN))
//   u(key, col)    = ((mix64(base + col * STREAM) >> 11) + 0.5) * 2^-53     in (0, 1)
//   uniform col j  : low + (high - low) * u'(key, j), u' = the same without the + 0.5
//   normal  col j  : z = Phi^-1(u(key, j))                         (Wichura's AS 241)
//   truncated      : z = Phi^-1(Phi(a) + u(key, j) (Phi(b) - Phi(a))), clamped to [a, b]
//                    (exact sampling, no redraws; Phi(a), Phi(b) come from Python)
#include <cmath>

#include "common.h"

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kStream = 0xD1B54A32D192ED03ULL;

inline double unit(uint64_t base, uint64_t stream) {
  return (double)(he::mix64(base + stream * kStream) >> 11) * 0x1.0p-53;
}

inline double open_unit(uint64_t base, uint64_t stream) {
  return ((double)(he::mix64(base + stream * kStream) >> 11) + 0.5) * 0x1.0p-53;
}

// Wichura (1988), Algorithm AS 241 (PPND16); the coefficients and the Horner order
// are those of hugeembed/store/_init.py.
constexpr double kA[8] = {3.3871328727963666080e0, 1.3314166789178437745e2, 1.9715909503065514427e3,
                          1.3731693765509461125e4, 4.5921953931549871457e4, 6.7265770927008700853e4,
                          3.3430575583588128105e4, 2.5090809287301226727e3};
constexpr double kB[8] = {1.0, 4.2313330701600911252e1, 6.8718700749205790830e2, 5.3941960214247511077e3,
                          2.1213794301586595867e4, 3.9307895800092710610e4, 2.8729085735721942674e4,
                          5.2264952788528545610e3};
constexpr double kC[8] = {1.42343711074968357734e0, 4.63033784615654529590e0, 5.76949722146069140550e0,
                          3.64784832476320460504e0, 1.27045825245236838258e0, 2.41780725177450611770e-1,
                          2.27238449892691845833e-2, 7.74545014278341407640e-4};
constexpr double kD[8] = {1.0, 2.05319162663775882187e0, 1.67638483018380384940e0, 6.89767334985100004550e-1,
                          1.48103976427480074590e-1, 1.51986665636164571966e-2, 5.47593808499534494600e-4,
                          1.05075007164441684324e-9};
constexpr double kE[8] = {6.65790464350110377720e0, 5.46378491116411436990e0, 1.78482653991729133580e0,
                          2.96560571828504891230e-1, 2.65321895265761230930e-2, 1.24266094738807843860e-3,
                          2.71155556874348757815e-5, 2.01033439929228813265e-7};
constexpr double kF[8] = {1.0, 5.99832206555887937690e-1, 1.36929880922735805310e-1, 1.48753612908506148525e-2,
                          7.86869131145613259100e-4, 1.84631831751005468180e-5, 1.42151175831644588870e-7,
                          2.04426310338993978564e-15};

inline double horner(const double* c, double x) {
  double acc = c[7];
  for (int k = 6; k >= 0; --k) acc = acc * x + c[k];
  return acc;
}

inline double inverse_normal_cdf(double p) {
  const double q = p - 0.5;
  if (std::fabs(q) <= 0.425) {
    const double r = 0.180625 - q * q;
    return q * horner(kA, r) / horner(kB, r);
  }
  const double t = std::sqrt(-std::log(std::max(q < 0 ? p : 1.0 - p, 1e-300)));
  const double z = t <= 5.0 ? horner(kC, t - 1.6) / horner(kD, t - 1.6) : horner(kE, t - 5.0) / horner(kF, t - 5.0);
  return q < 0 ? -z : z;
}

}  // namespace

// kind: 0 constant(p0), 1 uniform(low p0, high p1), 2 normal(mean p0, std p1),
// 3 truncated normal(mean p0, std p1, lo p2, hi p3 in std units, Phi(lo) p4, Phi(hi) p5).
// Writes row i into out + (rows ? rows[i] : i) * stride, columns [0, dim).
namespace he {
int64_t init_rows(int64_t kind, const double* params, int64_t seed, const int64_t* keys, int64_t n, int64_t dim,
                  float* out, int64_t stride, const int64_t* rows, int64_t nthreads) {
  const double p0 = params[0], p1 = params[1], p2 = params[2], p3 = params[3], p4 = params[4], p5 = params[5];
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
          for (int64_t j = 0; j < dim; ++j) row[j] = (float)(p0 + p1 * inverse_normal_cdf(open_unit(base, (uint64_t)j)));
          break;
        case 3:
          for (int64_t j = 0; j < dim; ++j) {
            const double z = inverse_normal_cdf(p4 + open_unit(base, (uint64_t)j) * (p5 - p4));
            row[j] = (float)(p0 + p1 * std::min(std::max(z, p2), p3));
          }
          break;
      }
    }
  });
  return 0;
}
}  // namespace he

// The initializer as a kernel (csrc/call.h):
//   bufs  keys int64 [n], out float32 (rows `stride` apart), rows int64 [n] or empty (then
//         row i is row i of out), params float64 [6]
//   ints  kind, seed, dim, stride
// Every target row is checked to lie inside `out` before anything is written.
HE_KERNEL(he_init_rows) {
  call.expect(4, 4, 0);
  const int64_t kind = call.i(0), dim = call.i(2), stride = call.i(3), n = call.numel(0);
  if (kind < 0 || kind > 3 || dim < 0 || stride < dim)
    call.fail(HE_BAD_CALL, "initializer kind %lld, dim %lld, stride %lld", (long long)kind, (long long)dim,
              (long long)stride);
  const int64_t* keys = call.buf<const int64_t>(0, n, "keys");
  const int64_t* rows = call.opt<const int64_t>(2, n, "rows");
  const int64_t extent = call.numel(1);
  for (int64_t i = 0; i < n && dim > 0; ++i) {
    const int64_t r = rows ? rows[i] : i;
    if (r < 0 || extent < dim || r > (extent - dim) / stride) {
      call.detail({i, r});
      call.fail(HE_BAD_VALUE, "row %lld at position %lld lies outside the %lld-element output", (long long)r,
                (long long)i, (long long)extent);
    }
  }
  return he::init_rows(kind, call.buf<const double>(3, 6, "params"), call.i(1), keys, n, dim,
                       call.opt<float>(1, 0, "out"), stride, rows, call.nthreads());
}
