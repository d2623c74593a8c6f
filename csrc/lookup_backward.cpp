// Stage 4 of the lookup (lookup.h): the gradient of each unique row.
#include "lookup_rows.h"

namespace he_lookup {

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

}  // namespace he_lookup
