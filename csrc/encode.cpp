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

// The FNV-1a of a piece of at most 8 bytes whose first 8 bytes may be read (the piece and what follows
// it in the buffer): one unaligned load, then 8 fixed steps, each kept or not by a select.  No branch
// depends on the length, so pieces of mixed lengths cost no mispredictions (the loop in fnv() costs
// one at every piece's end), and the steps of consecutive pieces overlap in the CPU.
inline uint64_t fnv_short(const uint8_t* p, int64_t n) {
  uint64_t w;
  std::memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  w = __builtin_bswap64(w);  // byte k of the piece in bits 8k..8k+7
#endif
  uint64_t h = kFnvOffset;
  for (int k = 0; k < 8; ++k) {
    const uint64_t next = (h ^ ((w >> (8 * k)) & 0xff)) * kFnvPrime;
    h = k < n ? next : h;
  }
  return h;
}

// The id of the bytes [p, p + n) of a buffer that ends at `end`.
inline int64_t hash_id(const uint8_t* p, int64_t n, const uint8_t* end) {
  if (n <= 8 && end - p >= 8) return finish(fnv_short(p, n));
  return finish(fnv(kFnvOffset, p, n));
}

// The cells of one string array: offsets (int32: string, int64: large_string) into bytes, checked
// to stay inside the bytes and never go backwards before anything is read through them.  Buffers
// k, k + 1, k + 2 of the call: offsets [n + 1], data bytes, valid uint8 [n] (or empty: all valid).
struct Cells {
  const int32_t* off32 = nullptr;
  const int64_t* off64 = nullptr;
  const uint8_t* data = nullptr;
  const uint8_t* end = nullptr;    // the end of the data buffer (fnv_short may read up to here)
  const uint8_t* valid = nullptr;  // null: every cell valid
  int64_t n = 0;

  int64_t begin(int64_t i) const { return off32 ? off32[i] : off64[i]; }

  template <class T>
  static bool in_order(const T* o, int64_t n, int64_t len) {  // one pass, no early exit: it vectorises
    bool bad = o[0] < 0;
    for (int64_t i = 0; i < n; ++i) bad |= o[i + 1] < o[i];
    return !(bad || o[n] > len);
  }

  Cells(const he::Call& call, int64_t k, int64_t n_cells) : n(n_cells) {
    if (n < 0) call.fail(HE_BAD_CALL, "n = %lld < 0", (long long)n);
    if (call.type(k) == HE_I32) off32 = call.buf<const int32_t>(k, n + 1, "offsets");
    else off64 = call.buf<const int64_t>(k, n + 1, "offsets");
    const int64_t len = call.numel(k + 1);
    data = len ? call.bytes<const uint8_t>(k + 1, len, "data") : nullptr;
    end = data + len;
    valid = call.opt<const uint8_t>(k + 2, n, "valid");
    if (off32 ? in_order(off32, n, len) : in_order(off64, n, len)) return;
    for (int64_t i = 0; i < n; ++i)  // name the first bad cell
      if (begin(i) < 0 || begin(i + 1) < begin(i) || begin(i + 1) > len) {
        call.detail({i, begin(i), begin(i + 1), len});
        call.fail(HE_BAD_CALL, "cell %lld spans [%lld, %lld) outside the %lld bytes", (long long)i,
                  (long long)begin(i), (long long)begin(i + 1), (long long)len);
      }
    call.detail({0, begin(0), len});
    call.fail(HE_BAD_CALL, "offset 0 = %lld outside the %lld bytes", (long long)begin(0), (long long)len);
  }

  bool present(int64_t i) const { return begin(i + 1) > begin(i) && !(valid && !valid[i]); }
};

// The parts (chunks) of a column, each three buffers from `first_buf` on and its cell count an integer
// argument from `first_int` on; returns the total count of cells.
inline int64_t count_parts(const he::Call& call, int64_t first_buf, int64_t first_int) {
  const int64_t parts = call.nints() - first_int;
  if (parts < 0 || call.nbufs() != first_buf + 3 * parts)
    call.fail(HE_BAD_CALL, "%lld buffers and %lld ints: expected %lld + 3 buffers per part and %lld + 1 int per part",
              (long long)call.nbufs(), (long long)call.nints(), (long long)first_buf, (long long)first_int);
  int64_t n = 0;
  for (int64_t p = 0; p < parts; ++p) {
    if (call.i(first_int + p) < 0) call.fail(HE_BAD_CALL, "part %lld has %lld cells", (long long)p,
                                             (long long)call.i(first_int + p));
    n += call.i(first_int + p);
  }
  return n;
}

// fn(piece, length) for each non-empty piece of [p, end) between occurrences of sep
// (non-overlapping, left to right, as pyarrow's split_pattern and str.split cut).
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

