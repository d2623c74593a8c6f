// Adam's sparse rule (lazy, per-row and global with its exact catch-up), under the contract
// of csrc/optim.cpp's header: the same float32 operations as hugeembed/optim/_adam.py.
#include <cmath>
#include <limits>

#include "optim_rows.h"

using namespace he_optim;

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

// The kernel (csrc/call.h): bufs and ints W, D as rows_of says, then ints decoupled, eps_tf,
// mode, has_grad, step; reals lr, beta1, beta2, eps, weight_decay, tol (grad empty only with
// has_grad = 0).
HE_KERNEL(he_optim_adam) {
  const bool has_grad = call.i(5) != 0;
  const int64_t mode = call.i(4);
  const Rows r = rows_of(call, 7, 6, [mode](int64_t d) { return 2 * d + (mode ? 1 : 0); }, !has_grad);
  if (!has_grad && call.i(4) != 2) call.fail(HE_BAD_CALL, "a call without a gradient is global mode's catch-up only");
  return he_optim_adam_rows(HE_ROWS, call.r(0), call.r(1), call.r(2), call.r(3), call.r(4), (int)call.i(2),
                            (int)call.i(3), (int)call.i(4), (int)has_grad, call.i(6), (float)call.r(5),
                            call.nthreads());
}
