// HyperLogLog register update of convert's distinct-id count (hugeembed/data/_distinct.py, whose
// NumPy path is the fallback and the tests' oracle): one pass of hash, leading-zero count and max
// into the registers, where the NumPy path makes ~8 id-sized temporaries (24 ns an id).
#include <algorithm>

#include "common.h"

namespace {
inline void update(uint8_t* col, uint64_t h, int shift) {
  const uint32_t low = (uint32_t)h;
  const uint8_t rank = (uint8_t)(low ? __builtin_clz(low) + 1 : 33);
  uint8_t& slot = col[h >> shift];
  slot = std::max(slot, rank);
}
}  // namespace

// bufs: ids int64 [n * columns] (row-major [n, columns]), registers uint8 [columns << bits] (updated
// in place: column c's registers are [c << bits, (c + 1) << bits)).  ints: columns, bits, salt.
// Register of an id: the top `bits` bits of h = mix64(id ^ salt); its value the leading zeros of h's
// low 32 bits + 1 (33 for 0), kept when larger than the register's.
HE_KERNEL(he_hll_update) {
  call.expect(2, 3, 0);
  const int64_t columns = call.i(0), bits = call.i(1);
  const uint64_t salt = (uint64_t)call.i(2);
  if (columns < 1 || bits < 4 || bits > 24)
    call.fail(HE_BAD_CALL, "columns %lld must be >= 1 and bits %lld in [4, 24]", (long long)columns, (long long)bits);
  const int64_t n = call.numel(0);
  if (n % columns != 0)
    call.fail(HE_BAD_CALL, "%lld ids are not rows of %lld columns", (long long)n, (long long)columns);
  const int64_t* ids = call.buf<const int64_t>(0, n, "ids");
  uint8_t* reg = call.bytes<uint8_t>(1, columns << bits, "registers");
  const int shift = 64 - (int)bits;
  // Rows in tiles: hash a tile (a vectorisable loop), then update one column's registers at a time,
  // so the registers being updated stay in L1 (26 columns' 4 KiB each would not); max without a branch.
  constexpr int64_t kBuf = 4096;  // hashes of a tile of rows: 32 KiB
  uint64_t hashes[kBuf];
  const int64_t rows = n / columns, tile = std::max<int64_t>(1, kBuf / columns);
  for (int64_t r0 = 0; r0 < rows; r0 += tile) {
    const int64_t* in = ids + r0 * columns;
    for (int64_t c0 = 0; c0 < columns; c0 += kBuf) {  // more columns than kBuf: a row in pieces
      const int64_t width = std::min(kBuf, columns - c0), height = std::min(tile, rows - r0);
      for (int64_t r = 0; r < height; ++r)
        for (int64_t c = 0; c < width; ++c)
          hashes[r * width + c] = he::mix64((uint64_t)in[r * columns + c0 + c] ^ salt);
      for (int64_t c = 0; c < width; ++c) {
        uint8_t* col = reg + ((c0 + c) << bits);
        for (int64_t k = c; k < height * width; k += width) update(col, hashes[k], shift);
      }
    }
  }
  return 0;
}
