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
#include <limits>

#include "optim_rows.h"

using namespace he_optim;

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
//   (adam's: csrc/optim_adam.cpp)
//   sgd               reals lr, weight_decay
//   momentum          ints nesterov;  reals lr, momentum, weight_decay
//   adagrad           reals clr, eps, weight_decay
//   rowwise_adagrad   reals lr, eps, weight_decay
//   ftrl              reals lr, lr_power, l1, two_l2, two_l2_shrinkage
// A float32 hyperparameter is rounded once from the double, as the torch twins round it.
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

HE_KERNEL(he_optim_ftrl) {
  const Rows r = rows_of(call, 2, 5, [](int64_t d) { return 2 * d; });
  return he_optim_ftrl_rows(HE_ROWS, (float)call.r(0), call.r(1), (float)call.r(2), (float)call.r(3),
                            (float)call.r(4), call.nthreads());
}
