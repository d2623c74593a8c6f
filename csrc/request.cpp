// The serving request bodies, parsed into arrays without the interpreter lock (ctypes releases it):
// an 8 MiB body no longer stalls the server's other threads.  The Python twins (the oracle of the
// parity tests, and the path without the kernels) are hugeembed/serving/_json_body.py and
// _lines_body.py.
//
// he_request_json reads one JSON request, strict RFC 8259 JSON (UTF-8; no NaN / Infinity; at most
// max_depth nested arrays and objects):
//
//   {"dense": [[n, ...], ...],                   B rows of num_dense numbers (float32; finite)
//    "sparse": {"<feature>": [[id, ...], ...]}}  B bags per feature: int64 ids, or strings of 1-8
//                                                hex digits, or "" (the feature's missing id)
//
// Other members (top-level, or features the model does not read) are checked as JSON and skipped;
// "dense", "sparse" and each model feature may appear once.  Any JSON array of rows or bags longer
// than max_rows fails with kJsonTooManyRows as soon as it is seen (the server's 413).
//
// he_request_lines checks and rewrites Criteo lines (TSV or CSV) into the tab-separated, labelled
// lines the Criteo reader parses (hugeembed/data, he_criteo_parse).
#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "common.h"

namespace {

// Why a body was refused: detail[0] of he_request_json's HE_BAD_VALUE (hugeembed/serving/_json_body.py
// turns each into its message; detail[1] is the byte offset, then the code's own values).
enum : int64_t {
  kJsonSyntax = 1,         // not JSON (pos)
  kJsonDepth = 2,          // nested deeper than max_depth (pos)
  kJsonNotObject = 3,      // the body is not an object
  kJsonMissing = 4,        // (pos, 0: "dense" / 1: "sparse" absent)
  kJsonDuplicate = 5,      // (pos, -1: "dense", -2: "sparse", f >= 0: feature f) given twice
  kJsonDenseNotList = 6,   // "dense" is not a non-empty list
  kJsonDenseRow = 7,       // (pos, row, values: -1 when the row is not a list)
  kJsonDenseValue = 8,     // (pos, row, column): not a number
  kJsonDenseFinite = 9,    // (pos, row, column): not a finite float32
  kJsonSparseNotObject = 10,
  kJsonMissingFeature = 11,  // (pos, f)
  kJsonBags = 12,          // (pos, f, bags: -1 when not a list): not B bags
  kJsonBagNotList = 13,    // (pos, f, row)
  kJsonIdType = 14,        // (pos, f, row): not an integer nor a string
  kJsonIdRange = 15,       // (pos, f, row): outside int64
  kJsonIdHex = 16,         // (pos, f, row): a string but not 1-8 hex digits
  kJsonIdEmpty = 17,       // (pos, f, row): "" for a feature without a missing id
  kJsonTooManyRows = 18,   // (pos, rows so far, max_rows)
  kJsonTooManyIds = 19,    // (pos, capacity): more ids than the output holds (a caller's bug)
};

// Python's int(str) refuses more digits than this (sys.get_int_max_str_digits()): the JSON twin
// does, so this parser refuses such integer literals as well.
constexpr int64_t kMaxIntDigits = 4300;

struct Refused {
  int64_t code, pos, a, b, c;
};

struct Number {
  const char* begin;
  const char* end;
  bool integer;  // no fraction, no exponent
};

class JsonRequest {
 public:
  JsonRequest(const char* body, int64_t n, int64_t max_depth) : begin_(body), p_(body), end_(body + n),
                                                               max_depth_(max_depth) {}

  [[noreturn]] void refuse(int64_t code, int64_t a = 0, int64_t b = 0, int64_t c = 0) const {
    throw Refused{code, (int64_t)(p_ - begin_), a, b, c};
  }
  [[noreturn]] void syntax() const { refuse(kJsonSyntax); }

  void ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  int peek() {
    ws();
    return p_ < end_ ? (unsigned char)*p_ : -1;
  }
  void expect(char c) {
    if (peek() != (unsigned char)c) syntax();
    ++p_;
  }
  bool at_end() {
    ws();
    return p_ == end_;
  }
  // After a member or an element: true when another follows (','), false at `close`.
  bool more(char close) {
    const int c = peek();
    if (c == ',') {
      ++p_;
      return true;
    }
    if (c != (unsigned char)close) syntax();
    ++p_;
    return false;
  }
  // At '[' or '{' (already peeked): enters it; true when it is empty (and leaves it).
  bool open(char close) {
    if (++depth_ > max_depth_) refuse(kJsonDepth);
    ++p_;
    if (peek() == (unsigned char)close) {
      ++p_;
      --depth_;
      return true;
    }
    return false;
  }
  void close() { --depth_; }

