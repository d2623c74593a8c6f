// The serving request bodies of Criteo lines (TSV or CSV), checked and rewritten without the
// interpreter lock (ctypes releases it) into the tab-separated, labelled lines the Criteo reader
// parses (hugeembed/data, he_criteo_parse).  The Python twin (the parity tests' oracle, and the path
// without the kernels) is hugeembed/serving/_lines_body.py; JSON bodies: request_json.cpp.
#include "common.h"

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