// The ids of several string columns (each given in parts: the chunks of an Arrow column), into columns
// of a row-major matrix.  The rows go in tiles, every column's cells of a tile in turn: the tile's rows
// of the matrix stay in cache while each column fills its slot (a whole column at a time would stream
// the matrix through memory once per column).
//   bufs: ids int64 [n * stride] (out: row i's id of column c at ids[i * stride + j_c]), then per column,
//         per part: offsets int32 or int64 [n_p + 1], data bytes, valid uint8 [n_p] (or empty: all valid)
//   ints: n, stride, columns, then per column: j_c (< stride), missing_c (the id of an empty or null
//         cell), parts_c; then per column, per part: n_p (a column's parts hold n cells in all)
// Returns the number of cells that held a value.
HE_KERNEL(he_hash_columns) {
  const int64_t n = call.i(0), stride = call.i(1), ncols = call.i(2);
  if (n < 0 || stride < 1 || ncols < 0 || ncols > stride)
    call.fail(HE_BAD_CALL, "n %lld, stride %lld, columns %lld", (long long)n, (long long)stride, (long long)ncols);
  struct Column {
    int64_t j, missing;
    std::vector<Cells> parts;
    size_t part = 0;  // the cursor: cell `at` of part `part`
    int64_t at = 0;
  };
  std::vector<Column> cols((size_t)ncols);
  int64_t next_int = 3 + 3 * ncols, next_buf = 1;
  for (int64_t c = 0; c < ncols; ++c) {
    Column& col = cols[(size_t)c];
    col.j = call.i(3 + 3 * c);
    col.missing = call.i(4 + 3 * c);
    const int64_t parts = call.i(5 + 3 * c);
    if (col.j < 0 || col.j >= stride || parts < 0)
      call.fail(HE_BAD_CALL, "column %lld: slot %lld of %lld, %lld parts", (long long)c, (long long)col.j,
                (long long)stride, (long long)parts);
    int64_t cells = 0;
    for (int64_t p = 0; p < parts; ++p, next_buf += 3) {
      col.parts.emplace_back(call, next_buf, call.i(next_int++));
      cells += col.parts.back().n;
    }
    if (cells != n) call.fail(HE_BAD_CALL, "column %lld has %lld cells, expected %lld", (long long)c, (long long)cells,
                              (long long)n);
  }
  if (call.nbufs() != next_buf || call.nints() != next_int)
    call.fail(HE_BAD_CALL, "%lld buffers and %lld ints, expected %lld and %lld", (long long)call.nbufs(),
              (long long)call.nints(), (long long)next_buf, (long long)next_int);
  int64_t* ids = call.buf<int64_t>(0, n * stride, "ids");
  int64_t present = 0;
  constexpr int64_t kTile = 1024;  // 1024 rows of 8-40 ids: 64-320 KiB, in L2
  for (int64_t r0 = 0; r0 < n; r0 += kTile) {
    const int64_t r1 = std::min(n, r0 + kTile);
    for (Column& col : cols) {
      for (int64_t r = r0; r < r1;) {
        while (col.at == col.parts[col.part].n) {  // past the end of a part (or an empty one)
          ++col.part;
          col.at = 0;
        }
        const Cells& cells = col.parts[col.part];
        const int64_t take = std::min(r1 - r, cells.n - col.at);
        int64_t* out = ids + r * stride + col.j;
        for (int64_t i = col.at; i < col.at + take; ++i, out += stride) {
          const int64_t b = cells.begin(i);
          const bool here = cells.present(i);
          const int64_t id = hash_id(cells.data + b, cells.begin(i + 1) - b, cells.end);
          *out = here ? id : col.missing;
          present += here;
        }
        col.at += take;
        r += take;
      }
    }
  }
  return present;
}

// Each cell of a string column (in parts) split at a separator into a bag of ids: empty pieces
// dropped, a longer bag cut to its last max_length ids, an empty (or null) cell one missing id.
// One pass: each piece hashed as it is found.
//   bufs: separator bytes, bag_offsets int64 [n + 1] (out: row i's ids are
//         ids[bag_offsets[i]:bag_offsets[i + 1]]), ids int64 [cap] (out; cap = the cells' bytes + n
//         always suffices), then per part: offsets int32 or int64 [n_p + 1], data bytes, valid uint8
//         [n_p] (or empty)
//   ints: max_length (<= 0: no limit), missing_id, then per part: n_p
// Returns the number of ids written.
HE_KERNEL(he_split_hash) {
  const int64_t n = count_parts(call, 3, 2);
  const int64_t max_length = call.i(0), missing = call.i(1);
  const int64_t sep_len = call.numel(0);
  if (sep_len < 1) call.fail(HE_BAD_CALL, "empty separator");
  const uint8_t* sep = call.bytes<const uint8_t>(0, sep_len, "separator");
  int64_t* bag_offsets = call.buf<int64_t>(1, n + 1, "bag_offsets");
  const int64_t cap = call.numel(2);
  int64_t* ids = call.opt<int64_t>(2, cap, "ids");
  int64_t at = 0, row = 0;
  bag_offsets[0] = 0;
  for (int64_t p = 0; p < call.nints() - 2; ++p) {
    const Cells cells(call, 3 + 3 * p, call.i(2 + p));
    for (int64_t i = 0; i < cells.n; ++i) {
      const int64_t b = cells.begin(i), len = cells.begin(i + 1) - b;
      if (at + len + 1 > cap) {  // every piece holds a byte: a row writes at most len ids, or its one missing id
        call.detail({row + i, cap});
        call.fail(HE_BAD_CALL, "ids holds %lld, too few at cell %lld", (long long)cap, (long long)(row + i));
      }
      const int64_t start = at;
      if (cells.present(i))
        split(cells.data + b, cells.data + b + len, sep, sep_len,
              [&](const uint8_t* q, int64_t k) { ids[at++] = hash_id(q, k, cells.end); });
      if (max_length > 0 && at - start > max_length) {  // a sequence keeps its latest values
        std::memmove(ids + start, ids + at - max_length, (size_t)max_length * sizeof(int64_t));
        at = start + max_length;
      }
      if (at == start) ids[at++] = missing;
      bag_offsets[row + i + 1] = at;
    }
    row += cells.n;
  }
  return at;
}
