// Sparse optimizer rules of hugeembed.optim, applied in place to the touched rows
// of one table.
//
// Row layout (one table = one row-major float32 buffer `storage[R, W]`): columns
// [0, D) hold the weight, columns [D, D + S) the optimizer state of the row
// (OneEmbedding's size_factor); columns past D + S belong to someone else and are
// never touched.  `slots[U]` are unique row numbers, `grad[U, D]` the summed
// gradient of each touched row.  Rows are unique, so the threads of
// he::parallel_for never write the same row.
//
// Every kernel computes in float32 with the SAME sequence of IEEE operations as
// its plain-PyTorch twin in hugeembed/optim/_*.py (one rounding per +, -, *, /,
// sqrt; hyperparameters rounded once from double to float), so the two agree
// to the last bit.  Reductions over a row (row-wise Adagrad) and powers of
// beta (Adam) are computed in double and rounded once, so a different
// summation order or pow implementation in torch changes the float result only
// in a vanishingly rare tie.  The build uses no -ffast-math and ISO C++17 (so
// GCC does not contract a*b+c into an FMA).
//
// Every kernel first checks all slots (0 <= slot < R) before writing anything
// (rows_of): on a bad slot it fails and the table is unchanged.
#include <cmath>
#include <cstring>
#include <limits>

#include "common.h"

namespace {

// The arguments every rule takes (csrc/call.h): bufs storage float32 [R, W] (row-major),
// slots int64 [U], grad float32 [U, D] (may be empty only where the rule says); ints W, D,
// then the rule's own; reals the rule's hyperparameters.  All slots are checked before
// anything is written: a bad one fails with HE_BAD_VALUE, detail = {position, slot},
// and the table is unchanged.
struct Rows {
  float* storage;
  int64_t R, W, D;
  const int64_t* slots;
  int64_t U;
  const float* grad;
};

// `state(D)`: the rule's state columns after the weights (each row reads and writes D + state).
template <class S>
Rows rows_of(const he::Call& call, int64_t nints, int64_t nreals, S&& state, bool grad_optional = false) {
  call.expect(3, nints, nreals);
  const int64_t W = call.i(0), D = call.i(1);
  const int64_t n = call.numel(0);
  if (W < 1 || D < 0 || D > W || state(D) > W - D || n % W != 0)
    call.fail(HE_BAD_CALL, "storage of %lld floats is not [rows, %lld] holding dim %lld and %lld state columns",
              (long long)n, (long long)W, (long long)D, (long long)state(std::min<int64_t>(std::max<int64_t>(D, 0), W)));
  Rows r{call.buf<float>(0, n, "storage"), n / W, W, D, nullptr, call.numel(1), nullptr};
  r.slots = call.buf<const int64_t>(1, r.U, "slots");
  r.grad = grad_optional ? call.opt<const float>(2, r.U * D, "grad") : call.buf<const float>(2, r.U * D, "grad");
  for (int64_t i = 0; i < r.U; ++i) {
    const int64_t slot = r.slots[i];
    if (slot < 0 || slot >= r.R) {
      call.detail({i, slot});
      call.fail(HE_BAD_VALUE, "slot %lld at position %lld is out of range for a table of %lld rows", (long long)slot,
                (long long)i, (long long)r.R);
    }
  }
  return r;
}

// Rows per thread so that a thread gets at least ~32k element updates: below
// that, spawning a thread costs more than it saves.
int64_t rows_per_thread(int64_t D, int64_t cost = 1) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, D * cost));
}

// Rows are visited in slot order, scattered over a table far larger than the
// caches: each visit is a cache/TLB miss.  Prefetching the row `kAhead` visits
// ahead (for writing) overlaps those misses.
constexpr int64_t kAhead = 12;

// Runs body(i) for i in [b, e), prefetching the `bytes` of row slots[i + kAhead].
template <class F>
inline void for_rows(const float* storage, int64_t W, int64_t bytes, const int64_t* slots, int64_t b, int64_t e,
                     F&& body) {
  for (int64_t i = b; i < e; ++i) {
    if (i + kAhead < e) {
      const char* row = (const char*)(storage + slots[i + kAhead] * W);
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 1, 3);
      __builtin_prefetch(row + bytes - 1, 1, 3);  // the last line when the row is not line-aligned
    }
    body(i);
  }
}

// Integer counters (Adam's per-row step, last-updated step) live in a float
// column as the bit pattern of an int32: exact up to 2^31 - 1, unlike a float
// value (exact only to 2^24).  memcpy avoids type-punning undefined behaviour.
inline int64_t load_counter(const float* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_counter(float* p, int64_t v) {
  int32_t x = (int32_t)v;
  std::memcpy(p, &x, sizeof x);
}

}  // namespace

