// Stages 1 and 2 of the lookup (lookup.h): clean (count the ids each bag keeps) and
// dedup (each table's unique keys and every kept id's index into them).
#include <mutex>

#include "lookup_plan.h"

namespace he_lookup {

// First error by (feature, position), whichever thread finds it.
struct ErrorSlot {
  std::mutex mu;
  int64_t* err;
  void report(int64_t code, int64_t f, int64_t pos, int64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    if (err[0] == 0 || f < err[1] || (f == err[1] && pos < err[2])) {
      err[0] = code;
      err[1] = f;
      err[2] = pos;
      err[3] = id;
    }
  }
};

// Stage 1.  out_lengths[f*B + b] = ids of bag (f, b) kept after cleaning.
// Returns 0, or an error code with err[0..3] filled.
int64_t count_ids(const int64_t* values, int64_t n_values, const int64_t* offsets,
                  const float* weights, int64_t B, int64_t F, const int64_t* src, const int64_t* table,
                  const int64_t* num_rows, const int8_t* prune_neg, const int8_t* oor,
                  const int8_t* has_default, const int64_t* default_id,
                  const int8_t* combiner, int64_t* out_offsets, int64_t T,
                  const int64_t* table_feat_ptr, const int64_t* table_feats, int64_t* unique_base,
                  int64_t* totals, int64_t* err, int nthreads) {
  // Bag lengths go to out_offsets[1..], then a prefix sum turns them into offsets:
  // no torch op between the kernels (each would wake torch's OpenMP workers, which
  // then spin on the core our threads need).
  int64_t* out_lengths = out_offsets + 1;
  Plan p{B, F, src, table, num_rows, prune_neg, oor, has_default, default_id, combiner};
  ErrorSlot errs{{}, err};
  err[0] = 0;
  he::parallel_for(F * B, nthreads, 4096, [&](int64_t begin, int64_t end, int) {
    for (int64_t bag = begin; bag < end; ++bag) {
      int64_t f = bag / B, b = bag % B;
      int64_t in_bag = src[f] * B + b;
      int64_t kept = 0;
      // Bounds first: later stages index values[] by these offsets.
      if (offsets[in_bag] < 0 || offsets[in_bag + 1] < offsets[in_bag] || offsets[in_bag + 1] > n_values) {
        errs.report(kErrOffsets, f, b, offsets[in_bag + 1]);
        out_lengths[bag] = 0;
        continue;
      }
      for (int64_t i = offsets[in_bag]; i < offsets[in_bag + 1]; ++i) {
        Verdict v = classify(p, f, values[i], weights, i);
        if (v == kKeep || v == kMapDefault) {
          ++kept;
        } else if (v == kBadId) {
          errs.report(kErrOutOfRange, f, i, values[i]);
        } else if (v == kBadWeight) {
          errs.report(kErrWeight, f, i, values[i]);
        }
      }
      if (kept == 0 && fills_empty(p, f)) kept = 1;
      out_lengths[bag] = kept;
    }
  });
  if (err[0]) return err[0];
  out_offsets[0] = 0;
  for (int64_t i = 1; i <= F * B; ++i) out_offsets[i] += out_offsets[i - 1];
  // Each table's share of the unique-key buffer: at most the number of ids it reads.
  int64_t capacity = 0;
  for (int64_t t = 0; t < T; ++t) {
    unique_base[t] = capacity;
    for (int64_t k = table_feat_ptr[t]; k < table_feat_ptr[t + 1]; ++k) {
      const int64_t f = table_feats[k];
      capacity += out_offsets[(f + 1) * B] - out_offsets[f * B];
    }
  }
  totals[0] = out_offsets[F * B];
  totals[1] = capacity;
  return 0;
}

// The ids of table t's features, deduplicated by `d` (a LocalDedup or DirectDedup).
// Returns false, having written at most inside the bags it was given, when the batch
// does not match out_offsets (a bag's offsets outside values, out_offsets decreasing or
// past its feature's end, or a bag whose kept ids are more or fewer than out_offsets
// counted): each bag's ids are written only to [out_offsets[f*B+b], out_offsets[f*B+b+1]),
// which the caller checked lie inside its feature's span (kept_ids), so the unique keys
// of table t number at most its share of the unique-key buffer.
template <class Dedup>
bool dedup_table(const Plan& p, Dedup& d, int64_t t, int64_t B, const int64_t* values, int64_t n_values,
                 const int64_t* offsets, const float* weights, const int64_t* table_feat_ptr, const int64_t* table_feats,
                 const int64_t* out_offsets, const int64_t* unique_base, int32_t* inverse, float* out_weights,
                 int64_t* unique_keys, int32_t* unique_counts, int64_t* unique_count) {
  const int64_t base = unique_base[t];
  int64_t* ukeys = unique_keys + base;
  int32_t* ucounts = unique_counts + base;
  auto add = [&](int64_t key) -> int32_t {
    bool is_new;
    int32_t u = d.find_or_add(key, is_new);
    if (is_new) {
      ukeys[u] = key;
      ucounts[u] = 1;
    } else {
      ++ucounts[u];
    }
    return (int32_t)(base + u);
  };
  for (int64_t k = table_feat_ptr[t]; k < table_feat_ptr[t + 1]; ++k) {
    const int64_t f = table_feats[k];
    const int64_t f_end = out_offsets[(f + 1) * B];
    for (int64_t b = 0; b < B; ++b) {
      const int64_t in_bag = p.src[f] * B + b;
      const int64_t lo = out_offsets[f * B + b], hi = out_offsets[f * B + b + 1];
      const int64_t i0 = offsets[in_bag], i1 = offsets[in_bag + 1];
      if (hi < lo || hi > f_end || i0 < 0 || i1 < i0 || i1 > n_values) return false;
      int64_t j = lo;
      for (int64_t i = i0; i < i1; ++i) {
        Verdict v = classify(p, f, values[i], weights, i);
        if (v != kKeep && v != kMapDefault) continue;  // errors were raised by stage 1
        if (j == hi) return false;  // more kept ids than counted
        inverse[j] = add(v == kKeep ? values[i] : p.default_id[f]);
        if (out_weights) out_weights[j] = weights[i];
        ++j;
      }
      if (j == lo && fills_empty(p, f)) {
        if (j == hi) return false;
        inverse[j] = add(p.default_id[f]);
        if (out_weights) out_weights[j] = 1.0f;
        ++j;
      }
      if (j != hi) return false;  // fewer: inverse[j..hi) would stay unwritten
    }
  }
  unique_count[t] = d.count;
  return true;
}

// Stage 2 (with deduplicate = 0: every kept id gets its own entry, for forward-only
// lookups).  Writes, for each kept id at output position j (bags laid out by
// out_offsets), inverse[j] = unique_base[t] + its index among table t's unique
// keys and out_weights[j]; unique_keys/unique_counts[unique_base[t] + u] for
// each table; unique_count[t] = number of unique keys of table t.
// table_feat_ptr/table_feats list the plan features of each table (CSR).  Returns
// false when the batch does not match out_offsets (dedup_table; the outputs are then
// partly written).
bool dedup_ids(LookupContext* ctx, const int64_t* values, int64_t n_values, const int64_t* offsets,
               const float* weights, int64_t B, int64_t F, int64_t T,
               const int64_t* src, const int64_t* table, const int64_t* num_rows,
               const int8_t* prune_neg, const int8_t* oor,
               const int8_t* has_default, const int64_t* default_id,
               const int8_t* combiner, const int64_t* table_feat_ptr,
               const int64_t* table_feats, const int64_t* out_offsets,
               const int64_t* unique_base, int32_t* inverse, float* out_weights,
               int64_t* unique_keys, int32_t* unique_counts,
               int64_t* unique_count, int64_t deduplicate, int nthreads) {
  std::lock_guard<std::mutex> lock(ctx->mu);
  Plan p{B, F, src, table, num_rows, prune_neg, oor, has_default, default_id, combiner};
  int threads = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, T));
  if ((int)ctx->dedup.size() < threads) ctx->dedup.resize(threads);
  if ((int64_t)ctx->direct.size() < T) ctx->direct.resize(T);
  std::atomic<bool> ok{true};
  he::parallel_items(T, threads, [&](int64_t t, int tid) {
    int64_t n_ids = 0;
    for (int64_t k = table_feat_ptr[t]; k < table_feat_ptr[t + 1]; ++k) {
      int64_t f = table_feats[k];
      n_ids += out_offsets[(f + 1) * B] - out_offsets[f * B];
    }
    const int64_t rows = num_rows[t];
    if (!deduplicate) {
      he::NoDedup d;
      if (!dedup_table(p, d, t, B, values, n_values, offsets, weights, table_feat_ptr, table_feats, out_offsets,
                       unique_base, inverse, out_weights, unique_keys, unique_counts, unique_count))
        ok.store(false);
    } else if (rows >= 0 && rows <= kDirectMaxRows) {
      he::DirectDedup& d = ctx->direct[t];
      d.reset(rows);
      if (!dedup_table(p, d, t, B, values, n_values, offsets, weights, table_feat_ptr, table_feats, out_offsets,
                       unique_base, inverse, out_weights, unique_keys, unique_counts, unique_count))
        ok.store(false);
    } else {
      he::LocalDedup& d = ctx->dedup[tid];
      d.reset(n_ids);
      if (!dedup_table(p, d, t, B, values, n_values, offsets, weights, table_feat_ptr, table_feats, out_offsets,
                       unique_base, inverse, out_weights, unique_keys, unique_counts, unique_count))
        ok.store(false);
    }
  });
  return ok.load();
}

}  // namespace he_lookup
