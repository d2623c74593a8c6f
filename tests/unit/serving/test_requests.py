"""Request bodies -> arrays: the kernels (csrc/request_json.cpp, request_lines.cpp) against their Python twins on
generated and mutated bodies, against an independent oracle (json + NumPy, written here) on valid ones, and every
refusal an InputError (the server's 400), RequestTooLarge (413) or UnsupportedContentType (415)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hugeembed import _native
from hugeembed.data import CAT_NAMES, SyntheticConfig, SyntheticCriteo, format_criteo_lines, missing_id
from hugeembed.errors import InputError
from hugeembed.serving._lines_body import criteo_lines
from hugeembed.serving._requests import (BodyParser, ParsedRequest, RequestTooLarge, UnsupportedContentType,
                                         concat_requests, media_type)

needs_native = pytest.mark.skipif(not _native.available(), reason="native kernels not built")
FEATURES = ("C1", "user", "C3")  # two Criteo features (they have a missing id) and one other
NUM_DENSE = 2


def _parsers(max_rows=1000, features=FEATURES, num_dense=NUM_DENSE):
    return [BodyParser(features, num_dense, max_rows=max_rows, native=n) for n in (True, False)]


def _outcome(parser, body: bytes, ctype="application/json"):
    try:
        r = parser(body, ctype)
    except RequestTooLarge:
        return "413"
    except InputError:
        return "400"
    return r


def _same(a, b) -> None:
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    np.testing.assert_array_equal(a.dense, b.dense)
    assert a.dense.dtype == b.dense.dtype == np.float32
    np.testing.assert_array_equal(a.values, b.values)
    np.testing.assert_array_equal(a.offsets, b.offsets)


def _oracle(doc: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a valid request must parse to, from the decoded document (NumPy, plain Python)."""
    dense = np.array([[float(x) for x in row] for row in doc["dense"]], np.float64).astype(np.float32)
    values, lengths = [], []
    for f in FEATURES:
        for bag in doc["sparse"][f]:
            lengths.append(len(bag))
            for x in bag:
                values.append(x if isinstance(x, int) else (missing_id(f) if x == "" else int(x, 16)))
    return dense, np.array(values, np.int64), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


# -- generated requests --------------------------------------------------------------------------------------------

_ids_no_empty = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-5, 5),
                          st.text("0123456789abcdefABCDEF", min_size=1, max_size=8))
_ids = st.one_of(_ids_no_empty, st.just(""))
_dense_value = st.one_of(st.integers(-10**6, 10**6), st.floats(-1e30, 1e30, allow_nan=False),
                         st.sampled_from([0.0, -0.0, 1e-320, 3.4e38, 1e-45]))
_json_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                                                                                        allow_infinity=False),
                                     st.text(max_size=5)),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                          max_size=3),
                           max_leaves=8)


@st.composite
def requests(draw):
    B = draw(st.integers(1, 4))
    dense = [draw(st.lists(_dense_value, min_size=NUM_DENSE, max_size=NUM_DENSE)) for _ in range(B)]
    sparse = {}
    feats = list(FEATURES) + draw(st.lists(st.sampled_from(["C2", "extra", "C1x"]), max_size=2, unique=True))
    for f in draw(st.permutations(feats)):
        if f in FEATURES:
            ids = _ids_no_empty if f == "user" else _ids  # "user" is no Criteo feature: "" is refused
            sparse[f] = [draw(st.lists(ids, max_size=3)) for _ in range(B)]
        else:
            sparse[f] = draw(_json_value)
    doc = {"dense": dense, "sparse": sparse}
    for k in draw(st.lists(st.sampled_from(["x", "meta"]), max_size=2, unique=True)):
        doc[k] = draw(_json_value)
    keys = list(doc)
    doc = {k: doc[k] for k in draw(st.permutations(keys))}
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))
    return doc, text.encode()


@needs_native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_valid_json_requests_parse_to_the_oracle_on_both_paths(req):
    doc, body = req
    want = _oracle(doc)
    for p in _parsers():
        got = p(body, "application/json")
        np.testing.assert_array_equal(got.dense, want[0])
        np.testing.assert_array_equal(got.values, want[1])
        np.testing.assert_array_equal(got.offsets, want[2])


_MUTATIONS = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 1)),
    st.tuples(st.just("byte"), st.floats(0, 1), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.sampled_from([b",", b"]", b"[", b"{", b"}", b'"', b"\\",
                                                                   b"-", b"1e999", b"NaN", b"\xff", b"\x00",
                                                                   b"\xed\xa0\x80", b"\\ud800", b" "])),
    st.tuples(st.just("delete"), st.floats(0, 1)),
)


