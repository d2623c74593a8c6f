// The lookup's exported kernels (csrc/call.h): each unpacks and checks its arguments and
// calls its stage (declared in lookup.h, defined in lookup_*.cpp).

#include <algorithm>
#include <vector>

#include "call.h"
#include "lookup.h"

using namespace he_lookup;

// ---- The exported kernels (csrc/call.h) -------------------------------------------
//
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

namespace {

// Bounds on sizes and positions from the caller, which keep every product the checks
// below form ((src+1)*B, F*B, row * stride + D, ...) inside int64.
constexpr int64_t kMaxIndex = int64_t(1) << 40;
constexpr int64_t kMaxDim = int64_t(1) << 20;

struct PlanView {
  int64_t B, F, T;
  const int64_t *table, *default_id, *table_feats, *num_rows, *dims, *table_feat_ptr;
  const int8_t *prune_neg, *oor, *has_default, *combiner;
};

PlanView plan_view(const he::Call& call) {
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
int64_t span(const he::Call& call, int64_t a, int64_t b, int64_t c, int64_t d, const char* what) {
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

Batch batch_view(const he::Call& call, const PlanView& v, int64_t k_values, int64_t k_offsets, int64_t k_weights,
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
int64_t ids_of_table(const PlanView& v, const int64_t* out_offsets, int64_t t) {
  int64_t n = 0;
  for (int64_t k = v.table_feat_ptr[t]; k < v.table_feat_ptr[t + 1]; ++k) {
    const int64_t f = v.table_feats[k];
    n += out_offsets[(f + 1) * v.B] - out_offsets[f * v.B];
  }
  return n;
}

// out_offsets [F*B + 1] from he_lookup_count; returns n_kept (its last entry).
int64_t kept_ids(const he::Call& call, const PlanView& v, int64_t k, const int64_t** out_offsets) {
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
const int64_t* int_span(const he::Call& call, int64_t k, int64_t n, const char* what) {
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
int64_t storages(const he::Call& call, int64_t k) {
  const int64_t S = call.i(k);
  if (S < 0 || S > kMaxDim) call.fail(HE_BAD_CALL, "%lld row storages", (long long)S);
  return S;
}

// Plan features feats[n] (buffer k) of dim D, each with an int64 position (buffer
// k + 1: an output column or first output row, >= 0); returns n.
int64_t feature_list(const he::Call& call, const PlanView& v, int64_t k, int64_t D, const int64_t** feats,
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
float* pooled_out(const he::Call& call, const PlanView& v, int64_t k, int64_t n, const int64_t* out_col, int64_t D,
                  int64_t ors) {
  if (ors < 0 || ors > kMaxDim * kMaxDim) call.fail(HE_BAD_CALL, "out_row_stride %lld", (long long)ors);
  int64_t need = 0;
  for (int64_t i = 0; i < n; ++i)
    if (v.B > 0 && D > 0) need = std::max(need, span(call, v.B - 1, ors, out_col[i], D, "out"));
  return call.buf<float>(k, need, "out");
}

}  // namespace

// Returns a new lookup context (dedup scratch, reused across batches), as an integer
// handle: the one address that crosses the boundary, given back as int 4 of
// he_lookup_dedup and to he_lookup_ctx_free (int 0), which deletes it.
HE_KERNEL(he_lookup_ctx_new) {
  call.expect(0, 0, 0);
  return reinterpret_cast<int64_t>(new LookupContext());
}

HE_KERNEL(he_lookup_ctx_free) {
  call.expect(0, 1, 0);
  delete reinterpret_cast<LookupContext*>(call.i(0));
  return 0;
}

// Stage 1 (count_ids).
//   bufs  0, 1 plan  2 values  3 offsets  4 weights or empty  5 src [F]
//         6 out_offsets [F*B + 1] (out)  7 unique_base [T] (out)  8 totals [2] (out: n_kept, capacity)
//   ints  B F T
// Fails with HE_BAD_VALUE for a bag the cleaning refuses, detail = {code, plan feature,
// position, value}: code kErrOutOfRange or kErrWeight (position of the id in values,
// the id), or kErrOffsets (the sample, offsets[bag + 1]); the first by (feature,
// position).  out_offsets then holds partial counts (nothing else is written).
HE_KERNEL(he_lookup_count) {
  call.expect(9, 3, 0);
  const PlanView v = plan_view(call);
  const Batch in = batch_view(call, v, 2, 3, 4, 5);
  int64_t* out_offsets = call.buf<int64_t>(6, v.F * v.B + 1, "out_offsets");
  int64_t* unique_base = call.buf<int64_t>(7, v.T, "unique_base");
  int64_t* totals = call.buf<int64_t>(8, 2, "totals");
  // The batch's offsets run from 0 to len(values), bags the plan does not read included: a
  // batch that stops short would be pooled without the ids past its end.
  const int64_t n_offsets = call.numel(3);
  if (in.offsets[0] != 0 || in.offsets[n_offsets - 1] != in.n_values) {
    call.detail({kErrEnds, 0, in.offsets[0], in.offsets[n_offsets - 1]});
    call.fail(HE_BAD_VALUE, "offsets run from %lld to %lld, not from 0 to %lld", (long long)in.offsets[0],
              (long long)in.offsets[n_offsets - 1], (long long)in.n_values);
  }
  int64_t err[4] = {0, 0, 0, 0};
  if (count_ids(in.values, in.n_values, in.offsets, in.weights, v.B, v.F, in.src, v.table, v.num_rows, v.prune_neg,
                v.oor, v.has_default, v.default_id, v.combiner, out_offsets, v.T, v.table_feat_ptr, v.table_feats,
                unique_base, totals, err, call.nthreads())) {
    call.detail({err[0], err[1], err[2], err[3]});
    if (err[0] == kErrOffsets)
      call.fail(HE_BAD_VALUE, "plan feature %lld: bag of sample %lld has bad offsets (next offset %lld)",
                (long long)err[1], (long long)err[2], (long long)err[3]);
    call.fail(HE_BAD_VALUE, "plan feature %lld: %s of id %lld at position %lld", (long long)err[1],
              err[0] == kErrWeight ? "non-finite weight" : "out-of-range value", (long long)err[3],
              (long long)err[2]);
  }
  return 0;
}

// Stage 2 (dedup_ids).
//   bufs  0, 1 plan  2 values  3 offsets  4 weights or empty  5 src [F]
//         6 out_offsets [F*B + 1]  7 unique_base [T] (from he_lookup_count)
//         8 inverse int32 [n_kept] (out)  9 out_weights [n_kept] (out; read only with weights)
//         10 unique_keys [capacity] (out)  11 unique_counts int32 [capacity] (out)  12 unique_count [T] (out)
//   ints  B F T deduplicate ctx (he_lookup_ctx_new's handle)
// Fails with HE_BAD_CALL when the batch does not match out_offsets (a bag's offsets
// outside values, or more or fewer kept ids than counted): found while walking the ids,
// so, unlike the other kernels, it may then have written part of inverse, out_weights,
// unique_keys, unique_counts and unique_count (always inside their bounds); the caller
// discards them.  Checking before the walk would cost a second pass over every id.
HE_KERNEL(he_lookup_dedup) {
  call.expect(13, 5, 0);
  const PlanView v = plan_view(call);
  const Batch in = batch_view(call, v, 2, 3, 4, 5);
  const int64_t* out_offsets;
  const int64_t n_kept = kept_ids(call, v, 6, &out_offsets);
  const int64_t* unique_base = call.buf<const int64_t>(7, v.T, "unique_base");
  int64_t capacity = 0;
  for (int64_t t = 0; t < v.T; ++t) {
    int64_t end;
    if (unique_base[t] < 0 || __builtin_add_overflow(unique_base[t], ids_of_table(v, out_offsets, t), &end))
      call.fail(HE_BAD_CALL, "unique_base[%lld] = %lld", (long long)t, (long long)unique_base[t]);
    capacity = std::max(capacity, end);
  }
  int32_t* inverse = call.buf<int32_t>(8, n_kept, "inverse");
  float* out_weights = in.weights ? call.buf<float>(9, n_kept, "out_weights") : nullptr;
  int64_t* unique_keys = call.buf<int64_t>(10, capacity, "unique_keys");
  int32_t* unique_counts = call.buf<int32_t>(11, capacity, "unique_counts");
  int64_t* unique_count = call.buf<int64_t>(12, v.T, "unique_count");
  auto* ctx = reinterpret_cast<LookupContext*>(call.i(4));
  if (!ctx) call.fail(HE_BAD_CALL, "no lookup context");
  if (!dedup_ids(ctx, in.values, in.n_values, in.offsets, in.weights, v.B, v.F, v.T, in.src, v.table, v.num_rows, v.prune_neg, v.oor,
            v.has_default, v.default_id, v.combiner, v.table_feat_ptr, v.table_feats, out_offsets, unique_base,
                 inverse, out_weights, unique_keys, unique_counts, unique_count, call.i(3), call.nthreads()))
    call.fail(HE_BAD_CALL, "the batch does not match out_offsets (not the batch he_lookup_count counted)");
  return 0;
}

// Stage 3 (pool_rows): pools plan features feats (all of dim D): feature feats[k],
// sample b goes to out[b*out_row_stride + out_col[k] .. + D].
//   bufs  0, 1 plan  2 max_norm float32 [T]  3 feats [n]  4 out_col [n]  5 out_offsets [F*B + 1]
//         6 inverse int32 [n_kept]  7 weights [n_kept] or empty  8 slots [capacity]  9 out (out)
//         10 of_table [T]  11 .. 11+S-1 the row storages
//   ints  B F T D capacity out_row_stride S W[S]
HE_KERNEL(he_lookup_pool) {
  const PlanView v = plan_view(call);
  const int64_t S = storages(call, 6);
  call.expect(11 + S, 7 + S, 0);
  const int64_t D = call.i(3), capacity = call.i(4), ors = call.i(5);
  const float* max_norm = call.buf<const float>(2, v.T, "max_norm");
  const int64_t *feats, *out_col;
  const int64_t n = feature_list(call, v, 3, D, &feats, &out_col);
  const int64_t* out_offsets;
  const int64_t n_kept = kept_ids(call, v, 5, &out_offsets);
  const int32_t* inverse = call.buf<const int32_t>(6, n_kept, "inverse");
  const float* weights = call.opt<const float>(7, n_kept, "weights");
  const int64_t* slots = call.buf<const int64_t>(8, capacity, "slots");
  float* out = pooled_out(call, v, 9, n, out_col, D, ors);
  const Tables tabs = tables_read(call, v, 10, 11, S, 7, feats, n, [](int64_t) { return 0; });
  pool_rows(v.B, n, feats, out_offsets, inverse, weights, slots, v.table, tabs.addr.data(), tabs.stride.data(),
            max_norm, v.combiner, D, out, ors, out_col, call.nthreads());
  return 0;
}

// Unpooled features (unpooled_rows): one row per kept id; feature feats[k]'s rows
// start at out[out_row0[k] * D] (row-major, D columns).
//   bufs  as he_lookup_pool, with 4 out_row0 [n] for out_col
//   ints  B F T D capacity S W[S]
HE_KERNEL(he_lookup_unpooled) {
  const PlanView v = plan_view(call);
  const int64_t S = storages(call, 5);
  call.expect(11 + S, 6 + S, 0);
  const int64_t D = call.i(3), capacity = call.i(4);
  const float* max_norm = call.buf<const float>(2, v.T, "max_norm");
  const int64_t *feats, *out_row0;
  const int64_t n = feature_list(call, v, 3, D, &feats, &out_row0);
  const int64_t* out_offsets;
  const int64_t n_kept = kept_ids(call, v, 5, &out_offsets);
  const int32_t* inverse = call.buf<const int32_t>(6, n_kept, "inverse");
  const float* weights = call.opt<const float>(7, n_kept, "weights");
  const int64_t* slots = call.buf<const int64_t>(8, capacity, "slots");
  int64_t need = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t f = feats[k];
    need = std::max(need, span(call, out_row0[k] + out_offsets[(f + 1) * v.B] - out_offsets[f * v.B], D, 0, 0, "out"));
  }
  float* out = call.buf<float>(9, need, "out");
  const Tables tabs = tables_read(call, v, 10, 11, S, 6, feats, n, [](int64_t) { return 0; });
  unpooled_rows(v.B, n, feats, out_offsets, inverse, weights, slots, v.table, tabs.addr.data(), tabs.stride.data(),
                max_norm, v.combiner, D, out, out_row0, call.nthreads());
  return 0;
}

// Stage 4 (backward_rows): table t's gradient rows go to gbuf[gbase[t] ..
// + unique_count[t] * dims[t]].  Feature f's output gradient is gradient buffer
// g_f, from element off_f on, one sample (pooled) or kept id (unpooled) every
// stride_f elements.
//   bufs  0, 1 plan  2 max_norm float32 [T]  3 out_offsets [F*B + 1]  4 inverse int32 [n_kept]
//         5 weights [n_kept] or empty  6 slots [capacity]  7 gbuf (out)
//         8 unique [2T]: unique_base[T] then unique_count[T]  9 gbase [T]
//         10 where [3F]: (g_f, off_f, stride_f) for each f  11 of_table [T]
//         12 .. 12+G-1 the output gradients (float32), then S buffers: the row storages
//   ints  B F T capacity G S W[S]
HE_KERNEL(he_lookup_backward) {
  const PlanView v = plan_view(call);
  const int64_t T = v.T, F = v.F, B = v.B, capacity = call.i(3), G = call.i(4), S = storages(call, 5);
  if (G < 0 || G > kMaxDim) call.fail(HE_BAD_CALL, "%lld gradient buffers", (long long)G);
  call.expect(12 + G + S, 6 + S, 0);
  const int64_t* unique_base = call.buf<const int64_t>(8, 2 * T, "unique");
  const int64_t* unique_count = unique_base + T;
  const int64_t* gbase = call.buf<const int64_t>(9, T, "gbase");
  const int64_t* where = call.buf<const int64_t>(10, 3 * F, "where");
  const float* max_norm = call.buf<const float>(2, T, "max_norm");
  const int64_t* out_offsets;
  const int64_t n_kept = kept_ids(call, v, 3, &out_offsets);
  const int32_t* inverse = call.buf<const int32_t>(4, n_kept, "inverse");
  const float* weights = call.opt<const float>(5, n_kept, "weights");
  const int64_t* slots = call.buf<const int64_t>(6, capacity, "slots");
  int64_t need = 0;
  if (capacity < 0) call.fail(HE_BAD_CALL, "capacity %lld", (long long)capacity);
  for (int64_t t = 0; t < T; ++t) {
    if (unique_base[t] < 0 || unique_count[t] < 0 || unique_base[t] > capacity ||
        unique_count[t] > capacity - unique_base[t] || gbase[t] < 0 || gbase[t] > kMaxIndex * kMaxDim)
      call.fail(HE_BAD_CALL, "table %lld: unique rows [%lld, +%lld) of %lld, gbase %lld", (long long)t,
                (long long)unique_base[t], (long long)unique_count[t], (long long)capacity, (long long)gbase[t]);
    need = std::max(need, span(call, unique_count[t], v.dims[t], gbase[t], 0, "gbuf"));
  }
  float* gbuf = call.buf<float>(7, need, "gbuf");
  std::vector<int64_t> grad_ptr(F, 0), grad_stride(F, 0);
  for (int64_t f = 0; f < F; ++f) {
    const int64_t g = where[3 * f], off = where[3 * f + 1], stride = where[3 * f + 2];
    const int64_t D = v.dims[v.table[f]];
    // a pooled feature reads one gradient row per sample, an unpooled one per kept id
    const int64_t n = v.combiner[f] == kNone ? out_offsets[(f + 1) * B] - out_offsets[f * B] : B;
    if (g < 0 || g >= G || off < 0 || off > kMaxIndex || stride < 0 || stride > kMaxIndex)
      call.fail(HE_BAD_CALL, "feature %lld: gradient %lld of %lld, offset %lld, stride %lld", (long long)f,
                (long long)g, (long long)G, (long long)off, (long long)stride);
    if (n == 0 || D == 0) continue;
    const float* grad = call.buf<const float>(12 + g, span(call, n - 1, stride, off, D, "output gradient"),
                                              "output gradient");
    grad_ptr[f] = reinterpret_cast<int64_t>(grad + off);
    grad_stride[f] = stride;
  }
  const Tables tabs = table_rows(call, v, 11, 12 + G, S, 6, [&](int64_t t) { return max_norm[t] > 0.0f; },
                                 [](int64_t) { return 0; });
  backward_rows(B, F, T, v.table_feat_ptr, v.table_feats, out_offsets, inverse, weights, slots, tabs.addr.data(),
                tabs.stride.data(), max_norm, v.combiner, unique_base, unique_count, v.dims, grad_ptr.data(),
                grad_stride.data(), gbuf, gbase, call.nthreads());
  return 0;
}

// The one-pass forward of static tables (pool_direct).  Returns kPooledDirect, or
// kTwoStage: the caller then runs count + dedup + pool, which reports the bag at
// fault (out is then garbage).  Every table it reads must hold its num_rows rows.
//   bufs  0, 1 plan  2 max_norm float32 [T]  3 feats [n]  4 out_col [n]  5 values  6 offsets
//         7 weights or empty  8 src [F]  9 out (out)  10 of_table [T]  11 .. 11+S-1 the row storages
//   ints  B F T D out_row_stride S W[S]
HE_KERNEL(he_lookup_pool_direct) {
  const PlanView v = plan_view(call);
  const int64_t S = storages(call, 5);
  call.expect(11 + S, 6 + S, 0);
  const int64_t D = call.i(3), ors = call.i(4);
  const float* max_norm = call.buf<const float>(2, v.T, "max_norm");
  const int64_t *feats, *out_col;
  const int64_t n = feature_list(call, v, 3, D, &feats, &out_col);
  const Batch in = batch_view(call, v, 5, 6, 7, 8);
  float* out = pooled_out(call, v, 9, n, out_col, D, ors);
  // ids are checked against num_rows in the loops: rows up to there are all it reads
  const Tables tabs = tables_read(call, v, 10, 11, S, 6, feats, n, [&](int64_t t) { return v.num_rows[t]; });
  return pool_direct(in.values, in.n_values, in.offsets, in.weights, v.B, v.F, in.src, v.table, v.num_rows,
                     v.prune_neg, v.oor, v.has_default, v.default_id, v.combiner, n, feats, tabs.addr.data(),
                     tabs.stride.data(), max_norm, D, out, ors, out_col, call.nthreads());
}
