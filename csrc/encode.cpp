// Categorical cells -> int64 ids, over an Arrow string array's own buffers (offsets + bytes, no copy).
//
// The id of a value is the documented stable hash of its UTF-8 text (hugeembed/data/_hash.py's
// hash_text, the plain-Python definition the tests hold these kernels to): FNV-1a 64 over the
// bytes, MurmurHash3's finaliser (mix64), then bit 62 set and bit 63 clear.  An empty or null cell
// is the feature's missing id.  Every cell is hashed where it lies: hashing the bytes once costs
// less than finding the distinct values first (a dictionary encoding hashes every cell too).
#include "common.h"

namespace {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001b3ULL;
constexpr uint64_t kHashBit = 1ULL << 62;

inline uint64_t fnv(uint64_t h, const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

inline int64_t finish(uint64_t h) { return (int64_t)((he::mix64(h) & (kHashBit - 1)) | kHashBit); }

// put(i, the hash of piece(i) = (bytes, length)) for i < n.  Four pieces at a time in lockstep over
// their common length: FNV is one chain of dependent multiplies per piece, four independent chains
// overlap.  (About 6 ns a cell of 4-5 bytes here, all passes included; a branch-free form over the
// longest piece measured no faster.)
template <class Piece, class Put>
void hash_pieces(int64_t n, Piece piece, Put put) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint8_t* p[4];
    int64_t len[4];
    for (int j = 0; j < 4; ++j) piece(i + j, &p[j], &len[j]);
    const int64_t common = std::min(std::min(len[0], len[1]), std::min(len[2], len[3]));
    uint64_t h0 = kFnvOffset, h1 = kFnvOffset, h2 = kFnvOffset, h3 = kFnvOffset;
    for (int64_t k = 0; k < common; ++k) {
      h0 = (h0 ^ p[0][k]) * kFnvPrime;
      h1 = (h1 ^ p[1][k]) * kFnvPrime;
      h2 = (h2 ^ p[2][k]) * kFnvPrime;
      h3 = (h3 ^ p[3][k]) * kFnvPrime;
    }
    put(i, finish(fnv(h0, p[0] + common, len[0] - common)));
    put(i + 1, finish(fnv(h1, p[1] + common, len[1] - common)));
    put(i + 2, finish(fnv(h2, p[2] + common, len[2] - common)));
    put(i + 3, finish(fnv(h3, p[3] + common, len[3] - common)));
  }
  for (; i < n; ++i) {
    const uint8_t* p;
    int64_t len;
    piece(i, &p, &len);
    put(i, finish(fnv(kFnvOffset, p, len)));
  }
}

// The cells of a string array: offsets (int32: string, int64: large_string) into bytes, checked
// to stay inside the bytes and never go backwards before anything is read through them.
struct Cells {
  const int32_t* off32 = nullptr;
  const int64_t* off64 = nullptr;
  const uint8_t* data = nullptr;
  const uint8_t* valid = nullptr;  // null: every cell valid
  int64_t n = 0;

  int64_t begin(int64_t i) const { return off32 ? off32[i] : off64[i]; }

  Cells(const he::Call& call, int64_t n_cells) : n(n_cells) {
    if (n < 0) call.fail(HE_BAD_CALL, "n = %lld < 0", (long long)n);
    if (call.type(0) == HE_I32) off32 = call.buf<const int32_t>(0, n + 1, "offsets");
    else off64 = call.buf<const int64_t>(0, n + 1, "offsets");
    const int64_t len = call.numel(1);
    data = len ? call.bytes<const uint8_t>(1, len, "data") : nullptr;
    valid = call.opt<const uint8_t>(2, n, "valid");
    for (int64_t i = 0; i < n; ++i)
      if (begin(i) < 0 || begin(i + 1) < begin(i) || begin(i + 1) > len) {
        call.detail({i, begin(i), begin(i + 1), len});
        call.fail(HE_BAD_CALL, "cell %lld spans [%lld, %lld) outside the %lld bytes", (long long)i,
                  (long long)begin(i), (long long)begin(i + 1), (long long)len);
      }
  }
};

// The non-empty pieces of [p, end) between occurrences of sep (non-overlapping, left to right,
// as pyarrow's split_pattern cuts): fn(piece, length) for each.
template <class F>
inline void split(const uint8_t* p, const uint8_t* end, const uint8_t* sep, int64_t sep_len, F&& fn) {
  while (true) {
    const uint8_t* cut = end;
    if (sep_len == 1) {  // a plain loop: the pieces are short, memchr's setup costs more than it saves
      const uint8_t c = sep[0];
      for (const uint8_t* q = p; q < end; ++q)
        if (*q == c) {
          cut = q;
          break;
        }
    } else {
      for (const uint8_t* q = p; q + sep_len <= end; ++q)
        if (*q == sep[0] && std::memcmp(q, sep, (size_t)sep_len) == 0) {
          cut = q;
          break;
        }
    }
    if (cut > p) fn(p, cut - p);
    if (cut == end) return;
    p = cut + sep_len;
  }
}

}  // namespace

