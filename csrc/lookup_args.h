// The lookup kernels' arguments (csrc/lookup_call.cpp), unpacked and checked: the plan's
// constant arrays, the batch, the row storages, feature lists and pooled outputs.
#pragma once
#include <algorithm>
#include <vector>

#include "call.h"
#include "lookup.h"

// Every kernel begins with the plan's constant arrays, packed once per plan by
// hugeembed/functional/_native_stages.py::_plan_bufs (two buffers per call, not ten):
//   buf 0  plan_i64  table[F] default_id[F] table_feats[F] num_rows[T] dims[T] table_feat_ptr[T+1]
//   buf 1  plan_i8   prune_neg[F] oor[F] has_default[F] combiner[F]
// and its ints with B, F, T.  The tables' rows go over as the S distinct row storages
// the tables read (the tables of a group read one), as S trailing buffers (rows(): the
// span of a row-strided view) with their row strides W[S] last among the ints, and an
// int64 buffer of_table [T] saying which storage each table reads; each kernel builds its
// own array of row addresses from them.  Nothing a call hands over grows with the tables
// but these constant arrays (no int per table).
//
// Checked here, before anything is written: every buffer's type and length against
// B, F, T, D and the counts the earlier stages produced, and every index of the plan.
// Trusted (written by the earlier stages of the same lookup, checked there): the
// contents of out_offsets within each feature's span (he_lookup_count; the spans
// themselves are checked, O(F), and he_lookup_dedup checks every bag as it walks it), of inverse (he_lookup_dedup: each entry <
// capacity) and of slots (the caller: each a row of its table, or -1); checking each
// of those per id would cost the hot loops.

namespace he_lookup_args {

using namespace he_lookup;

// Bounds on sizes and positions from the caller, which keep every product the checks
// below form ((src+1)*B, F*B, row * stride + D, ...) inside int64.
constexpr int64_t kMaxIndex = int64_t(1) << 40;
constexpr int64_t kMaxDim = int64_t(1) << 20;

struct PlanView {
  int64_t B, F, T;
  const int64_t *table, *default_id, *table_feats, *num_rows, *dims, *table_feat_ptr;
  const int8_t *prune_neg, *oor, *has_default, *combiner;
};

inline PlanView plan_view(const he::Call& call) {
  const int64_t B = call.i(0), F = call.i(1), T = call.i(2);
  if (B < 0 || F < 0 || T < 0 || B > kMaxIndex || F > kMaxDim || T > kMaxDim)
    call.fail(HE_BAD_CALL, "B %lld, F %lld, T %lld out of bounds", (long long)B, (long long)F, (long long)T);
  const int64_t* p = call.buf<const int64_t>(0, 3 * F + 3 * T + 1, "plan_i64");
  const int8_t* q = call.buf<const int8_t>(1, 4 * F, "plan_i8");
  const PlanView v{B,         F,     T,         p,         p + F,     p + 2 * F, p + 3 * F, p + 3 * F + T,
                   p + 3 * F + 2 * T, q, q + F, q + 2 * F, q + 3 * F};
  for (int64_t f = 0; f < F; ++f)
    if (v.table[f] < 0 || v.table[f] >= T)
      call.fail(HE_BAD_CALL, "plan: feature %lld reads table %lld of %lld", (long long)f, (long long)v.table[f],
                (long long)T);
  for (int64_t t = 0; t < T; ++t)
    if (v.dims[t] < 0 || v.dims[t] > kMaxDim)
      call.fail(HE_BAD_CALL, "plan: table %lld has dim %lld", (long long)t, (long long)v.dims[t]);
  if (v.table_feat_ptr[0] != 0 || v.table_feat_ptr[T] > F)
    call.fail(HE_BAD_CALL, "plan: table_feat_ptr spans [%lld, %lld], not within [0, %lld]",
              (long long)v.table_feat_ptr[0], (long long)v.table_feat_ptr[T], (long long)F);
  for (int64_t t = 0; t < T; ++t)
    if (v.table_feat_ptr[t + 1] < v.table_feat_ptr[t])
      call.fail(HE_BAD_CALL, "plan: table_feat_ptr decreases at table %lld", (long long)t);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = v.table_feat_ptr[t]; k < v.table_feat_ptr[t + 1]; ++k)
      if (v.table_feats[k] < 0 || v.table_feats[k] >= F || v.table[v.table_feats[k]] != t)
        call.fail(HE_BAD_CALL, "plan: table_feats[%lld] = %lld, not a feature of table %lld (of %lld features)",
                  (long long)k, (long long)v.table_feats[k], (long long)t, (long long)F);
  // num_rows bounds the row products (table_rows) and the direct dedup's scratch; a
  // default_id a static table maps ids to must be one of its rows (the dedup indexes by it)
  for (int64_t t = 0; t < T; ++t)
    if (v.num_rows[t] < -1 || v.num_rows[t] > kMaxIndex)
      call.fail(HE_BAD_CALL, "plan: table %lld has %lld rows", (long long)t, (long long)v.num_rows[t]);
  for (int64_t f = 0; f < F; ++f) {
    const int64_t n = v.num_rows[v.table[f]];
    if (n >= 0 && (v.has_default[f] || v.oor[f] == kDefault) && (v.default_id[f] < 0 || v.default_id[f] >= n))
      call.fail(HE_BAD_CALL, "plan: feature %lld: default_id %lld outside the %lld rows of table %lld", (long long)f,
                (long long)v.default_id[f], (long long)n, (long long)v.table[f]);
  }
  return v;
}

