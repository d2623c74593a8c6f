// Stage 3 of the lookup (lookup.h): pooling the rows of the kept ids into the output,
// and the unpooled (sequence) features' one row per id.
#include "lookup_rows.h"

namespace he_lookup {

// The bags of pool_feature's common case (no per-id weights, no max_norm), summed by Sum
// (PlainSum or StreamedSum): rows are summed straight into the output (or registers), a
// one-id bag is a row copy.  Same float operations as pool_feature's general loop
// (0 + x == x exactly), so the results are identical.
template <int DC, class Sum>
inline void pool_bags_fast(const PoolArgs& a, int64_t f, int64_t b0, int64_t b1, int64_t D_, float* out,
                           int64_t ors, int64_t col, float* acc) {
  const int64_t D = DC ? DC : D_;  // a constant where DC is: prefetch_row's loop unrolled
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
    write_combined(o, acc, D, c, wsum, w2sum);
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

}  // namespace he_lookup