// The id of each cell of a string array, into a column of a row-major matrix.
//   bufs: offsets int32 or int64 [n + 1], data bytes, valid uint8 [n] (or empty: all valid),
//         ids int64 [(n - 1) * stride + 1] (out: cell i's id at ids[i * stride])
//   ints: n, missing_id (the id of an empty or null cell), stride (>= 1)
// Returns the number of cells that held a value.
HE_KERNEL(he_hash_cells) {
  call.expect(4, 3, 0);
  const int64_t n = call.i(0), missing = call.i(1), stride = call.i(2);
  if (stride < 1) call.fail(HE_BAD_CALL, "stride %lld < 1", (long long)stride);
  const Cells cells(call, n);
  int64_t* ids = call.buf<int64_t>(3, n ? (n - 1) * stride + 1 : 0, "ids");
  int64_t present = 0;
  auto cell = [&](int64_t i, const uint8_t** p, int64_t* len) {
    *p = cells.data + cells.begin(i);
    *len = cells.begin(i + 1) - cells.begin(i);
  };
  auto put = [&](int64_t i, int64_t id) {
    const bool empty = cells.begin(i + 1) == cells.begin(i) || (cells.valid && !cells.valid[i]);
    ids[i * stride] = empty ? missing : id;
    present += !empty;
  };
  hash_pieces(n, cell, put);
  return present;
}

// Each cell split at a separator into a bag of ids: empty pieces dropped, a longer bag cut to its
// last max_length ids, an empty (or null) cell one missing id.
//   bufs: offsets int32 or int64 [n + 1], data bytes, valid uint8 [n] (or empty), separator bytes,
//         bag_offsets int64 [n + 1] (out: row i's ids are ids[bag_offsets[i]:bag_offsets[i + 1]]),
//         ids int64 [cap] (out; cap = the cells' bytes + n always suffices)
//   ints: n, max_length (<= 0: no limit), missing_id
// Returns the number of ids written.
HE_KERNEL(he_split_hash) {
  call.expect(6, 3, 0);
  const int64_t n = call.i(0), max_length = call.i(1), missing = call.i(2);
  const Cells cells(call, n);
  const int64_t sep_len = call.numel(3);
  if (sep_len < 1) call.fail(HE_BAD_CALL, "empty separator");
  const uint8_t* sep = call.bytes<const uint8_t>(3, sep_len, "separator");
  int64_t* bag_offsets = call.buf<int64_t>(4, n + 1, "bag_offsets");
  const int64_t cap = call.numel(5);
  int64_t* ids = call.opt<int64_t>(5, cap, "ids");
  // first each kept piece's (start in data, length): the start in ids, the length beside it
  // (-1: a row's missing id); then all of them hashed in one pass, in place
  // (not zeroed: only the pages the pieces reach are ever touched)
  const std::unique_ptr<int64_t[]> lens(new int64_t[(size_t)std::max<int64_t>(cap, 1)]);
  int64_t at = 0;
  bag_offsets[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = cells.begin(i), len = cells.begin(i + 1) - b;
    if (at + len + 1 > cap) {  // every piece holds a byte: a row writes at most len ids, or its one missing id
      call.detail({i, cap});
      call.fail(HE_BAD_CALL, "ids holds %lld, too few at cell %lld", (long long)cap, (long long)i);
    }
    const int64_t start = at;
    if (len > 0 && !(cells.valid && !cells.valid[i]))
      split(cells.data + b, cells.data + b + len, sep, sep_len, [&](const uint8_t* p, int64_t k) {
        ids[at] = p - cells.data;
        lens[at++] = k;
      });
    if (max_length > 0 && at - start > max_length) {  // a sequence keeps its latest values
      std::memmove(ids + start, ids + at - max_length, (size_t)max_length * sizeof(int64_t));
      std::memmove(lens.get() + start, lens.get() + at - max_length, (size_t)max_length * sizeof(int64_t));
      at = start + max_length;
    }
    if (at == start) {
      ids[at] = 0;
      lens[at++] = -1;
    }
    bag_offsets[i + 1] = at;
  }
  hash_pieces(
      at,
      [&](int64_t k, const uint8_t** p, int64_t* len) {
        *p = cells.data + ids[k];
        *len = std::max<int64_t>(lens[k], 0);
      },
      [&](int64_t k, int64_t id) { ids[k] = lens[k] < 0 ? missing : id; });
  return at;
}