// a * b + c + d (sizes and positions the checks form), failing where it leaves int64.
inline int64_t span(const he::Call& call, int64_t a, int64_t b, int64_t c, int64_t d, const char* what) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r) || __builtin_add_overflow(r, c, &r) || __builtin_add_overflow(r, d, &r))
    call.fail(HE_BAD_CALL, "%s: %lld * %lld + %lld + %lld overflows", what, (long long)a, (long long)b, (long long)c,
              (long long)d);
  return r;
}

// The input batch: values [n_values], offsets (bags of input feature s are
// offsets[s*B .. s*B + B]), weights [n_values] or empty, src [F].
struct Batch {
  const int64_t* values;
  int64_t n_values;
  const int64_t* offsets;
  const float* weights;
  const int64_t* src;
};

inline Batch batch_view(const he::Call& call, const PlanView& v, int64_t k_values, int64_t k_offsets, int64_t k_weights,
                 int64_t k_src) {
  Batch in;
  in.n_values = call.numel(k_values);
  in.values = call.buf<const int64_t>(k_values, in.n_values, "values");
  in.weights = call.opt<const float>(k_weights, in.n_values, "weights");
  in.src = call.buf<const int64_t>(k_src, v.F, "src");
  const int64_t n_offsets = call.numel(k_offsets);
  int64_t need = 1;
  for (int64_t f = 0; f < v.F; ++f) {
    const int64_t s = in.src[f];
    if (s < 0 || (v.B > 0 && s >= n_offsets / v.B))
      call.fail(HE_BAD_CALL, "src[%lld] = %lld: offsets of %lld entries hold no such feature for B %lld",
                (long long)f, (long long)s, (long long)n_offsets, (long long)v.B);
    need = std::max(need, (s + 1) * v.B + 1);
  }
  in.offsets = call.buf<const int64_t>(k_offsets, need, "offsets");
  return in;
}

// Ids table t reads after cleaning (its share of the unique-key buffer).
inline int64_t ids_of_table(const PlanView& v, const int64_t* out_offsets, int64_t t) {
  int64_t n = 0;
  for (int64_t k = v.table_feat_ptr[t]; k < v.table_feat_ptr[t + 1]; ++k) {
    const int64_t f = v.table_feats[k];
    n += out_offsets[(f + 1) * v.B] - out_offsets[f * v.B];
  }
  return n;
}

// out_offsets [F*B + 1] from he_lookup_count; returns n_kept (its last entry).
inline int64_t kept_ids(const he::Call& call, const PlanView& v, int64_t k, const int64_t** out_offsets) {
  *out_offsets = call.buf<const int64_t>(k, v.F * v.B + 1, "out_offsets");
  const int64_t n_kept = (*out_offsets)[v.F * v.B];
  if ((*out_offsets)[0] != 0 || n_kept < 0)
    call.fail(HE_BAD_CALL, "out_offsets runs from %lld to %lld", (long long)(*out_offsets)[0], (long long)n_kept);
  // each feature's span inside [0, n_kept] (O(F); the bags within are trusted, or, in
  // he_lookup_dedup, checked as it walks them)
  for (int64_t f = 0; f < v.F; ++f) {
    const int64_t lo = (*out_offsets)[f * v.B], hi = (*out_offsets)[(f + 1) * v.B];
    if (lo < 0 || hi < lo || hi > n_kept)
      call.fail(HE_BAD_CALL, "out_offsets: feature %lld spans [%lld, %lld) of %lld ids", (long long)f, (long long)lo,
                (long long)hi, (long long)n_kept);
  }
  return n_kept;
}