// SGD: g' = g + wd * w (when wd != 0);  w = w - g' * lr.      (torch.optim.SGD)
static int64_t he_optim_sgd_rows(float* storage, int64_t R, int64_t W, int64_t D, const int64_t* slots, int64_t U,
                            const float* grad, float lr, float weight_decay, int nthreads) {
  he::parallel_for(U, nthreads, rows_per_thread(D), [&](int64_t b, int64_t e, int) {
    for_rows(storage, W, D * 4, slots, b, e, [&](int64_t i) {
      float* w = storage + slots[i] * W;
      const float* g = grad + i * D;
      for (int64_t d = 0; d < D; ++d) {
        float gd = g[d];
        if (weight_decay != 0.f) gd = gd + w[d] * weight_decay;
        w[d] = w[d] - gd * lr;
      }
    });
  });
  return 0;
}

// Momentum SGD with dampening 0 (torch.optim.SGD), state buf at [D, 2D):
//   g' = g + wd * w;  buf = buf * mu + g';  u = nesterov ? g' + buf * mu : buf;  w = w - u * lr.
static int64_t he_optim_momentum_rows(float* storage, int64_t R, int64_t W, int64_t D, const int64_t* slots, int64_t U,
                                 const float* grad, float lr, float momentum, float weight_decay, int nesterov, int nthreads) {
  he::parallel_for(U, nthreads, rows_per_thread(D), [&](int64_t b, int64_t e, int) {
    for_rows(storage, W, 2 * D * 4, slots, b, e, [&](int64_t i) {
      float* w = storage + slots[i] * W;
      float* buf = w + D;
      const float* g = grad + i * D;
      for (int64_t d = 0; d < D; ++d) {
        float gd = g[d];
        if (weight_decay != 0.f) gd = gd + w[d] * weight_decay;
        float nb = buf[d] * momentum + gd;
        buf[d] = nb;
        float u = nesterov ? gd + nb * momentum : nb;
        w[d] = w[d] - u * lr;
      }
    });
  });
  return 0;
}

// Adagrad (torch.optim.Adagrad), state sum at [D, 2D); clr = lr / (1 + (step-1) * lr_decay)
// is computed by the caller:  g' = g + wd * w;  sum = sum + g' * g';  w = w - (g' * clr) / (sqrt(sum) + eps).
static int64_t he_optim_adagrad_rows(float* storage, int64_t R, int64_t W, int64_t D, const int64_t* slots, int64_t U,
                                const float* grad, float clr, float eps, float weight_decay, int nthreads) {
  he::parallel_for(U, nthreads, rows_per_thread(D), [&](int64_t b, int64_t e, int) {
    for_rows(storage, W, 2 * D * 4, slots, b, e, [&](int64_t i) {
      float* w = storage + slots[i] * W;
      float* sum = w + D;
      const float* g = grad + i * D;
      for (int64_t d = 0; d < D; ++d) {
        float gd = g[d];
        if (weight_decay != 0.f) gd = gd + w[d] * weight_decay;
        float s = sum[d] + gd * gd;
        sum[d] = s;
        float std_ = std::sqrt(s) + eps;
        w[d] = w[d] - (gd * clr) / std_;
      }
    });
  });
  return 0;
}

// FBGEMM EXACT_ROWWISE_ADAGRAD (weight_decay_mode L2), one accumulator at column D:
//   g' = g + wd * w;  acc = acc + mean_d(g'^2)  (sum in double, rounded once);
//   mult = lr / (sqrt(acc) + eps);  w = w * (1 - mult * wd) - g * mult.
static int64_t he_optim_rowwise_adagrad_rows(float* storage, int64_t R, int64_t W, int64_t D, const int64_t* slots,
                                        int64_t U, const float* grad, float lr, float eps, float weight_decay, int nthreads) {
  he::parallel_for(U, nthreads, rows_per_thread(D), [&](int64_t b, int64_t e, int) {
    for_rows(storage, W, (D + 1) * 4, slots, b, e, [&](int64_t i) {
      float* w = storage + slots[i] * W;
      const float* g = grad + i * D;
      double sq = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        float gd = g[d];
        if (weight_decay != 0.f) gd = gd + w[d] * weight_decay;
        sq += (double)gd * (double)gd;
      }
      float mean = (float)(sq / (double)D);
      float acc = w[D] + mean;
      w[D] = acc;
      float mult = lr / (std::sqrt(acc) + eps);
      if (weight_decay != 0.f) {
        float corr = 1.f - mult * weight_decay;
        for (int64_t d = 0; d < D; ++d) w[d] = w[d] * corr - g[d] * mult;
      } else {
        for (int64_t d = 0; d < D; ++d) w[d] = w[d] - g[d] * mult;
      }
    });
  });
  return 0;
}