  // A string at p_ ('"'), checked (escapes, UTF-8, no control characters); decoded into *out
  // (UTF-8; a lone surrogate escape as its 3-byte form, which no valid name equals) when given.
  void string(std::string* out) {
    if (peek() != '"') syntax();
    ++p_;
    if (out) out->clear();
    while (true) {
      if (p_ >= end_) syntax();
      const unsigned char c = (unsigned char)*p_;
      if (c == '"') {
        ++p_;
        return;
      }
      if (c < 0x20) syntax();
      if (c == '\\') {
        escape(out);
      } else if (c < 0x80) {
        if (out) out->push_back((char)c);
        ++p_;
      } else {
        const char* start = p_;
        utf8();
        if (out) out->append(start, p_);
      }
    }
  }

  // A number at p_, checked against JSON's grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  Number number() {
    ws();
    const char* s = p_;
    if (p_ < end_ && *p_ == '-') ++p_;
    if (p_ >= end_ || !digit(*p_)) syntax();
    if (*p_ == '0') ++p_;
    else
      while (p_ < end_ && digit(*p_)) ++p_;
    bool integer = true;
    if (p_ < end_ && *p_ == '.') {
      integer = false;
      ++p_;
      if (p_ >= end_ || !digit(*p_)) syntax();
      while (p_ < end_ && digit(*p_)) ++p_;
    }
    if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
      integer = false;
      ++p_;
      if (p_ < end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      if (p_ >= end_ || !digit(*p_)) syntax();
      while (p_ < end_ && digit(*p_)) ++p_;
    }
    if (integer && (p_ - s) - (*s == '-') > kMaxIntDigits) {
      p_ = s;
      syntax();
    }
    return {s, p_, integer};
  }

  // Any JSON value, checked and skipped.
  void skip() {
    const int c = peek();
    if (c == '{') {
      if (open('}')) return;
      do {
        string(nullptr);
        expect(':');
        skip();
      } while (more('}'));
      close();
    } else if (c == '[') {
      if (open(']')) return;
      do skip();
      while (more(']'));
      close();
    } else if (c == '"') {
      string(nullptr);
    } else if (c == 't') {
      literal("true");
    } else if (c == 'f') {
      literal("false");
    } else if (c == 'n') {
      literal("null");
    } else {
      number();
    }
  }

  const char* pos() const { return p_; }
  void seek(const char* p) { p_ = p; }