// Integers k .. k+n-1 of the call.
inline const int64_t* int_span(const he::Call& call, int64_t k, int64_t n, const char* what) {
  if (n > 0) call.i(k + n - 1);  // fails when not given
  (void)what;
  return call.raw()->ints + k;
}

// Row addresses and strides of the T tables, as PoolArgs reads them: table t reads row
// storage of_table[t] (int64 buffer k_of [T]) of the S storages (buffers first ..
// first+S-1, row strides W[S] from int first_int).  Tables with used[t] must be given,
// with a row stride of at least `dims[t]` and, when min_rows[t] > 0, that many rows.
struct Tables {
  std::vector<int64_t> addr, stride;
};

template <class Used, class MinRows>
Tables table_rows(const he::Call& call, const PlanView& v, int64_t k_of, int64_t first, int64_t S,
                  int64_t first_int, Used&& used, MinRows&& min_rows) {
  if (S < 0 || S > kMaxDim) call.fail(HE_BAD_CALL, "%lld row storages", (long long)S);
  const int64_t* of_table = call.buf<const int64_t>(k_of, v.T, "of_table");
  const int64_t* W = int_span(call, first_int, S, "row strides");
  Tables tabs{std::vector<int64_t>(v.T, 0), std::vector<int64_t>(v.T, 0)};
  for (int64_t t = 0; t < v.T; ++t) {
    if (!used(t)) continue;
    const int64_t s = of_table[t];
    if (s < 0 || s >= S)
      call.fail(HE_BAD_CALL, "table %lld reads row storage %lld of %lld", (long long)t, (long long)s, (long long)S);
    const int64_t D = v.dims[t], w = W[s], n = min_rows(t), numel = call.numel(first + s);
    if (w < 0 || w > kMaxIndex || (w < D && numel > D))
      call.fail(HE_BAD_CALL, "table %lld: row stride %lld for dim %lld", (long long)t, (long long)w, (long long)D);
    const float* rows = call.buf<const float>(first + s, n > 0 ? span(call, n - 1, w, D, 0, "table rows") : 0,
                                              "table rows");
    tabs.addr[t] = reinterpret_cast<int64_t>(rows);
    tabs.stride[t] = w;
  }
  return tabs;
}

// S, the number of row storages a call hands over: int k, then their strides (ints k+1 ..).
inline int64_t storages(const he::Call& call, int64_t k) {
  const int64_t S = call.i(k);
  if (S < 0 || S > kMaxDim) call.fail(HE_BAD_CALL, "%lld row storages", (long long)S);
  return S;
}

// Plan features feats[n] (buffer k) of dim D, each with an int64 position (buffer
// k + 1: an output column or first output row, >= 0); returns n.
inline int64_t feature_list(const he::Call& call, const PlanView& v, int64_t k, int64_t D, const int64_t** feats,
                     const int64_t** where) {
  const int64_t n = call.numel(k);
  *feats = call.buf<const int64_t>(k, n, "feats");
  *where = call.buf<const int64_t>(k + 1, n, "feature positions");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t f = (*feats)[i];
    if (f < 0 || f >= v.F || v.dims[v.table[f]] != D || (*where)[i] < 0 || (*where)[i] > kMaxIndex)
      call.fail(HE_BAD_CALL, "feats[%lld] = %lld (position %lld) is not a plan feature of dim %lld", (long long)i,
                (long long)f, (long long)(*where)[i], (long long)D);
  }
  return n;
}

// The tables that plan features feats[n] read (the others' rows need not be given), as
// table_rows; min_rows(t) rows each.
template <class MinRows>
Tables tables_read(const he::Call& call, const PlanView& v, int64_t k_of, int64_t first, int64_t S, int64_t w0,
                   const int64_t* feats, int64_t n, MinRows&& min_rows) {
  std::vector<char> used(v.T, 0);
  for (int64_t k = 0; k < n; ++k) used[v.table[feats[k]]] = 1;
  return table_rows(call, v, k_of, first, S, w0, [&](int64_t t) { return used[t] != 0; }, min_rows);
}

// Buffer k as a pooled output: B rows `ors` apart, feature k's D columns at out_col[k].
inline float* pooled_out(const he::Call& call, const PlanView& v, int64_t k, int64_t n, const int64_t* out_col, int64_t D,
                  int64_t ors) {
  if (ors < 0 || ors > kMaxDim * kMaxDim) call.fail(HE_BAD_CALL, "out_row_stride %lld", (long long)ors);
  int64_t need = 0;
  for (int64_t i = 0; i < n; ++i)
    if (v.B > 0 && D > 0) need = std::max(need, span(call, v.B - 1, ors, out_col[i], D, "out"));
  return call.buf<float>(k, need, "out");
}

}  // namespace he_lookup_args