namespace {

struct AdamArgs {
  double lr, beta1, beta2, eps, weight_decay;
  int decoupled, eps_tf, mode;  // mode: 0 lazy + global_step, 1 lazy + per_row, 2 global
  float tol;                    // catch-up stops when the tail is below tol * |w|
  float bound_a, bound_b;       // tail factors 1 / (eps (1 - b1)) and 1 / (1 - b1 / sqrt(b2))
};

// Step size and denominator scale of Adam at step t from beta1^t, beta2^t:
//   torch: w -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//   tf:    w -= (lr * sqrt(bc2) / bc1) * m / (sqrt(v) / 1 + eps)       (x / 1 == x exactly)
inline void adam_scalars(const AdamArgs& a, double p1, double p2, float* step_scale, float* dscale) {
  double bc1 = 1.0 - p1, bc2 = 1.0 - p2;
  if (a.eps_tf) {
    *step_scale = (float)(a.lr * std::sqrt(bc2) / bc1);
    *dscale = 1.f;
  } else {
    *step_scale = (float)(a.lr / bc1);
    *dscale = (float)std::sqrt(bc2);
  }
}

// Global Adam's catch-up of one row: the steps L+1 .. L+gap had a zero gradient in
// the dense oracle.  Runs them one by one, exactly, until the contribution of all
// remaining ones is provably below tol * |w| for every element of the row:
//   |dw_{s+j}| <= S |m| b1^j / max(eps, b2^(j/2) sqrt(v)),  S = lr / (1 - b1^s) >= later step sizes,
//   sum_j <= S |m| min(1 / (eps (1 - b1)), 1 / (sqrt(v) (1 - b1/sqrt(b2)))).
// The moments (and decoupled decay) of the skipped remainder are then applied in
// closed form: m *= b1^rem, v *= b2^rem, w *= (1 - lr wd)^rem.
void adam_catch_up(const AdamArgs& a, float* w, float* m, float* v, int64_t D, int64_t L, int64_t gap) {
  const float b1f = (float)a.beta1, b2f = (float)a.beta2, epsf = (float)a.eps;
  const bool decay = a.decoupled && a.weight_decay != 0.0;
  const double c = 1.0 - a.lr * a.weight_decay;
  const float cf = (float)c;
  const float cg = decay ? (float)std::pow(c, (double)gap) : 1.f;
  double p1 = std::pow(a.beta1, (double)(L + 1)), p2 = std::pow(a.beta2, (double)(L + 1));
  int64_t k = 0;
  while (k < gap) {
    float step_scale, dscale;
    adam_scalars(a, p1, p2, &step_scale, &dscale);
    const float S = (float)(a.lr / (1.0 - p1));
    bool done = true;
    for (int64_t d = 0; d < D; ++d) {
      float wd_ = w[d];
      if (decay) wd_ = wd_ * cf;
      float md = m[d] * b1f;
      float vd = v[d] * b2f;
      float sq = std::sqrt(vd);
      wd_ = wd_ - (md / (sq / dscale + epsf)) * step_scale;
      m[d] = md;
      v[d] = vd;
      w[d] = wd_;
      if (md != 0.f) {
        float am = std::fabs(md) * S;
        float t1 = am * a.bound_a, t2 = (am * a.bound_b) / sq;
        float bound = t1 < t2 ? t1 : t2;
        if (!(bound <= a.tol * std::fabs(wd_) * cg)) done = false;
      }
    }
    ++k;
    p1 *= a.beta1;
    p2 *= a.beta2;
    if (done) break;
  }
  int64_t rem = gap - k;
  if (rem > 0) {
    float f1 = (float)std::pow(a.beta1, (double)rem), f2 = (float)std::pow(a.beta2, (double)rem);
    float fc = decay ? (float)std::pow(c, (double)rem) : 1.f;
    for (int64_t d = 0; d < D; ++d) {
      m[d] = m[d] * f1;
      v[d] = v[d] * f2;
      if (decay) w[d] = w[d] * fc;
    }
  }
}

}  // namespace