 private:
  static bool digit(char c) { return c >= '0' && c <= '9'; }
  static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  void literal(const char* word) {
    const size_t n = std::strlen(word);
    if ((size_t)(end_ - p_) < n || std::memcmp(p_, word, n) != 0) syntax();
    p_ += n;
  }
  int u16() {  // the 4 hex digits of a \u escape at p_
    if (end_ - p_ < 4) syntax();
    int v = 0;
    for (int k = 0; k < 4; ++k) {
      const int h = hexval(p_[k]);
      if (h < 0) syntax();
      v = v * 16 + h;
    }
    p_ += 4;
    return v;
  }
  static void put_utf8(std::string* out, uint32_t cp) {
    if (!out) return;
    if (cp < 0x80) {
      out->push_back((char)cp);
    } else if (cp < 0x800) {
      out->push_back((char)(0xC0 | (cp >> 6)));
      out->push_back((char)(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back((char)(0xE0 | (cp >> 12)));
      out->push_back((char)(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back((char)(0x80 | (cp & 0x3F)));
    } else {
      out->push_back((char)(0xF0 | (cp >> 18)));
      out->push_back((char)(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back((char)(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back((char)(0x80 | (cp & 0x3F)));
    }
  }
  void escape(std::string* out) {  // at '\\'
    ++p_;
    if (p_ >= end_) syntax();
    const char e = *p_++;
    switch (e) {
      case '"': case '\\': case '/': if (out) out->push_back(e); return;
      case 'b': if (out) out->push_back('\b'); return;
      case 'f': if (out) out->push_back('\f'); return;
      case 'n': if (out) out->push_back('\n'); return;
      case 'r': if (out) out->push_back('\r'); return;
      case 't': if (out) out->push_back('\t'); return;
      case 'u': break;
      default: --p_; syntax();
    }
    uint32_t cp = (uint32_t)u16();
    // a high surrogate followed by a low one is one code point (as Python's json reads them)
    if (cp >= 0xD800 && cp < 0xDC00 && end_ - p_ >= 6 && p_[0] == '\\' && p_[1] == 'u') {
      const char* save = p_;
      p_ += 2;
      const uint32_t lo = (uint32_t)u16();
      if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
      else p_ = save;
    }
    put_utf8(out, cp);
  }
  void utf8() {  // one multi-byte UTF-8 sequence at p_ (strict: no overlong forms, no surrogates)
    const unsigned char c = (unsigned char)*p_;
    int n;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF) n = 1, cp = c & 0x1F, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) n = 2, cp = c & 0x0F, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) n = 3, cp = c & 0x07, min = 0x10000;
    else syntax();
    if (end_ - p_ <= n) syntax();
    for (int k = 1; k <= n; ++k) {
      const unsigned char d = (unsigned char)p_[k];
      if ((d & 0xC0) != 0x80) syntax();
      cp = (cp << 6) | (d & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) syntax();
    p_ += n + 1;
  }

  const char* begin_;
  const char* p_;
  const char* end_;
  int64_t depth_ = 0;
  int64_t max_depth_;
};

// The decimal exponent of a number's leading nonzero digit (0 for a zero), from its digits and
// exponent: what decides whether a literal beyond a double's range is huge or tiny.
int64_t decimal_exponent(const Number& n) {
  const char* q = n.begin + (*n.begin == '-');
  int64_t int_digits = 0, lead = -1, k = 0;  // lead: position of the first nonzero digit among all digits
  bool frac = false;
  for (; q < n.end && *q != 'e' && *q != 'E'; ++q) {
    if (*q == '.') {
      frac = true;
      continue;
    }
    if (!frac) ++int_digits;
    if (lead < 0 && *q != '0') lead = k;
    ++k;
  }
  if (lead < 0) return 0;
  int64_t e = 0;
  if (q < n.end) {
    const bool neg = q[1] == '-';
    for (const char* d = q + 1 + (q[1] == '+' || q[1] == '-'); d < n.end && e < ((int64_t)1 << 40); ++d)
      e = e * 10 + (*d - '0');
    if (neg) e = -e;
  }
  return int_digits - 1 - lead + e;
}

struct Outputs {
  int64_t num_dense, max_rows, cap_rows, F;
  const char* names;
  const int64_t* name_off;
  const int64_t* missing;
  float* dense;
  int64_t* values;
  int64_t values_cap;
  int64_t* lengths;  // bag b of feature f at b * F + f (b < cap_rows)
  int64_t* spans;    // feature f's ids: values[spans[2f], spans[2f + 1])
};

// The feature a decoded key names, or -1.
int64_t feature_of(const Outputs& o, const std::string& key) {
  for (int64_t f = 0; f < o.F; ++f) {
    const int64_t n = o.name_off[f + 1] - o.name_off[f];
    if ((size_t)n == key.size() && (n == 0 || std::memcmp(o.names + o.name_off[f], key.data(), (size_t)n) == 0)) return f;
  }
  return -1;
}

int64_t parse_dense(JsonRequest& js, const Outputs& o) {
  if (js.peek() != '[') js.refuse(kJsonDenseNotList);
  if (js.open(']')) js.refuse(kJsonDenseNotList);
  int64_t rows = 0;
  do {
    if (rows == o.max_rows) js.refuse(kJsonTooManyRows, rows + 1, o.max_rows);
    if (rows == o.cap_rows) js.refuse(kJsonTooManyIds, o.cap_rows);  // cannot be: cap_rows bounds the rows
    if (js.peek() != '[') js.refuse(kJsonDenseRow, rows, -1);
    const char* row_start = js.pos();
    int64_t col = 0;
    if (!js.open(']')) {
      do {
        const int c = js.peek();
        const char* at = js.pos();
        if (c != '-' && !(c >= '0' && c <= '9')) js.refuse(kJsonDenseValue, rows, col);
        const Number n = js.number();
        double v = 0;
        auto r = std::from_chars(n.begin, n.end, v);
        if (r.ec == std::errc::result_out_of_range) {  // beyond a double: inf, or 0 when tiny
          v = decimal_exponent(n) > 0 ? INFINITY : 0.0;
          if (*n.begin == '-') v = -v;
        } else if (r.ec != std::errc() || r.ptr != n.end) {
          js.seek(at);
          js.refuse(kJsonDenseValue, rows, col);
        }
        const float f = (float)v;
        if (!std::isfinite(f)) {
          js.seek(at);
          js.refuse(kJsonDenseFinite, rows, col);
        }
        if (col < o.num_dense) o.dense[rows * o.num_dense + col] = f;
        ++col;
      } while (js.more(']'));
      js.close();
    }
    if (col != o.num_dense) {
      js.seek(row_start);
      js.refuse(kJsonDenseRow, rows, col);
    }
    ++rows;
  } while (js.more(']'));
  js.close();
  return rows;
}

// Feature f's bags (the value after its key); returns how many.
int64_t parse_bags(JsonRequest& js, const Outputs& o, int64_t f, int64_t* n_values, std::string& scratch) {
  if (js.peek() != '[') js.refuse(kJsonBags, f, -1);
  o.spans[2 * f] = *n_values;
  int64_t bags = 0;
  if (!js.open(']')) {
    do {
      if (bags == o.max_rows) js.refuse(kJsonTooManyRows, bags + 1, o.max_rows);
      if (js.peek() != '[') js.refuse(kJsonBagNotList, f, bags);
      int64_t count = 0;
      if (!js.open(']')) {
        do {
          const int c = js.peek();
          int64_t id = 0;
          if (c == '"') {
            const char* at = js.pos();
            js.string(&scratch);
            if (scratch.empty()) {
              if (o.missing[f] < 0) {
                js.seek(at);
                js.refuse(kJsonIdEmpty, f, bags);
              }
              id = o.missing[f];
            } else {
              bool hex = scratch.size() <= 8;
              for (size_t k = 0; hex && k < scratch.size(); ++k) {
                const char ch = scratch[k];
                const int h = (ch >= '0' && ch <= '9') ? ch - '0'
                              : (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10
                              : (ch >= 'A' && ch <= 'F') ? ch - 'A' + 10 : -1;
                hex = h >= 0;
                id = id * 16 + h;
              }
              if (!hex) {
                js.seek(at);
                js.refuse(kJsonIdHex, f, bags);
              }
            }
          } else if (c == '-' || (c >= '0' && c <= '9')) {
            const char* at = js.pos();
            const Number n = js.number();
            if (!n.integer) {
              js.seek(at);
              js.refuse(kJsonIdType, f, bags);
            }
            auto r = std::from_chars(n.begin, n.end, id);
            if (r.ec != std::errc() || r.ptr != n.end) {
              js.seek(at);
              js.refuse(kJsonIdRange, f, bags);
            }
          } else {
            js.refuse(kJsonIdType, f, bags);
          }
          if (*n_values >= o.values_cap) js.refuse(kJsonTooManyIds, o.values_cap);
          o.values[(*n_values)++] = id;
          ++count;
        } while (js.more(']'));
        js.close();
      }
      if (bags < o.cap_rows) o.lengths[bags * o.F + f] = count;  // more bags than rows: refused below
      ++bags;
    } while (js.more(']'));
    js.close();
  }
  o.spans[2 * f + 1] = *n_values;
  return bags;
}

// The whole body; returns B.  `bags[f]` (out) the bags of feature f, -1 where absent.
int64_t parse_request(JsonRequest& js, const Outputs& o, int64_t* bags) {
  if (js.peek() != '{') {  // JSON but no object, or not JSON at all
    const char* start = js.pos();
    js.skip();
    if (!js.at_end()) js.syntax();
    js.seek(start);
    js.refuse(kJsonNotObject);
  }
  int64_t rows = -1;
  bool sparse_seen = false;
  std::string key, scratch;
  for (int64_t f = 0; f < o.F; ++f) bags[f] = -1;
  int64_t n_values = 0;
  if (!js.open('}')) {
    do {
      const char* at = js.pos();
      js.string(&key);
      js.expect(':');
      if (key == "dense") {
        if (rows >= 0) {
          js.seek(at);
          js.refuse(kJsonDuplicate, -1);
        }
        rows = parse_dense(js, o);
      } else if (key == "sparse") {
        if (sparse_seen) {
          js.seek(at);
          js.refuse(kJsonDuplicate, -2);
        }
        sparse_seen = true;
        if (js.peek() != '{') js.refuse(kJsonSparseNotObject);
        if (!js.open('}')) {
          do {
            const char* fat = js.pos();
            js.string(&key);
            js.expect(':');
            const int64_t f = feature_of(o, key);
            if (f < 0) {
              js.skip();
              continue;
            }
            if (bags[f] >= 0) {
              js.seek(fat);
              js.refuse(kJsonDuplicate, f);
            }
            bags[f] = parse_bags(js, o, f, &n_values, scratch);
          } while (js.more('}'));
          js.close();
        }
      } else {
        js.skip();
      }
    } while (js.more('}'));
    js.close();
  }
  if (!js.at_end()) js.syntax();
  if (rows < 0) js.refuse(kJsonMissing, 0);
  if (!sparse_seen) js.refuse(kJsonMissing, 1);
  for (int64_t f = 0; f < o.F; ++f)
    if (bags[f] < 0) js.refuse(kJsonMissingFeature, f);
  for (int64_t f = 0; f < o.F; ++f)
    if (bags[f] != rows) js.refuse(kJsonBags, f, bags[f]);
  return rows;
}

}  // namespace

// One JSON request body (see the top of this file) into arrays.
//   bufs: body bytes [n], names bytes (the model's feature names, UTF-8, one after the other),
//         name_off int64 [F + 1] (feature f's name: names[name_off[f], name_off[f + 1])),
//         missing int64 [F] (the id "" stands for; < 0: "" is refused),
//         dense float32 [cap_rows * num_dense] (out, row-major), values int64 [cap] (out: the ids,
//         each feature's together, in the body's order), lengths int64 [cap_rows * F] (out: bag b
//         of feature f at b * F + f), spans int64 [2 F] (out: feature f's ids are
//         values[spans[2f], spans[2f + 1]])
//   ints: num_dense, max_rows (more rows or bags: kJsonTooManyRows), cap_rows (the rows the body's
//         bytes can hold, n / (2 num_dense + 1) + 1: the outputs' size), max_depth
// Returns B, the rows.  Fails with HE_BAD_VALUE, detail = (code, byte offset, the code's values:
// see the enum above), when the body is refused; the outputs are then scratch.
HE_KERNEL(he_request_json) {
  call.expect(8, 4, 0);
  const int64_t num_dense = call.i(0), max_rows = call.i(1), cap_rows = call.i(2), max_depth = call.i(3);
  const int64_t n = call.numel(0), F = call.numel(3);
  if (num_dense < 0 || max_rows < 1 || cap_rows < 1 || max_depth < 1 || call.numel(2) != F + 1 ||
      cap_rows > INT64_MAX / std::max<int64_t>({1, num_dense, F}))
    call.fail(HE_BAD_CALL, "num_dense %lld, max_rows %lld, cap_rows %lld, max_depth %lld, %lld features",
              (long long)num_dense, (long long)max_rows, (long long)cap_rows, (long long)max_depth, (long long)F);
  Outputs o;
  o.num_dense = num_dense;
  o.max_rows = max_rows;
  o.cap_rows = cap_rows;
  o.F = F;
  const char* body = call.bytes<const char>(0, n, "body");
  const int64_t* name_off = call.buf<const int64_t>(2, F + 1, "name_off");
  o.names = call.bytes<const char>(1, 0, "names");
  for (int64_t f = 0; f < F; ++f)
    if (name_off[f] < 0 || name_off[f + 1] < name_off[f] || name_off[f + 1] > call.numel(1))
      call.fail(HE_BAD_CALL, "feature %lld: name bytes [%lld, %lld) outside %lld", (long long)f,
                (long long)name_off[f], (long long)name_off[f + 1], (long long)call.numel(1));
  o.name_off = name_off;
  o.missing = call.buf<const int64_t>(3, F, "missing");
  o.dense = call.buf<float>(4, cap_rows * num_dense, "dense");
  o.values_cap = call.numel(5);
  o.values = call.buf<int64_t>(5, 0, "values");
  o.lengths = call.buf<int64_t>(6, cap_rows * F, "lengths");
  o.spans = call.buf<int64_t>(7, 2 * F, "spans");
  std::vector<int64_t> bags((size_t)F);
  JsonRequest js(body ? body : "", n, max_depth);
  try {
    return parse_request(js, o, bags.data());
  } catch (const Refused& r) {
    call.detail({r.code, r.pos, r.a, r.b, r.c});
    call.fail(HE_BAD_VALUE, "request refused (code %lld at byte %lld)", (long long)r.code, (long long)r.pos);
  }
}

// Why Criteo lines were refused: detail[0] of he_request_lines' HE_BAD_VALUE.
enum : int64_t {
  kLinesEmpty = 1,        // no line
  kLinesFirst = 2,        // (line 0, fields): line 1 has neither 40 fields (a label) nor 39
  kLinesFields = 3,       // (line, fields, fields of line 1)
  kLinesTooMany = 4,      // (lines counted so far, max_rows)
  kLinesTab = 5,          // (line): a tab in a CSV body
};

// Criteo lines, `sep`-separated (a tab or a comma), into the Criteo reader's form: tab-separated,
// each with its label column ("0\t" put in front of lines of 39 fields), '\n' line ends (a '\r'
// before one is kept: the reader drops it), without the body's trailing line ends.
//   bufs: body bytes [n], out bytes [n + 2 * lines] (out)
//   ints: sep, max_rows
// Returns the bytes written.  Fails with HE_BAD_VALUE, detail = (code, its values: see the enum),
// when the lines are refused (every line is checked before the first byte is written).
HE_KERNEL(he_request_lines) {
  call.expect(2, 2, 0);
  const int64_t sep = call.i(0), max_rows = call.i(1);
  if ((sep != '\t' && sep != ',') || max_rows < 1)
    call.fail(HE_BAD_CALL, "separator %lld, max_rows %lld", (long long)sep, (long long)max_rows);
  int64_t n = call.numel(0);
  const char* body = call.bytes<const char>(0, n, "body");
  while (n > 0 && (body[n - 1] == '\n' || body[n - 1] == '\r')) --n;
  if (n == 0) {
    call.detail({kLinesEmpty});
    call.fail(HE_BAD_VALUE, "no line");
  }
  // pass 1: count lines and fields
  int64_t lines = 0, first = -1;
  for (const char* p = body; p < body + n;) {
    const char* nl = (const char*)std::memchr(p, '\n', (size_t)(body + n - p));
    const char* e = nl ? nl : body + n;
    if (lines == max_rows) {
      call.detail({kLinesTooMany, lines + 1, max_rows});
      call.fail(HE_BAD_VALUE, "more than %lld lines", (long long)max_rows);
    }
    int64_t fields = 1;
    for (const char* q = p; q < e; ++q) fields += (*q == (char)sep);
    if (sep == ',' && std::memchr(p, '\t', (size_t)(e - p)) != nullptr) {
      call.detail({kLinesTab, lines});
      call.fail(HE_BAD_VALUE, "line %lld: a tab in a CSV body", (long long)lines);
    }
    if (first < 0) {
      if (fields != 39 && fields != 40) {
        call.detail({kLinesFirst, 0, fields});
        call.fail(HE_BAD_VALUE, "line 1: %lld fields", (long long)fields);
      }
      first = fields;
    } else if (fields != first) {
      call.detail({kLinesFields, lines, fields, first});
      call.fail(HE_BAD_VALUE, "line %lld: %lld fields, line 1 has %lld", (long long)lines, (long long)fields,
                (long long)first);
    }
    ++lines;
    p = nl ? nl + 1 : body + n;
  }
  const int64_t extra = first == 39 ? 2 : 0;
  char* out = call.bytes<char>(1, n + extra * lines, "out");
  // pass 2: write
  char* w = out;
  for (const char* p = body; p < body + n;) {
    const char* nl = (const char*)std::memchr(p, '\n', (size_t)(body + n - p));
    const char* e = nl ? nl : body + n;
    if (extra) {
      *w++ = '0';
      *w++ = '\t';
    }
    if (sep == '\t') {
      std::memcpy(w, p, (size_t)(e - p));
      w += e - p;
    } else {
      for (const char* q = p; q < e; ++q) *w++ = *q == ',' ? '\t' : *q;
    }
    if (nl) *w++ = '\n';
    p = nl ? nl + 1 : body + n;
  }
  return w - out;
}
