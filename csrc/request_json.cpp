// The serving JSON request bodies, parsed into arrays without the interpreter lock (ctypes releases it):
// an 8 MiB body no longer stalls the server's other threads.  The Python twin (the oracle of the
// parity tests, and the path without the kernels) is hugeembed/serving/_json_body.py.  The JSON
// reader (tokens, refusal codes) is json_reader.h; Criteo lines are request_lines.cpp's.
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
#include <string>
#include <vector>

#include "json_reader.h"

namespace {

using namespace he_json;

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