// Adam, state [m (D) | v (D) | counter (1, modes 1 and 2)] at column D.
//   mode 0 (lazy, global_step): bias correction with t = step.
//   mode 1 (lazy, per_row): counter = the row's own step count, incremented here.
//   mode 2 (global): counter = the step the row was last brought up to date;
//     first the skipped steps are caught up (adam_catch_up), then step t.
// has_grad = 0 (mode 2 only) brings the rows up to date as of `step` without a new step.
// One step (decoupled: w = w * (1 - lr wd) first; L2: g' = g + wd * w):
//   m = m * b1 + g' * (1 - b1);  v = v * b2 + (g' * g') * (1 - b2);
//   w = w - (m / (sqrt(v) / dscale + eps)) * step_scale.
static int64_t he_optim_adam_rows(float* storage, int64_t R, int64_t W, int64_t D, const int64_t* slots, int64_t U,
                             const float* grad, double lr, double beta1, double beta2, double eps,
                             double weight_decay, int decoupled, int eps_tf, int mode, int has_grad, int64_t step,
                             float tol, int nthreads) {
  AdamArgs a{lr, beta1, beta2, eps, weight_decay, decoupled, eps_tf, mode, tol, 0.f, 0.f};
  a.bound_a = (float)(1.0 / (eps * (1.0 - beta1)));
  double r = beta2 > 0.0 ? beta1 / std::sqrt(beta2) : std::numeric_limits<double>::infinity();
  a.bound_b = r < 1.0 ? (float)(1.0 / (1.0 - r)) : std::numeric_limits<float>::infinity();
  const float b1f = (float)beta1, b2f = (float)beta2, epsf = (float)eps;
  const float omb1 = (float)(1.0 - beta1), omb2 = (float)(1.0 - beta2);
  const float wdf = (float)weight_decay, cf = (float)(1.0 - lr * weight_decay);
  const bool l2 = !decoupled && weight_decay != 0.0, decay = decoupled && weight_decay != 0.0;
  float g_step_scale = 0.f, g_dscale = 1.f;
  adam_scalars(a, std::pow(beta1, (double)step), std::pow(beta2, (double)step), &g_step_scale, &g_dscale);
  int64_t cost = mode == 2 ? 16 : 2;
  he::parallel_for(U, nthreads, rows_per_thread(D, cost), [&](int64_t b, int64_t e, int) {
    for_rows(storage, W, (3 * D + (mode ? 1 : 0)) * 4, slots, b, e, [&](int64_t i) {
      float* w = storage + slots[i] * W;
      float* m = w + D;
      float* v = w + 2 * D;
      float* counter = w + 3 * D;
      float step_scale = g_step_scale, dscale = g_dscale;
      if (mode == 2) {
        int64_t last = load_counter(counter);
        int64_t gap = (has_grad ? step - 1 : step) - last;
        if (gap > 0) adam_catch_up(a, w, m, v, D, last, gap);
        if (!has_grad) {
          if (gap > 0) store_counter(counter, step);
          return;
        }
        store_counter(counter, step);
      } else if (mode == 1) {
        int64_t t = load_counter(counter) + 1;
        store_counter(counter, t);
        adam_scalars(a, std::pow(beta1, (double)t), std::pow(beta2, (double)t), &step_scale, &dscale);
      }
      const float* g = grad + i * D;
      for (int64_t d = 0; d < D; ++d) {
        float wd_ = w[d];
        if (decay) wd_ = wd_ * cf;
        float gd = g[d];
        if (l2) gd = gd + wd_ * wdf;
        float md = m[d] * b1f + gd * omb1;
        float vd = v[d] * b2f + (gd * gd) * omb2;
        m[d] = md;
        v[d] = vd;
        w[d] = wd_ - (md / (std::sqrt(vd) / dscale + epsf)) * step_scale;
      }
    });
  });
  return 0;
}