@needs_native
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.lists(_MUTATIONS, min_size=1, max_size=3))
@pytest.mark.slow
def test_mutated_json_bodies_get_the_same_answer_from_the_kernel_and_its_twin(req, mutations):
    _, body = req
    for m in mutations:
        at = int(m[1] * len(body))
        if m[0] == "cut":
            body = body[:at]
        elif m[0] == "byte":
            body = body[:at] + bytes([m[2]]) + body[at + 1:]
        elif m[0] == "insert":
            body = body[:at] + m[2] + body[at:]
        else:
            body = body[:at] + body[at + 1:]
    native, twin = _parsers()
    got = _outcome(native, body)
    event("refused" if isinstance(got, str) else "parsed")
    _same(got, _outcome(twin, body))


@st.composite
def altered_requests(draw):
    """A generated request with one member or element replaced by another JSON value (valid JSON,
    usually not a valid request: a wrong type, count or id)."""
    doc, _ = draw(requests())
    parent, key = None, None
    node = doc
    while isinstance(node, (dict, list)) and node and (parent is None or draw(st.booleans())):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = parent[key]
    if parent is not None:
        parent[key] = draw(st.one_of(_json_value, _ids, _dense_value, st.just([]), st.just([[]])))
    return json.dumps(doc).encode()


@needs_native
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(altered_requests())
def test_altered_requests_get_the_same_answer_from_the_kernel_and_its_twin(body):
    native, twin = _parsers()
    got = _outcome(native, body)
    event("refused" if isinstance(got, str) else "parsed")
    _same(got, _outcome(twin, body))


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_parsed_or_refused_with_400_never_an_other_error(body):
    for p in _parsers():
        assert _outcome(p, body) in ("400",) or isinstance(_outcome(p, body), ParsedRequest)
    for p in _parsers(features=CAT_NAMES, num_dense=13):
        for ctype in ("text/tab-separated-values", "text/csv"):
            assert _outcome(p, body, ctype) == "400"


# -- the refusals named in the issue -------------------------------------------------------------------------------

def _body(dense=None, sparse=None, raw_dense: str | None = None) -> bytes:
    dense = [[1.0, 2.0]] if dense is None else dense
    sparse = {f: [[1]] for f in FEATURES} if sparse is None else sparse
    d = raw_dense if raw_dense is not None else json.dumps(dense)
    return f'{{"dense": {d}, "sparse": {json.dumps(sparse)}}}'.encode()


