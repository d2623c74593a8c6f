// The training fetch of a group of static tables (hugeembed/store/_static.py).
#include "common.h"

// The training fetch of a group of static tables: table t's key k lives at row
// first[t] + k / shards[t] when k is one of its keys (0 <= k < rows[t], k mod shards[t] == shard[t]).
// Every key is checked first; then, only if all are good, out = the row and (with count) its hit
// count grows by counts[i] (1 without counts) and its last step becomes `step`.  tids[i] = -1:
// skipped (out -1).
//   bufs  meta int64 [R, 2], tables int64 [T, 4] (first, rows, shard, shards), keys int64 [n],
//         tids int64 [n], counts int64 [n] or empty, out int64 [n]
//   ints  step, count (0: only the rows, nothing written to meta), unique (1: no key of a table
//         comes twice, so the rows are written from several threads)
// A bad key or count fails with HE_BAD_VALUE, detail {position, 1 (key) or 2 (count)}, nothing written.
HE_KERNEL(he_static_touch) {
  call.expect(6, 3, 0);
  const int64_t R = call.numel(0) / 2, T = call.numel(1) / 4, n = call.numel(2);
  int64_t* meta = call.buf<int64_t>(0, 2 * R, "meta");
  const int64_t* tab = call.buf<const int64_t>(1, 4 * T, "tables");
  const int64_t* keys = call.buf<const int64_t>(2, n, "keys");
  const int64_t* tids = call.buf<const int64_t>(3, n, "tables of keys");
  const int64_t* counts = call.opt<const int64_t>(4, n, "counts");
  int64_t* out = call.buf<int64_t>(5, n, "out");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t* x = tab + 4 * t;
    if (x[0] < 0 || x[1] < 0 || x[3] < 1 || x[2] < 0 || x[2] >= x[3] || x[0] + (x[1] + x[3] - 1 - x[2]) / x[3] > R)
      call.fail(HE_BAD_CALL, "table %lld: first row %lld, %lld rows, shard %lld of %lld do not fit %lld rows",
                (long long)t, (long long)x[0], (long long)x[1], (long long)x[2], (long long)x[3], (long long)R);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tids[i];
    if (t < -1 || t >= T)
      call.fail(HE_BAD_CALL, "table %lld at position %lld is not one of the group's %lld", (long long)t,
                (long long)i, (long long)T);
    if (t < 0) continue;
    const int64_t* x = tab + 4 * t;
    const int64_t k = keys[i];
    const bool bad_key = k < 0 || k >= x[1] || k % x[3] != x[2];
    if (bad_key || (counts && counts[i] < 1)) {
      call.detail({i, bad_key ? 1 : 2});
      call.fail(HE_BAD_VALUE, "%s at position %lld", bad_key ? "key out of range" : "count below 1", (long long)i);
    }
  }
  const int64_t step = call.i(0);
  const bool count = call.i(1) != 0;
  he::parallel_for(n, call.i(2) ? call.nthreads() : 1, 1 << 14, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = tids[i];
      if (t < 0) {
        out[i] = -1;
        continue;
      }
      const int64_t* x = tab + 4 * t;
      const int64_t s = x[0] + keys[i] / x[3];
      out[i] = s;
      if (count) {
        meta[2 * s] += counts ? counts[i] : 1;
        meta[2 * s + 1] = step;
      }
    }
  });
  return 0;
}