// FTRL-Proximal exactly as TensorFlow's (Sparse)ApplyFtrlV2 CPU kernel
// (multiply_linear_by_lr = false), state [n (D) | z (D)] at column D.  l2 here is
// already adjusted for beta by the caller: l2 + beta / (2 lr).
//   gs = g + (2 l2_shrinkage) * w;  n' = n + g * g;  p(x) = x^(-lr_power) (sqrt when -0.5, in double);
//   z = z + (gs - ((p(n') - p(n)) / lr) * w);
//   w = (clamp(z, -l1, l1) - z) / (p(n') / lr + 2 l2);  n = n'.
static int64_t he_optim_ftrl_rows(float* storage, int64_t R, int64_t W, int64_t D, const int64_t* slots, int64_t U,
                             const float* grad, float lr, double lr_power, float l1, float two_l2,
                             float two_l2_shrinkage, int nthreads) {
  const bool half = lr_power == -0.5;
  he::parallel_for(U, nthreads, rows_per_thread(D, 4), [&](int64_t b, int64_t e, int) {
    for_rows(storage, W, 3 * D * 4, slots, b, e, [&](int64_t i) {
      float* w = storage + slots[i] * W;
      float* n = w + D;
      float* z = w + 2 * D;
      const float* g = grad + i * D;
      for (int64_t d = 0; d < D; ++d) {
        float gd = g[d];
        float wd_ = w[d];
        float gs = two_l2_shrinkage != 0.f ? gd + wd_ * two_l2_shrinkage : gd;
        float n_old = n[d];
        float n_new = n_old + gd * gd;
        float p_new, p_old;
        if (half) {
          p_new = std::sqrt(n_new);
          p_old = std::sqrt(n_old);
        } else {
          p_new = (float)std::pow((double)n_new, -lr_power);
          p_old = (float)std::pow((double)n_old, -lr_power);
        }
        float sigma = (p_new - p_old) / lr;
        float zd = z[d] + (gs - sigma * wd_);
        float quad = p_new / lr + two_l2;
        float zc = std::min(std::max(zd, -l1), l1);
        w[d] = (zc - zd) / quad;
        z[d] = zd;
        n[d] = n_new;
      }
    });
  });
  return 0;
}

// The kernels (csrc/call.h): bufs and the first two ints as rows_of says, then per rule
//   sgd               reals lr, weight_decay
//   momentum          ints nesterov;  reals lr, momentum, weight_decay
//   adagrad           reals clr, eps, weight_decay
//   rowwise_adagrad   reals lr, eps, weight_decay
//   adam              ints decoupled, eps_tf, mode, has_grad, step;  reals lr, beta1, beta2, eps,
//                     weight_decay, tol  (grad empty only with has_grad = 0)
//   ftrl              reals lr, lr_power, l1, two_l2, two_l2_shrinkage
// A float32 hyperparameter is rounded once from the double, as the torch twins round it.
#define HE_ROWS r.storage, r.R, r.W, r.D, r.slots, r.U, r.grad

HE_KERNEL(he_optim_sgd) {
  const Rows r = rows_of(call, 2, 2, [](int64_t) { return int64_t(0); });
  return he_optim_sgd_rows(HE_ROWS, (float)call.r(0), (float)call.r(1), call.nthreads());
}

HE_KERNEL(he_optim_momentum) {
  const Rows r = rows_of(call, 3, 3, [](int64_t d) { return d; });
  return he_optim_momentum_rows(HE_ROWS, (float)call.r(0), (float)call.r(1), (float)call.r(2), (int)call.i(2),
                                call.nthreads());
}

HE_KERNEL(he_optim_adagrad) {
  const Rows r = rows_of(call, 2, 3, [](int64_t d) { return d; });
  return he_optim_adagrad_rows(HE_ROWS, (float)call.r(0), (float)call.r(1), (float)call.r(2), call.nthreads());
}

HE_KERNEL(he_optim_rowwise_adagrad) {
  const Rows r = rows_of(call, 2, 3, [](int64_t) { return int64_t(1); });
  return he_optim_rowwise_adagrad_rows(HE_ROWS, (float)call.r(0), (float)call.r(1), (float)call.r(2),
                                       call.nthreads());
}

HE_KERNEL(he_optim_adam) {
  const bool has_grad = call.i(5) != 0;
  const int64_t mode = call.i(4);
  const Rows r = rows_of(call, 7, 6, [mode](int64_t d) { return 2 * d + (mode ? 1 : 0); }, !has_grad);
  if (!has_grad && call.i(4) != 2) call.fail(HE_BAD_CALL, "a call without a gradient is global mode's catch-up only");
  return he_optim_adam_rows(HE_ROWS, call.r(0), call.r(1), call.r(2), call.r(3), call.r(4), (int)call.i(2),
                            (int)call.i(3), (int)call.i(4), (int)has_grad, call.i(6), (float)call.r(5),
                            call.nthreads());
}

HE_KERNEL(he_optim_ftrl) {
  const Rows r = rows_of(call, 2, 5, [](int64_t d) { return 2 * d; });
  return he_optim_ftrl_rows(HE_ROWS, (float)call.r(0), call.r(1), (float)call.r(2), (float)call.r(3),
                            (float)call.r(4), call.nthreads());
}
