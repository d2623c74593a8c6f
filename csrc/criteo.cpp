// Criteo display-advertising TSV parser.
//
// One line = 40 tab-separated fields: label \t I1..I13 \t C1..C26.
//   label : "0" or "1"
//   I<k>  : empty (missing) or a decimal integer with an optional leading '-', at most
//           18 digits; written out as dense = log1p(max(x, 0)) in float32, missing -> 0
//   C<k>  : empty (missing) or 1..8 hex digits (either case); written out as the int64
//           value of the hex, missing -> missing_ids[k] (chosen >= 2^32 by the caller,
//           so it cannot collide with a parsed 32-bit value)
// Lines end with '\n'; a '\r' just before it is dropped (CRLF files); the last line of
// the buffer may lack its '\n'.  Anything else is a malformed line: the parser either
// stops at the first one and reports where (line, byte offset, field, code), or skips
// it and counts it (skip_bad = 1).  A malformed line never shifts columns.
//
// Only lines whose global index satisfies index % stride == phase are parsed; the
// others are stepped over unread (rank slicing for distributed training).  The Python
// twin of this kernel is hugeembed/data/_parse_numpy.py; tests check they agree.
#include <cmath>

#include "common.h"

namespace {

constexpr int kDense = 13;
constexpr int kCats = 26;
constexpr int kFields = 1 + kDense + kCats;

// the code of a malformed line (the detail of a failed he_criteo_parse, the `bad` entries of
// skipped lines), shared with hugeembed/data/_parse_numpy.py (FIELD_COUNT ...)
constexpr int64_t kOk = 0;
constexpr int64_t kFieldCount = 1;
constexpr int64_t kBadLabel = 2;
constexpr int64_t kBadInt = 3;
constexpr int64_t kBadHex = 4;

struct HexTable {
  uint8_t v[256];
  HexTable() {
    for (int i = 0; i < 256; ++i) v[i] = 0xFF;
    for (int i = 0; i < 10; ++i) v['0' + i] = (uint8_t)i;
    for (int i = 0; i < 6; ++i) {
      v['a' + i] = (uint8_t)(10 + i);
      v['A' + i] = (uint8_t)(10 + i);
    }
  }
};
const HexTable kHex;

// Parses one line [p, end) (no '\n', '\r' already dropped).  Returns an error code and
// sets *bad_field (0 = label, 1..13 = I1..I13, 14..39 = C1..C26, -1 = field count) and
// *nfields (number of fields found, for count errors).
inline int64_t parse_line(const char* p, const char* end, const int64_t* missing_ids, float* label,
                          float* dense, int64_t* cats, int64_t* bad_field, int64_t* nfields) {
  // Field count first: a line with the wrong count must never be parsed positionally.
  int64_t tabs = 0;
  for (const char* q = p; q < end; ++q) tabs += (*q == '\t');
  if (tabs != kFields - 1) {
    *bad_field = -1;
    *nfields = tabs + 1;
    return kFieldCount;
  }
  // label
  if (end - p < 2 || (p[0] != '0' && p[0] != '1') || p[1] != '\t') {
    *bad_field = 0;
    return kBadLabel;
  }
  *label = (float)(p[0] - '0');
  p += 2;
  // integer fields
  for (int i = 0; i < kDense; ++i) {
    const char* q = p;
    bool neg = false;
    if (q < end && *q == '-') {
      neg = true;
      ++q;
    }
    int64_t v = 0;
    int digits = 0;
    while (q < end && *q != '\t') {
      unsigned d = (unsigned)(*q - '0');
      if (d > 9 || digits >= 18) {
        *bad_field = 1 + i;
        return kBadInt;
      }
      v = v * 10 + d;
      ++digits;
      ++q;
    }
    if (digits == 0 && neg) {  // a lone '-'
      *bad_field = 1 + i;
      return kBadInt;
    }
    if (neg) v = -v;
    // missing and negative both give log1p(0) = 0
    dense[i] = (v > 0) ? (float)std::log1p((double)v) : 0.0f;
    p = q + 1;  // past the tab (the count check guarantees one is there)
  }
  // categorical fields
  for (int i = 0; i < kCats; ++i) {
    const char* q = p;
    uint64_t v = 0;
    int digits = 0;
    while (q < end && *q != '\t') {
      uint8_t d = kHex.v[(uint8_t)*q];
      if (d == 0xFF || digits >= 8) {
        *bad_field = 1 + kDense + i;
        return kBadHex;
      }
      v = (v << 4) | d;
      ++digits;
      ++q;
    }
    cats[i] = digits ? (int64_t)v : missing_ids[i];
    p = q + 1;
  }
  return kOk;
}

// The text buffer k: raw bytes (uint8), all of it.
const char* text_of(const he::Call& call, int64_t k, int64_t* len) {
  *len = call.numel(k);
  return call.bytes<const char>(k, *len, "text");
}

int64_t count_lines(const char* buf, int64_t len) {
  int64_t n = 0;
  const char* p = buf;
  const char* end = buf + len;
  while (p < end) {
    const void* hit = std::memchr(p, '\n', (size_t)(end - p));
    if (!hit) {
      ++n;
      break;
    }
    ++n;
    p = (const char*)hit + 1;
  }
  return n;
}

}  // namespace

