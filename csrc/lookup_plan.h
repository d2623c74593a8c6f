// A lookup's plan as the stages that clean ids read it (lookup_clean.cpp, and
// lookup_pool_direct.cpp, which cleans as it pools): which input feature and table each
// plan feature reads, and TF's rules for its ids.
#pragma once

#include <cmath>

#include "lookup.h"

namespace he_lookup {

struct Plan {
  int64_t B, F;
  const int64_t* src;        // [F] input feature read by each plan feature
  const int64_t* table;      // [F] table of each plan feature
  const int64_t* num_rows;   // [T] rows of static tables, -1 for dynamic
  const int8_t* prune_neg;   // [F] drop ids < 0
  const int8_t* oor;         // [F] OutOfRange policy
  const int8_t* has_default; // [F]
  const int64_t* default_id; // [F]
  const int8_t* combiner;    // [F]
};

inline Verdict classify(const Plan& p, int64_t f, int64_t id, const float* w, int64_t i) {
  if (w) {
    float x = w[i];
    if (!std::isfinite(x)) return kBadWeight;
    if (!(x > 0.0f)) return kDrop;
  }
  if (id < 0 && p.prune_neg[f]) return kDrop;
  int64_t n = p.num_rows[p.table[f]];
  if (n >= 0 && (id < 0 || id >= n)) {
    switch (p.oor[f]) {
      case kPrune: return kDrop;
      case kDefault: return kMapDefault;
      default: return kBadId;
    }
  }
  return kKeep;
}

inline bool fills_empty(const Plan& p, int64_t f) {
  return p.has_default[f] && p.combiner[f] != kNone;
}

}  // namespace he_lookup
