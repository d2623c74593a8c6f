// Categorical cells -> int64 ids, over an Arrow string array's own buffers (offsets + bytes, no copy).
//
// The id of a value is the documented stable hash of its UTF-8 text (hugeembed/data/_hash.py's
// hash_text, the plain-Python definition the tests hold these kernels to): FNV-1a 64 over the
// bytes, MurmurHash3's finaliser (mix64), then bit 62 set and bit 63 clear.  An empty or null cell
// is the feature's missing id.  A value is hashed where it lies, and each distinct one once per call
// (Memo): the documented hash goes a byte at a time, ~4 cycles a byte, while finding a value seen
// before costs one 8-byte load and compare for a short value, a word-at-a-time hash and a memcmp
// for a long one.  A column whose values rarely repeat turns the memo off (one tile of trying).
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

// The first min(n, 8) bytes of [p, p + n) as a little-endian word, the rest zero (the bytes up to `end`
// may be read: one load when 8 are there).
inline uint64_t head_word(const uint8_t* p, int64_t n, const uint8_t* end) {
  uint64_t w = 0;
  if (end - p >= 8) {
    std::memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return n >= 8 ? w : w & ((1ULL << (8 * n)) - 1);
  }
  for (int64_t k = 0; k < n && k < 8; ++k) w |= (uint64_t)p[k] << (8 * k);
  return w;
}

// The ids of the distinct values met in one call (a bounded open-addressing table): a value seen before
// is found, not hashed again.  Keys are the exact bytes (the head word and the length, then memcmp
// for longer values), so an id found is the one hash_id gives, bit for bit.  Lookups cost little
// but miss on values that rarely repeat: check() turns the memo off when fewer than half of a
// stretch of lookups hit, and a full table takes no new values.
class Memo {
 public:
  Memo() = default;
  explicit Memo(bool on) : on_(on) {
    if (on_) slots_.assign(kSlots, Slot{});
  }
  bool on() const { return on_; }

  int64_t id(const uint8_t* p, int64_t n, const uint8_t* end) {
    const uint64_t w = head_word(p, n, end);
    uint64_t key = (w ^ (uint64_t)n) * 0x9e3779b97f4a7c15ULL;
    if (n > 8) {  // a word at a time over the rest: a fraction of the byte-serial hash's cost
      int64_t k = 8;
      for (; k + 8 <= n; k += 8) {
        uint64_t v;
        std::memcpy(&v, p + k, 8);
        key = ((key ^ (key >> 29)) ^ v) * 0xbf58476d1ce4e5b9ULL;
      }
      if (k < n) {  // the last bytes: the 8 that end the value (n > 8, so they are inside it)
        uint64_t v;
        std::memcpy(&v, p + n - 8, 8);
        key = ((key ^ (key >> 29)) ^ v) * 0xbf58476d1ce4e5b9ULL;
      }
    }
    ++lookups_;
    for (uint64_t at = key >> (64 - kBits);; at = (at + 1) & (kSlots - 1)) {
      Slot& s = slots_[at];
      if (s.len < 0) {  // not seen: hashed, and kept while there is room
        const int64_t id = hash_id(p, n, end);
        if (size_ < kCapacity) {
          s = Slot{w, n, p, id};
          ++size_;
        }
        return id;
      }
      if (s.len == n && s.word == w && (n <= 8 || std::memcmp(s.at + 8, p + 8, (size_t)(n - 8)) == 0)) {
        ++hits_;
        return s.id;
      }
    }
  }

  // Called now and then: off when the values seen since the last call mostly missed.
  void check() {
    if (lookups_ >= 512) {
      if (2 * hits_ < lookups_) {
        on_ = false;
        slots_.clear();
        slots_.shrink_to_fit();
      }
      lookups_ = hits_ = 0;
    }
  }

 private:
  struct Slot {
    uint64_t word = 0;
    int64_t len = -1;  // -1: empty
    const uint8_t* at = nullptr;
    int64_t id = 0;
  };
  static constexpr int kBits = 12;
  static constexpr int64_t kSlots = 1 << kBits, kCapacity = kSlots / 2;  // 128 KiB: stays in L2
  bool on_ = false;
  std::vector<Slot> slots_;
  int64_t size_ = 0, lookups_ = 0, hits_ = 0;
};

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
constexpr int64_t kMemoMinCells = 4096;  // fewer cells (a serving request): hashed directly, no table to fill

HE_KERNEL(he_hash_columns) {
  const int64_t n = call.i(0), stride = call.i(1), ncols = call.i(2);
  if (n < 0 || stride < 1 || ncols < 0 || ncols > stride)
    call.fail(HE_BAD_CALL, "n %lld, stride %lld, columns %lld", (long long)n, (long long)stride, (long long)ncols);
  struct Column {
    int64_t j, missing;
    std::vector<Cells> parts;
    size_t part = 0;  // the cursor: cell `at` of part `part`
    int64_t at = 0;
    Memo memo;
  };
  std::vector<Column> cols((size_t)ncols);
  int64_t next_int = 3 + 3 * ncols, next_buf = 1;
  for (int64_t c = 0; c < ncols; ++c) {
    Column& col = cols[(size_t)c];
    col.j = call.i(3 + 3 * c);
    col.memo = Memo(n >= kMemoMinCells);
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
        if (col.memo.on()) {
          for (int64_t i = col.at; i < col.at + take; ++i, out += stride) {
            const int64_t b = cells.begin(i);
            const bool here = cells.present(i);
            const int64_t id = col.memo.id(cells.data + b, cells.begin(i + 1) - b, cells.end);
            *out = here ? id : col.missing;
            present += here;
          }
        } else {
          for (int64_t i = col.at; i < col.at + take; ++i, out += stride) {
            const int64_t b = cells.begin(i);
            const bool here = cells.present(i);
            const int64_t id = hash_id(cells.data + b, cells.begin(i + 1) - b, cells.end);
            *out = here ? id : col.missing;
            present += here;
          }
        }
        col.at += take;
        r += take;
      }
      col.memo.check();
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
  int64_t at = 0, row = 0, checked = 0;
  bag_offsets[0] = 0;
  Memo memo(cap >= kMemoMinCells);
  for (int64_t p = 0; p < call.nints() - 2; ++p) {
    const Cells cells(call, 3 + 3 * p, call.i(2 + p));
    for (int64_t i = 0; i < cells.n; ++i) {
      const int64_t b = cells.begin(i), len = cells.begin(i + 1) - b;
      if (at + len + 1 > cap) {  // every piece holds a byte: a row writes at most len ids, or its one missing id
        call.detail({row + i, cap});
        call.fail(HE_BAD_CALL, "ids holds %lld, too few at cell %lld", (long long)cap, (long long)(row + i));
      }
      const int64_t start = at;
      if (cells.present(i)) {
        if (memo.on())
          split(cells.data + b, cells.data + b + len, sep, sep_len,
                [&](const uint8_t* q, int64_t k) { ids[at++] = memo.id(q, k, cells.end); });
        else
          split(cells.data + b, cells.data + b + len, sep, sep_len,
                [&](const uint8_t* q, int64_t k) { ids[at++] = hash_id(q, k, cells.end); });
        if (at - checked >= 1024) {
          memo.check();
          checked = at;
        }
      }
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