// Number of lines in the text: the count of '\n', plus one when it does not end with '\n'
// (a last line without newline).  Used to size the output arrays.
// bufs: text bytes [len].
HE_KERNEL(he_criteo_count_lines) {
  call.expect(1, 0, 0);
  int64_t len = 0;
  const char* buf = text_of(call, 0, &len);
  return count_lines(buf, len);
}

// Parses the lines of the text into labels [cap], dense [cap, 13], cats [cap, 26].
//   bufs: text bytes [len], missing_ids int64 [26], labels float32 [cap], dense float32 [cap * 13],
//         cats int64 [cap * 26], counts int64 [2] (out: lines seen, lines skipped as malformed),
//         bad int64 [bad_cap * 3] (out: (line index within the text, code, field) of the first
//         bad_cap skipped lines, for the caller's summary)
//   ints: first_line (global index of the text's first line, for stride/phase selection), stride,
//         phase (0 <= phase < stride), skip_bad, cap, bad_cap
// Returns the rows written.
// Fails with HE_BAD_VALUE at the first malformed selected line unless skip_bad: detail = (line
// index within the text, its byte offset, field (0 = label, 1..13 = I1..I13, 14..39 = C1..C26,
// -1 = field count), code (kFieldCount, kBadLabel, kBadInt, kBadHex: _parse_numpy.py's
// FIELD_COUNT ...), fields found (field count errors)).  With HE_BAD_CALL when `cap` rows are
// not enough (detail = (line, cap)).  The rows before that line may have been written then
// (the output arrays are the caller's scratch; checking every line first would parse twice).
HE_KERNEL(he_criteo_parse) {
  call.expect(7, 6, 0);
  const int64_t first_line = call.i(0), stride = call.i(1), phase = call.i(2), skip_bad = call.i(3);
  const int64_t cap = call.i(4), bad_cap = call.i(5);
  if (stride < 1 || phase < 0 || phase >= stride || cap < 0 || bad_cap < 0 || cap > INT64_MAX / kCats ||
      bad_cap > INT64_MAX / 3)
    call.fail(HE_BAD_CALL, "stride %lld, phase %lld, cap %lld, bad_cap %lld: need 0 <= phase < stride, counts >= 0",
              (long long)stride, (long long)phase, (long long)cap, (long long)bad_cap);
  int64_t len = 0;
  const char* buf = text_of(call, 0, &len);
  const int64_t* missing_ids = call.buf<const int64_t>(1, kCats, "missing_ids");
  float* labels = call.buf<float>(2, cap, "labels");
  float* dense = call.buf<float>(3, cap * kDense, "dense");
  int64_t* cats = call.buf<int64_t>(4, cap * kCats, "cats");
  int64_t* counts = call.buf<int64_t>(5, 2, "counts");
  int64_t* bad = call.buf<int64_t>(6, bad_cap * 3, "bad");

  int64_t rows = 0, line = 0, skipped = 0;
  const char* p = buf;
  const char* bend = buf + len;
  int64_t sel = ((first_line % stride) + stride) % stride;  // index % stride of the current line
  while (p < bend) {
    const char* nl = (const char*)std::memchr(p, '\n', (size_t)(bend - p));
    const char* lend = nl ? nl : bend;
    if (sel == phase) {
      const char* cend = lend;
      if (cend > p && cend[-1] == '\r') --cend;
      if (rows >= cap) {
        call.detail({line, cap});
        call.fail(HE_BAD_CALL, "ran out of output rows at line %lld (cap %lld)", (long long)line, (long long)cap);
      }
      int64_t field = 0, nfields = 0;
      int64_t code = parse_line(p, cend, missing_ids, labels + rows, dense + rows * kDense,
                                cats + rows * kCats, &field, &nfields);
      if (code == kOk) {
        ++rows;
      } else if (skip_bad) {
        if (skipped < bad_cap) {
          bad[skipped * 3 + 0] = line;
          bad[skipped * 3 + 1] = code;
          bad[skipped * 3 + 2] = field;
        }
        ++skipped;
      } else {
        call.detail({line, (int64_t)(p - buf), field, code, nfields});
        call.fail(HE_BAD_VALUE, "line %lld: malformed (code %lld, field %lld)", (long long)line, (long long)code,
                  (long long)field);
      }
    }
    ++line;
    if (++sel == stride) sel = 0;
    if (!nl) break;
    p = nl + 1;
  }
  counts[0] = line;
  counts[1] = skipped;
  return rows;
}
