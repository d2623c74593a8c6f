// Fused multi-table embedding lookup: the CPU kernels behind hugeembed.functional.
//
// One lookup over F "plan features" (each reads one input feature of a
// SparseFeatures batch and one table) runs as
//   1. he_lookup_count   clean: per bag, count the ids that survive TF's rules
//                        (id < 0 dropped, weight <= 0 dropped, out-of-range ids of
//                        static tables -> error / prune / default_id) plus the
//                        default_id filling an empty pooled bag;
//   2. he_lookup_dedup   dedup: per table, unique keys in first-seen order, their
//                        occurrence counts, and each kept id's index into them;
//   (the caller maps unique keys to row slots: identity for static tables,
//    find-or-insert for hash tables)
//   3. he_lookup_pool    pool: per dim group, gather rows by slot, clip to max_norm,
//                        weight, and reduce each bag with its combiner straight
//                        into the output [B, F_g, D] (or any strided layout);
//      he_lookup_unpooled  the same without reduction, one row per id;
//   4. he_lookup_backward  per table, the gradient of each unique row: the
//                        weighted segment sum of the output gradient, then the
//                        Jacobian of max_norm clipping.  Never a dense gradient.
// The torch twin of each stage is hugeembed/functional/_reference.py; the tests
// check both against a NumPy oracle of TF's documented semantics.
//
// Stages 1-2 are in lookup_clean.cpp, 3 in lookup_pool.cpp (and the one-pass forward of
// static tables in lookup_pool_direct.cpp), 4 in lookup_backward.cpp; each is declared
// below as the exported kernels (lookup_call.cpp) call it and described where it is
// defined.
#pragma once

#include <mutex>
#include <vector>

#include "common.h"

namespace he_lookup {

enum Combiner : int8_t { kSum = 0, kMean = 1, kSqrtn = 2, kNone = 3 };
enum OutOfRange : int8_t { kError = 0, kPrune = 1, kDefault = 2 };
enum Verdict { kDrop, kKeep, kMapDefault, kBadId, kBadWeight };

// Error codes reported in err[0]; err[1] = plan feature, err[2] = position of the
// id in `values`, err[3] = the id.
constexpr int64_t kErrOutOfRange = 1;
constexpr int64_t kErrWeight = 2;
constexpr int64_t kErrOffsets = 3;  // err[2] = sample, err[3] = offsets[bag]
constexpr int64_t kErrEnds = 4;     // (he_lookup_count) the offsets do not run from 0 to len(values)

// Static tables up to this many rows deduplicate by direct indexing (8 bytes per
// row of scratch, kept per table); larger or dynamic tables use a hash.
constexpr int64_t kDirectMaxRows = 1 << 16;

struct LookupContext {
  std::mutex mu;  // one lookup at a time per context: the scratch is shared
  std::vector<he::LocalDedup> dedup;    // per thread
  std::vector<he::DirectDedup> direct;  // per table
};

// What he_lookup_pool_direct did: pooled, or left it to the two-stage path (count +
// dedup + pool) because a bag holds bad offsets, an id or a weight to report, or a
// table is dynamic.  Must match hugeembed/functional/_native_stages.py::POOL_DIRECT_*.
enum PoolDirect : int64_t { kPooledDirect = 0, kTwoStage = 1 };

int64_t count_ids(const int64_t* values, int64_t n_values, const int64_t* offsets,
                  const float* weights, int64_t B, int64_t F, const int64_t* src, const int64_t* table,
                  const int64_t* num_rows, const int8_t* prune_neg, const int8_t* oor,
                  const int8_t* has_default, const int64_t* default_id,
                  const int8_t* combiner, int64_t* out_offsets, int64_t T,
                  const int64_t* table_feat_ptr, const int64_t* table_feats, int64_t* unique_base,
                  int64_t* totals, int64_t* err, int nthreads);

bool dedup_ids(LookupContext* ctx, const int64_t* values, int64_t n_values, const int64_t* offsets,
               const float* weights, int64_t B, int64_t F, int64_t T,
               const int64_t* src, const int64_t* table, const int64_t* num_rows,
               const int8_t* prune_neg, const int8_t* oor,
               const int8_t* has_default, const int64_t* default_id,
               const int8_t* combiner, const int64_t* table_feat_ptr,
               const int64_t* table_feats, const int64_t* out_offsets,
               const int64_t* unique_base, int32_t* inverse, float* out_weights,
               int64_t* unique_keys, int32_t* unique_counts,
               int64_t* unique_count, int64_t deduplicate, int nthreads);

void pool_rows(int64_t B, int64_t n_feats, const int64_t* feats,
               const int64_t* out_offsets, const int32_t* inverse,
               const float* weights, const int64_t* slots, const int64_t* table,
               const int64_t* storage, const int64_t* row_stride,
               const float* max_norm, const int8_t* combiner, int64_t D, float* out,
               int64_t out_row_stride, const int64_t* out_col, int nthreads);

void unpooled_rows(int64_t B, int64_t n_feats, const int64_t* feats,
                   const int64_t* out_offsets, const int32_t* inverse,
                   const float* weights, const int64_t* slots, const int64_t* table,
                   const int64_t* storage, const int64_t* row_stride,
                   const float* max_norm, const int8_t* combiner, int64_t D,
                   float* out, const int64_t* out_row0, int nthreads);

void backward_rows(int64_t B, int64_t F, int64_t T, const int64_t* table_feat_ptr,
                   const int64_t* table_feats, const int64_t* out_offsets,
                   const int32_t* inverse, const float* weights, const int64_t* slots,
                   const int64_t* storage, const int64_t* row_stride,
                   const float* max_norm, const int8_t* combiner,
                   const int64_t* unique_base, const int64_t* unique_count,
                   const int64_t* dims, const int64_t* grad_ptr,
                   const int64_t* grad_stride, float* gbuf, const int64_t* gbase,
                   int nthreads);

int64_t pool_direct(const int64_t* values, int64_t n_values, const int64_t* offsets,
                    const float* weights, int64_t B, int64_t F, const int64_t* src,
                    const int64_t* table, const int64_t* num_rows, const int8_t* prune_neg,
                    const int8_t* oor, const int8_t* has_default, const int64_t* default_id,
                    const int8_t* combiner, int64_t n_feats, const int64_t* feats,
                    const int64_t* storage, const int64_t* row_stride, const float* max_norm,
                    int64_t D, float* out, int64_t out_row_stride, const int64_t* out_col,
                    int nthreads);

}  // namespace he_lookup
