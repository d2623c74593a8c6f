"""JSON request bodies -> ParsedRequest: csrc/request_json.cpp's he_request_json, and its Python twin.

The kernel parses strict JSON (RFC 8259, UTF-8) while the interpreter lock is released; the twin
(``json.loads`` with duplicate, constant and depth checks) reads what the kernel reads and refuses
what it refuses (tests/unit/serving/test_requests.py holds them equal on generated bodies).
See _requests.py for the format; errors name the feature, row and value.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import numpy as np

from .. import _native
from ..data import CAT_NAMES, missing_id
from ..errors import InputError
from ._requests import ParsedRequest, RequestTooLarge

__all__ = ["JsonBody"]

_HEX = re.compile(r"[0-9a-fA-F]{1,8}")
_INT64 = (-(1 << 63), (1 << 63) - 1)
_NO_MISSING = -1  # missing[f] < 0: "" is refused for feature f (no Criteo feature)

# he_request_json's refusals (csrc/json_reader.h, detail[0])
(SYNTAX, DEPTH, NOT_OBJECT, MISSING, DUPLICATE, DENSE_NOT_LIST, DENSE_ROW, DENSE_VALUE, DENSE_FINITE,
 SPARSE_NOT_OBJECT, MISSING_FEATURE, BAGS, BAG_NOT_LIST, ID_TYPE, ID_RANGE, ID_HEX, ID_EMPTY, TOO_MANY_ROWS,
 TOO_MANY_IDS) = range(1, 20)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _token(body: bytes, pos: int) -> str:
    """The JSON value at byte `pos` of the body, shortened, for a message."""
    text = body[pos: pos + 400].decode("utf-8", "replace")
    try:
        value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except (ValueError, RecursionError):
        return _short(text[:40])
    return _short(_plain(value))


def _plain(x: Any) -> Any:
    return x.pairs if isinstance(x, _Object) else x


class JsonBody:
    """Parses JSON request bodies for one model (the kernel where built, else the twin)."""

    def __init__(self, features: Sequence[str], num_dense: int, *, max_rows: int, max_depth: int,
                 native: bool | None = None) -> None:
        self.features, self.num_dense, self.max_rows, self.max_depth = tuple(features), num_dense, max_rows, max_depth
        self.missing = [missing_id(f) if f in CAT_NAMES else _NO_MISSING for f in self.features]
        self.native = _native.available() if native is None else native
        names = [f.encode() for f in self.features]
        self._names = np.frombuffer(b"".join(names) or b"\0", np.uint8).copy()
        self._name_off = np.zeros(len(names) + 1, np.int64)
        np.cumsum([len(n) for n in names], out=self._name_off[1:])
        self._missing = np.array(self.missing, np.int64)

    def __call__(self, body: bytes) -> ParsedRequest:
        return self._native(body) if self.native else self._python(body)

    # -- the kernel ---------------------------------------------------------------------------------------------------

    def _native(self, body: bytes) -> ParsedRequest:
        F, nd, n = len(self.features), self.num_dense, len(body)
        cap_rows = max(1, min(self.max_rows, n // (2 * nd + 1) + 1))  # a dense row takes >= 2 nd + 1 bytes
        buf = np.frombuffer(body, np.uint8)
        dense = np.empty(cap_rows * nd, np.float32)
        values = np.empty(n // 2 + 1, np.int64)  # an id takes >= 2 bytes (a digit and a ',' or ']')
        lengths = np.empty(cap_rows * F, np.int64)
        spans = np.empty(2 * F, np.int64)
        try:
            B = _native.call("he_request_json", [buf, self._names, self._name_off, self._missing, dense, values,
                                                 lengths, spans], [nd, self.max_rows, cap_rows, self.max_depth])
        except _native.KernelError as e:
            if e.status != _native.Status.BAD_VALUE:
                raise
            raise self._refusal(body, *e.detail[:5]) from None
        lengths = lengths[: B * F].reshape(B, F).T.reshape(-1)  # feature-major
        offsets = np.zeros(F * B + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if F and (spans[0::2][1:] == spans[1::2][:-1]).all() and spans[0] == 0:  # features in the model's order
            ids = values[: spans[-1]]
        else:
            ids = np.concatenate([values[spans[2 * f]: spans[2 * f + 1]] for f in range(F)]) if F else values[:0]
        return ParsedRequest(dense[: B * nd].reshape(B, nd), ids, offsets)

    def _refusal(self, body: bytes, code: int, pos: int, a: int, b: int, c: int) -> InputError:
        """The message of a refusal by the kernel (detail: code, byte offset, values)."""
        name = (lambda f: repr(self.features[f]) if 0 <= f < len(self.features) else str(f))
        if code == SYNTAX:
            line = body.count(b"\n", 0, pos) + 1
            col = pos - (body.rfind(b"\n", 0, pos) + 1) + 1
            return InputError(f"malformed JSON at line {line}, column {col} (byte {pos}): "
                              f"{_short(body[pos: pos + 30].decode('utf-8', 'replace'))}")
        if code == DEPTH:
            return InputError(f"malformed JSON: nested deeper than {self.max_depth} levels (byte {pos})")
        if code in (NOT_OBJECT, MISSING):
            return InputError('the body must be a JSON object with "dense" and "sparse"')
        if code == DUPLICATE:
            what = {-1: '"dense"', -2: '"sparse"'}.get(a) or f'feature {name(a)} in "sparse"'
            return InputError(f"{what} is given twice")
        if code == DENSE_NOT_LIST:
            return InputError('"dense" must be a non-empty list of rows')
        if code == DENSE_ROW:
            got = f"{b} values" if b >= 0 else _token(body, pos)
            return InputError(f'"dense" row {a}: expected {self.num_dense} numbers, got {got}')
        if code == DENSE_VALUE:
            return InputError(f'"dense" row {a}, column {b}: not a number: {_token(body, pos)}')
        if code == DENSE_FINITE:
            return InputError(f'"dense" row {a}, column {b}: not a finite float32: {_token(body, pos)}')
        if code == SPARSE_NOT_OBJECT:
            return InputError('"sparse" must be an object of feature name -> list of id lists')
        if code == MISSING_FEATURE:
            return InputError(f'"sparse" lacks features [{name(a)}]')
        if code == BAGS:
            got = f"{b} bags" if b >= 0 else _token(body, pos)
            return InputError(f"feature {name(a)}: expected one bag per dense row, got {got}")
        if code == BAG_NOT_LIST:
            return InputError(f"feature {name(a)}, row {b}: a bag must be a list of ids, got {_token(body, pos)}")
        if code == ID_TYPE:
            return InputError(f"feature {name(a)}, row {b}: an id is an integer or a hex string, got "
                              f"{_token(body, pos)}")
        if code == ID_RANGE:
            return InputError(f"feature {name(a)}, row {b}: id {_token(body, pos)} is out of the int64 range")
        if code == ID_HEX:
            return InputError(f"feature {name(a)}, row {b}: not a hex id of 1-8 digits: {_token(body, pos)}")
        if code == ID_EMPTY:
            return InputError(f"feature {name(a)}, row {b}: an empty id names Criteo's missing value, and "
                              f"{name(a)} is no Criteo feature")
        if code == TOO_MANY_ROWS:
            return RequestTooLarge(f"more than {self.max_rows} rows in one request (--max-request-rows)")
        return InputError(f"request refused by the parser (code {code} at byte {pos})")

    # -- the twin -----------------------------------------------------------------------------------------------------

    def _python(self, body: bytes) -> ParsedRequest:
        def no_constant(name):  # NaN, Infinity: not JSON
            raise ValueError(f"{name} is not JSON")

        try:
            doc = json.loads(body.decode("utf-8"), object_pairs_hook=_Object, parse_constant=no_constant)
        except RecursionError:
            raise InputError(f"malformed JSON: nested deeper than {self.max_depth} levels") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(f"malformed JSON: {str(e).splitlines()[0]}") from None
        try:
            return self._document(doc)
        except RecursionError:  # _nesting of a deep member
            raise InputError(f"malformed JSON: nested deeper than {self.max_depth} levels") from None

    def _document(self, doc: Any) -> ParsedRequest:
        if not isinstance(doc, _Object):
            raise InputError('the body must be a JSON object with "dense" and "sparse"')
        top = doc.members(("dense", "sparse"), '"{}"', 1, self.max_depth)
        if "dense" not in top or "sparse" not in top:
            raise InputError('the body must be a JSON object with "dense" and "sparse"')
        dense = self._dense(top["dense"])
        B = dense.shape[0]
        if not isinstance(top["sparse"], _Object):
            raise InputError('"sparse" must be an object of feature name -> list of id lists')
        sparse = top["sparse"].members(self.features, 'feature {!r} in "sparse"', 2, self.max_depth)
        missing = [f for f in self.features if f not in sparse]
        if missing:
            raise InputError(f'"sparse" lacks features {missing[:5]}{" ..." if len(missing) > 5 else ""}')
        values, lengths = [], []
        for f, miss in zip(self.features, self.missing):
            v, n = self._feature_ids(f, miss, sparse[f], B)
            values.append(v)
            lengths.append(n)
        lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        offsets = np.zeros(lens.size + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return ParsedRequest(dense, np.concatenate(values) if values else np.zeros(0, np.int64), offsets)

    def _dense(self, rows: Any) -> np.ndarray:
        if not isinstance(rows, list) or not rows:
            raise InputError('"dense" must be a non-empty list of rows')
        if len(rows) > self.max_rows:
            raise RequestTooLarge(f"more than {self.max_rows} rows in one request (--max-request-rows)")
        out = np.empty((len(rows), self.num_dense), np.float64)
        for i, r in enumerate(rows):
            if not isinstance(r, list) or len(r) != self.num_dense:
                got = f"{len(r)} values" if isinstance(r, list) else _short(_plain(r))
                raise InputError(f'"dense" row {i}: expected {self.num_dense} numbers, got {got}')
            for j, x in enumerate(r):
                if type(x) not in (int, float):
                    raise InputError(f'"dense" row {i}, column {j}: not a number: {_short(_plain(x))}')
                try:
                    out[i, j] = float(x)
                except OverflowError:  # an integer beyond a double
                    out[i, j] = np.inf
        with np.errstate(over="ignore"):
            arr = out.astype(np.float32)
        if not np.isfinite(arr).all():
            i, j = np.argwhere(~np.isfinite(arr))[0]
            raise InputError(f'"dense" row {i}, column {j}: not a finite float32: {_short(rows[i][j])}')
        return arr

    def _feature_ids(self, feature: str, missing: int, bags: Any, B: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, bag lengths) of one feature's B bags."""
        if isinstance(bags, list) and len(bags) > self.max_rows:
            raise RequestTooLarge(f"more than {self.max_rows} rows in one request (--max-request-rows)")
        if not isinstance(bags, list) or len(bags) != B:
            got = f"{len(bags)} bags" if isinstance(bags, list) else _short(_plain(bags))
            raise InputError(f"feature {feature!r}: expected one bag per dense row, got {got}")
        lengths = np.empty(B, np.int64)
        flat: list[int] = []
        for b, bag in enumerate(bags):
            if not isinstance(bag, list):
                raise InputError(f"feature {feature!r}, row {b}: a bag must be a list of ids, got {_short(_plain(bag))}")
            lengths[b] = len(bag)
            flat.extend(_one_id(feature, missing, b, x) for x in bag)
        return np.array(flat, dtype=np.int64), lengths


