"""Criteo lines (TSV or CSV request bodies) -> ParsedRequest.

The lines are checked (one field count for all: 40 with the label, 39 without; at most max_rows)
and rewritten into the Criteo reader's own form (tab-separated, labelled) by csrc/request_lines.cpp's
he_request_lines, or by its Python twin here; the reader's parser (``data.parse_buffer``) then
parses them.  Both run in the kernels with the interpreter lock released.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .. import _native
from ..data import CAT_NAMES, N_DENSE, parse_buffer
from ..errors import InputError
from ._requests import ParsedRequest, RequestTooLarge

__all__ = ["LinesBody", "criteo_lines"]

# he_request_lines' refusals (csrc/request_lines.cpp, detail[0])
EMPTY, FIRST, FIELDS, TOO_MANY, TAB = range(1, 6)
_WHAT = {"\t": ("TSV", "tab-separated"), ",": ("CSV", "comma-separated")}


class LinesBody:
    """Parses TSV / CSV bodies of Criteo lines for one model (a model of Criteo's features only)."""

    def __init__(self, features: Sequence[str], num_dense: int, *, max_rows: int, native: bool | None = None) -> None:
        self.criteo = tuple(features) == CAT_NAMES and num_dense == N_DENSE
        self.max_rows = max_rows
        self.native = _native.available() if native is None else native

    def __call__(self, body: bytes, sep: str) -> ParsedRequest:
        fmt = _WHAT[sep][0]
        if not self.criteo:
            raise InputError(f"{fmt} bodies are Criteo lines; this model reads other features: send JSON")
        lines = criteo_lines(body, sep, self.max_rows, native=self.native)
        block = parse_buffer(lines, source="request line", native=self.native).block  # InputError naming line and field
        B = len(block)
        values = np.ascontiguousarray(block.cats.T).reshape(-1)  # feature-major, one id per bag
        return ParsedRequest(np.ascontiguousarray(block.dense, dtype=np.float32), values.astype(np.int64, copy=False),
                             np.arange(len(CAT_NAMES) * B + 1, dtype=np.int64))


def criteo_lines(body: bytes, sep: str, max_rows: int, *, native: bool) -> np.ndarray:
    """The body's lines as the Criteo reader reads them (uint8), or InputError / RequestTooLarge."""
    fmt, kind = _WHAT[sep]
    if native:
        buf = np.frombuffer(body, np.uint8)
        out = np.empty(len(body) + len(body) // 19 + 8, np.uint8)  # "0\t" more per line of >= 38 separators
        try:
            n = _native.call("he_request_lines", [buf, out], [ord(sep), max_rows])
        except _native.KernelError as e:
            if e.status != _native.Status.BAD_VALUE:
                raise
            raise _refusal(fmt, kind, max_rows, *e.detail[:4]) from None
        return out[:n]
    text = body.rstrip(b"\r\n")
    if not text:
        raise _refusal(fmt, kind, max_rows, EMPTY, 0, 0, 0)
    lines = text.split(b"\n")
    first = 0
    for i, ln in enumerate(lines):  # in the kernel's order: the first refusal is the same
        if i == max_rows:
            raise _refusal(fmt, kind, max_rows, TOO_MANY, i + 1, max_rows, 0)
        fields = ln.count(sep.encode()) + 1
        if sep == "," and b"\t" in ln:
            raise _refusal(fmt, kind, max_rows, TAB, i, 0, 0)
        if i == 0:
            if fields not in (39, 40):
                raise _refusal(fmt, kind, max_rows, FIRST, 0, fields, 0)
            first = fields
        elif fields != first:
            raise _refusal(fmt, kind, max_rows, FIELDS, i, fields, first)
    prefix = b"0\t" if first == 39 else b""
    joined = b"\n".join(prefix + ln.replace(sep.encode(), b"\t") for ln in lines)
    return np.frombuffer(joined, np.uint8).copy()


def _refusal(fmt: str, kind: str, max_rows: int, code: int, a: int, b: int, c: int) -> InputError:
    if code == EMPTY:
        return InputError(f"empty {fmt} body: send one Criteo line per row")
    if code == FIRST:
        return InputError(f"{fmt} line 1: expected 40 {kind} fields (label, I1..I13, C1..C26) or 39 (no label), "
                          f"got {b}")
    if code == FIELDS:
        return InputError(f"{fmt} line {a + 1}: expected {c} {kind} fields like line 1, got {b}")
    if code == TOO_MANY:
        return RequestTooLarge(f"more than {max_rows} rows in one request (--max-request-rows)")
    if code == TAB:
        return InputError(f"{fmt} line {a + 1}: a tab in a comma-separated line")
    return InputError(f"{fmt} body refused by the parser (code {code})")