@pytest.mark.parametrize("body, reason", [
    (_body(raw_dense="[[1" + "0" * 400 + ", 2]]"), "not a finite float32"),     # an int above 1e308
    (_body(raw_dense="[[1e39, 2]]"), "not a finite float32"),                     # beyond float32
    (_body(raw_dense="[[NaN, 2]]"), ""),
    (_body(raw_dense="[[Infinity, 2]]"), ""),
    (b'{"dense": [[1, 2]], "x": ' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than 32"),
    (b"[" * 200_000, ""),                                                         # nested far past recursion
    (b'{"dense": ' + b"[" * 200_000, ""),
    (b'{"dense": [[1, 2]], "dense": [[1, 2]], "sparse": {}}', "given twice"),
    (_body(sparse={"C1": [[1]], "user": [[""]], "C3": [[1]]}), "no Criteo feature"),
    (_body(sparse={"C1": [[1.5]], "user": [[1]], "C3": [[1]]}), "an integer or a hex string"),
    (_body(sparse={"C1": [[1 << 63]], "user": [[1]], "C3": [[1]]}), "out of the int64 range"),
    (_body(sparse={"C1": [["zz12"]], "user": [[1]], "C3": [[1]]}), "not a hex id of 1-8 digits: 'zz12'"),
    (_body(sparse={"C1": [[1], [2]], "user": [[1]], "C3": [[1]]}), "expected one bag per dense row"),
    (b'{"dense": [[1, 2]], "sparse": {"C1": [[1]], "user": [[1]]}}', "lacks features ['C3']"),
    (b'\xef\xbb\xbf' + _body(), ""),                                              # a BOM: not JSON
    (_body() + b" x", ""),
    (b"", ""),
])
def test_malformed_bodies_are_refused_with_an_input_error_on_both_paths(body, reason):
    for p in _parsers() if _native.available() else _parsers()[1:]:
        with pytest.raises(InputError, match=None) as e:
            p(body, "application/json")
        assert not isinstance(e.value, RequestTooLarge)
        assert reason in str(e.value) and "\n" not in str(e.value)


def test_rows_beyond_the_limit_are_refused_as_too_large_on_both_paths():
    over = _body(dense=[[1.0, 2.0]] * 5, sparse={f: [[1]] * 5 for f in FEATURES})
    for p in _parsers(max_rows=4) if _native.available() else _parsers(max_rows=4)[1:]:
        with pytest.raises(RequestTooLarge, match="more than 4 rows"):
            p(over, "application/json")
        assert p(_body(dense=[[1.0, 2.0]] * 4, sparse={f: [[1]] * 4 for f in FEATURES}),
                 "application/json").rows == 4


@pytest.mark.parametrize("ctype, ok", [
    ("application/json", True), ("Application/JSON; charset=utf-8", True), ("text/tab-separated-values", True),
    ("text/csv", True), ("text/plain", False), ("", False), (None, False), ("application/x-www-form-urlencoded", False),
    ("multipart/form-data", False), ("text/tsv", False), ("application/json; charset=latin-1", False),
])
def test_only_json_tsv_and_csv_content_types_are_read(ctype, ok):
    if ok:
        assert media_type(ctype) in ("application/json", "text/tab-separated-values", "text/csv")
    else:
        with pytest.raises(UnsupportedContentType):
            media_type(ctype)


# -- Criteo lines --------------------------------------------------------------------------------------------------

def _criteo(n: int, label: bool, sep: str = "\t") -> tuple[bytes, ParsedRequest]:
    gen = SyntheticCriteo(SyntheticConfig(max_cardinality=1000))
    text = format_criteo_lines(gen.raw_rows(77, n))
    if not label:
        text = b"".join(ln.split(b"\t", 1)[1] + b"\n" for ln in text.splitlines())
    blk = gen.rows(77, n)
    want = ParsedRequest(blk.dense.astype(np.float32), np.ascontiguousarray(blk.cats.T).reshape(-1),
                         np.arange(26 * n + 1, dtype=np.int64))
    return text.replace(b"\t", sep.encode()), want


@pytest.mark.parametrize("sep, ctype", [("\t", "text/tab-separated-values"), (",", "text/csv")])
@pytest.mark.parametrize("label", [True, False])
def test_criteo_lines_parse_to_the_generators_rows_on_both_paths(sep, ctype, label):
    body, want = _criteo(7, label, sep)
    for p in _parsers(features=CAT_NAMES, num_dense=13) if _native.available() else _parsers(CAT_NAMES, 13)[1:]:
        for b in (body, body.replace(b"\n", b"\r\n"), body + b"\n\n"):
            _same(p(b, ctype), want)


_line_bytes = st.lists(st.sampled_from([b"\t", b",", b"\n", b"\r", b"1", b"a", b"", b"-", b"\t" * 38, b"," * 38,
                                        b"\t" * 39, b"," * 39]), max_size=12).map(b"".join)


@needs_native
@settings(max_examples=500, deadline=None)
@given(_line_bytes, st.sampled_from(["\t", ","]), st.integers(1, 3))
def test_line_checks_agree_between_the_kernel_and_its_twin(body, sep, max_rows):
    def run(native):
        try:
            return criteo_lines(body, sep, max_rows, native=native).tobytes()
        except InputError as e:
            return (type(e).__name__, str(e))

    assert run(True) == run(False)


def test_lines_beyond_the_row_limit_are_too_large():
    body, _ = _criteo(5, True)
    for native in (True, False) if _native.available() else (False,):
        with pytest.raises(RequestTooLarge):
            criteo_lines(body, "\t", 4, native=native)


def test_concatenated_requests_keep_each_features_bags_together():
    p = _parsers()[-1]
    a = p(_body(dense=[[1.0, 2.0]] * 2, sparse={"C1": [[1, 2], []], "user": [[3], [4]], "C3": [[5], [6, 7]]}),
          "application/json")
    b = p(_body(dense=[[3.0, 4.0]], sparse={"C1": [[8]], "user": [[]], "C3": [[9, 10]]}), "application/json")
    joined = concat_requests([a, b], len(FEATURES))
    np.testing.assert_array_equal(joined.dense, [[1, 2], [1, 2], [3, 4]])
    bags = [joined.values[joined.offsets[i]: joined.offsets[i + 1]].tolist() for i in range(9)]
    assert bags == [[1, 2], [], [8], [3], [4], [], [5], [6, 7], [9, 10]]
