"""Request bodies -> arrays: one step, ``parser(body, content_type) -> ParsedRequest``, run off the
server's event loop.  Every refusal is an InputError of one line naming the feature, row and value
(the server's 400), ``RequestTooLarge`` (413) or ``UnsupportedContentType`` (415).

Content types (exactly these; anything else, or none, is refused, so no web page can send a
request without a CORS preflight)::

    application/json            {"dense": [[13 floats], ...], "sparse": {"C1": [[id, ...], ...], ...}}
    text/tab-separated-values   Criteo lines, the label column present (40 fields) or absent (39)
    text/csv                    the same lines, comma-separated

JSON (_json_body.py): the model's dense input (as ``Batch.dense``) and a bag of ids per row and
feature; an id is an int64 or a raw Criteo field (1-8 hex digits; "" is the feature's missing id).
Lines (_lines_body.py) are parsed by the Criteo reader's parser (dense ``log(1 + max(x, 0))``).
Both parse in the native kernels (csrc/request_json.cpp, csrc/request_lines.cpp), which release the
interpreter lock, with a Python twin where they are not built.

A different parser (another body schema) plugs in as any callable with the same signature
returning a ParsedRequest; the server checks its arrays (:meth:`ParsedRequest.check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import InputError
from ..features import SparseFeatures

__all__ = ["ParsedRequest", "RequestParser", "BodyParser", "RequestTooLarge", "UnsupportedContentType",
           "CONTENT_TYPES", "media_type", "concat_requests", "MAX_BODY_BYTES", "MAX_DEPTH"]

MAX_BODY_BYTES = 8 << 20
MAX_DEPTH = 32  # JSON nesting: arrays and objects inside each other (a request needs 4)
CONTENT_TYPES = ("application/json", "text/tab-separated-values", "text/csv")
_CHARSETS = ("utf-8", "utf8", "us-ascii", "ascii")


class RequestTooLarge(InputError):
    """A request larger than the server takes (its body, or its rows): HTTP 413."""


class UnsupportedContentType(InputError):
    """A body of a content type the server does not read: HTTP 415."""


def media_type(content_type: str | None) -> str:
    """The accepted media type of a Content-Type header value (lower case, parameters dropped), or
    UnsupportedContentType naming it.  A charset parameter, if any, must be UTF-8 (or ASCII)."""
    if not content_type:
        raise UnsupportedContentType(f"no content type: send one of {', '.join(CONTENT_TYPES)}")
    kind, *params = content_type.split(";")
    kind = kind.strip().lower()
    if kind not in CONTENT_TYPES:
        raise UnsupportedContentType(f"content type {kind[:60]!r}: send one of {', '.join(CONTENT_TYPES)}")
    for p in params:
        name, _, value = p.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in _CHARSETS:
            raise UnsupportedContentType(f"charset {value.strip()[:30]!r}: bodies are UTF-8")
    return kind


@dataclass(frozen=True)
class ParsedRequest:
    """One request's rows, as the served program takes them.

    Args:
        dense: float32 ``[B, num_dense]``.
        values: int64 ids, feature-major in the model's feature order (``SparseFeatures`` layout).
        offsets: int64 ``[F * B + 1]``: bag ``f * B + b`` is ``values[offsets[f*B+b] : offsets[f*B+b+1]]``.
    """

    dense: np.ndarray
    values: np.ndarray
    offsets: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.dense.shape[0])

    def check(self, num_features: int, num_dense: int) -> "ParsedRequest":
        """InputError unless the arrays have the layout above (what a plugged-in parser must return)."""
        d, v, o = self.dense, self.values, self.offsets
        if not all(isinstance(a, np.ndarray) for a in (d, v, o)):
            raise InputError("a parsed request holds numpy arrays (dense, values, offsets)")
        if d.dtype != np.float32 or d.ndim != 2 or d.shape[1] != num_dense or d.shape[0] < 1:
            raise InputError(f"parsed dense rows: float32 [B >= 1, {num_dense}], got {d.dtype} {list(d.shape)}")
        if v.dtype != np.int64 or v.ndim != 1 or o.dtype != np.int64 or o.shape != (num_features * d.shape[0] + 1,):
            raise InputError(f"parsed ids: int64 values and int64 [{num_features} x {d.shape[0]} + 1] offsets, got "
                             f"{v.dtype} {list(v.shape)}, {o.dtype} {list(o.shape)}")
        if o[0] != 0 or o[-1] != v.shape[0] or (o.size > 1 and bool((o[1:] < o[:-1]).any())):
            raise InputError("parsed offsets must rise from 0 to the number of ids")
        if not bool(np.isfinite(d).all()):
            raise InputError("parsed dense rows hold a non-finite value")
        return self

    def tensors(self, features: Sequence[str]) -> tuple[torch.Tensor, SparseFeatures]:
        """(dense, SparseFeatures) of the request (sharing its arrays)."""
        return torch.from_numpy(self.dense), SparseFeatures(list(features), torch.from_numpy(self.values),
                                                            offsets=torch.from_numpy(self.offsets),
                                                            batch_size=self.rows)


RequestParser = Callable[[bytes, str], ParsedRequest]


class BodyParser:
    """The server's parse step for one model: ``parser(body, content_type) -> ParsedRequest``.

    Args:
        features: the model's sparse features, in its order.  num_dense: its dense width.
        max_rows: rows one request may hold (more: RequestTooLarge).
        native: use the kernels (True), the Python twin (False), or the kernels where built (None).

    Example::

        parse = BodyParser(model.features, model.num_dense, max_rows=4096)
        req = parse(b'{"dense": [[0.5, ...]], "sparse": {"C1": [["68fd1e64"]], ...}}', "application/json")
    """

    def __init__(self, features: Sequence[str], num_dense: int, *, max_rows: int, native: bool | None = None,
                 max_depth: int = MAX_DEPTH) -> None:
        from . import _json_body, _lines_body

        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.features, self.num_dense, self.max_rows = tuple(features), int(num_dense), int(max_rows)
        self._json = _json_body.JsonBody(self.features, self.num_dense, max_rows=self.max_rows, max_depth=max_depth,
                                         native=native)
        self._lines = _lines_body.LinesBody(self.features, self.num_dense, max_rows=self.max_rows, native=native)

    def __call__(self, body: bytes, content_type: str) -> ParsedRequest:
        kind = media_type(content_type)
        if kind == "application/json":
            return self._json(body)
        return self._lines(body, "\t" if kind == "text/tab-separated-values" else ",")


def concat_requests(requests: Sequence[ParsedRequest], num_features: int) -> ParsedRequest:
    """The requests' rows one after the other, still feature-major: each feature's bags of every
    request in turn.  One gather, no loop over ids or features."""
    if len(requests) == 1:
        return requests[0]
    F = num_features
    rows = np.array([r.rows for r in requests], np.int64)
    dense = np.concatenate([r.dense for r in requests])
    # where each (request, feature) run of ids starts in its request and in the joined values
    bounds = np.stack([r.offsets[np.arange(F + 1) * r.rows] for r in requests])  # [k, F + 1]
    base = np.zeros(len(requests), np.int64)
    np.cumsum([r.values.shape[0] for r in requests[:-1]], out=base[1:])
    start = (bounds[:, :-1] + base[:, None]).T.reshape(-1)  # feature-major: [F, k]
    length = np.diff(bounds, axis=1).T.reshape(-1)
    total = int(length.sum())
    out_start = np.cumsum(length) - length
    gather = np.repeat(start - out_start, length) + np.arange(total)
    values = np.concatenate([r.values for r in requests])[gather]
    lengths = np.concatenate([np.diff(r.offsets).reshape(F, int(n)) for r, n in zip(requests, rows)], axis=1)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths.reshape(-1), out=offsets[1:])
    return ParsedRequest(dense, values, offsets)
