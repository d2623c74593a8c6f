// The JSON reader of the serving request kernels (request_json.cpp): strict RFC 8259 JSON (UTF-8; no
// NaN / Infinity; at most max_depth nested arrays and objects), read token by token straight out of
// the body, refusing with a code and the byte offset (Refused) instead of building a document.  The
// codes are he_request_json's refusals; hugeembed/serving/_json_body.py turns each into its message.
#pragma once

#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "common.h"

namespace he_json {

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
inline int64_t decimal_exponent(const Number& n) {
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

}  // namespace he_json