def _one_id(feature: str, missing: int, row: int, x: Any) -> int:
    if type(x) is int:
        if not _INT64[0] <= x <= _INT64[1]:
            raise InputError(f"feature {feature!r}, row {row}: id {x} is out of the int64 range")
        return x
    if isinstance(x, str):
        if x == "":
            if missing < 0:
                raise InputError(f"feature {feature!r}, row {row}: an empty id names Criteo's missing value, and "
                                 f"{feature!r} is no Criteo feature")
            return missing
        if _HEX.fullmatch(x) is None:
            raise InputError(f"feature {feature!r}, row {row}: not a hex id of 1-8 digits: {_short(x)}")
        return int(x, 16)
    raise InputError(f"feature {feature!r}, row {row}: an id is an integer or a hex string, got {_short(_plain(x))}")


class _Object:
    """A JSON object as its members in order (json's object_pairs_hook): duplicates stay visible."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs

    def members(self, wanted: Sequence[str], label: str, depth: int, max_depth: int) -> dict[str, Any]:
        """The wanted members (InputError when one is given twice); the others are checked for
        nesting (this object at `depth`: the kernel's rule, at most max_depth levels) and dropped."""
        out: dict[str, Any] = {}
        for key, value in self.pairs:
            if key in wanted:
                if key in out:
                    raise InputError(f"{label.format(key)} is given twice")
                out[key] = value
            elif depth + _nesting(value) > max_depth:
                raise InputError(f"malformed JSON: nested deeper than {max_depth} levels")
        return out


def _nesting(x: Any) -> int:
    """Levels of arrays and objects in a JSON value (a scalar: 0)."""
    if isinstance(x, list):
        return 1 + max((_nesting(v) for v in x), default=0)
    if isinstance(x, _Object):
        return 1 + max((_nesting(v) for _, v in x.pairs), default=0)
    return 0
