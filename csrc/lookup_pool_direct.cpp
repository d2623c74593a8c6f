// The forward-only lookup of static tables in one pass over the input (lookup.h):
// clean and pool without the intermediate arrays, bit-identical to stages 1-3.
#include "lookup_plan.h"
#include "lookup_rows.h"

namespace he_lookup {

// The bags of pool_direct_feature's common case (no per-id weights, no max_norm): the loop
// of pool_bags_fast, reading the ids themselves; false when a bag holds something the
// two-stage path must report.
template <int DC, class Sum>
inline bool pool_direct_bags_fast(const Plan& p, const int64_t* values, int64_t n_values, const int64_t* offsets,
                                  const PoolArgs& a, int64_t f, int64_t b0, int64_t b1, int64_t D_, float* out,
                                  int64_t ors, int64_t col, float* acc) {
  const int64_t D = DC ? DC : D_;  // a constant where DC is: prefetch_row's loop unrolled
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
    write_combined(o, acc, D, c, wsum, w2sum);
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

}  // namespace he_lookup
