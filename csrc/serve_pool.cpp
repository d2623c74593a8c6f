// The int8 / int4 lookup in one kernel (he_serve_pool): the bags pass of serve_bags.h, each block of samples
// pooled (serve_pool.h) as soon as its rows are known.
#include <cstdint>

#include "common.h"
#include "serve_bags.h"
#include "serve_index.h"
#include "serve_pool.h"

namespace {

using he::serve::Bags;
using he::serve::bags_args;
using he::serve::index_of;
using he::serve::run_bags;
using he::serve::SlotIndex;
using he::serve::with_outputs;

// Pools bags [j0, j1) from their rows (serve_pool.h) into out; prefetches a row whose probe just ended.
template <class O>
struct PoolRows {
  static constexpr bool kPools = true;
  he::serve::QuantRows rows;
  const O *idx, *starts;
  int64_t n_bags;
  const int64_t* total;  // the ids read (known once bags_args has run)
  float* out;
  void prefetch(int64_t row) const { rows.prefetch(row); }
  void operator()(int64_t j0, int64_t j1) const { he::serve::pool_bags(rows, idx, starts, j0, j1, n_bags, *total, out); }
};

}  // namespace

// he_serve_bags (or, `private_index` 1, he_serve_index_bags) and then the pooling of its rows, quantized: out
// [B, F, D] float32, bag j = b * F + f at out[j * D], the floats of torch's quantized embedding_bag ops
// (serve_pool.h).  Each block of samples is pooled as soon as its rows are known, the row of a dynamic id
// prefetched as soon as its probe ends, so the rows' misses overlap with the probes'.
//   bufs: those of he_serve_bags (0-9), rows uint8 [n_rows * width], out float32 [B * F * D] (out)
//   ints: B, T, n_rows (as he_serve_bags), width (bytes a row), D, bits (8 or 4), private_index (0 or 1)
// Returns the number of ids read.  Fails as he_serve_bags, and with HE_BAD_VALUE (kServeBadRows, width, D,
// bits) for rows not of torch's layout of D values of `bits` (int8: D + 8 bytes; int4: D even, D / 2 + 4).
HE_KERNEL(he_serve_pool) {
  call.expect(12, 7, 0);
  const int64_t B = call.i(0), n_rows = call.i(2), width = call.i(3), D = call.i(4), bits = call.i(5);
  const bool priv = call.i(6) != 0;
  const int64_t F = call.numel(2);
  if ((bits != 8 && bits != 4) || D < 1 || (bits == 4 && D % 2) || width != (bits == 8 ? D + 8 : D / 2 + 4) ||
      n_rows < 1 || n_rows > INT64_MAX / width) {
    call.detail({kServeBadRows, width, D, bits});
    call.fail(HE_BAD_VALUE, "rows of %lld bytes are not %lld values of %lld bits (torch's layout)", (long long)width,
              (long long)D, (long long)bits);
  }
  const uint8_t* rows = call.bytes<const uint8_t>(10, n_rows * width, "rows");
  if (B < 0 || (F > 0 && B > INT64_MAX / F / D))
    call.fail(HE_BAD_CALL, "B %lld x F %lld x D %lld", (long long)B, (long long)F, (long long)D);
  float* out = call.buf<float>(11, B * F * D, "out");
  const int64_t nkeys = call.numel(4);
  const int64_t* keys = call.buf<const int64_t>(4, nkeys, "keys");
  int64_t total = 0;
  const he::serve::QuantRows q{rows, width, D, (int)bits};
  auto run = [&](const auto& index) {
    with_outputs(call, [&](auto o) {
      using O = decltype(o);
      const Bags<O> a = bags_args<O>(call, nkeys, &total);
      run_bags(a, index, call.nthreads(), PoolRows<O>{q, a.idx, a.starts, B * F, &total, out});
    });
  };
  if (priv) {
    run(he::serve::private_index(call, 5));
  } else {
    const void* slots = nullptr;
    int64_t cap = 0;
    const int64_t index_bytes = index_of(call, 5, &slots, &cap);
    if (index_bytes == 4) run(SlotIndex<int32_t>{static_cast<const int32_t*>(slots), (uint64_t)cap - 1, keys, nkeys});
    else run(SlotIndex<int64_t>{static_cast<const int64_t*>(slots), (uint64_t)cap - 1, keys, nkeys});
  }
  return total;
}
