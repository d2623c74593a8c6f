// The lookup's exported kernels (csrc/call.h): each unpacks and checks its arguments and
// calls its stage (declared in lookup.h, defined in lookup_*.cpp).

#include <algorithm>
#include <vector>

#include "lookup_args.h"

using namespace he_lookup;
using namespace he_lookup_args;

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
