"""Parsing a buffer of Criteo TSV bytes: native kernel or NumPy twin, and error messages.

``parse_buffer`` is the one entry point; the reader (``_criteo.py``) feeds it chunks
of a file that end on a line boundary.  Errors name the file, the 1-based line
number, the field and the offending text; they never shift columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _native
from ..errors import ConfigError, InputError
from ._block import CriteoBlock
from ._parse_numpy import BAD_HEX, BAD_INT, BAD_LABEL, FIELD_COUNT, count_lines_numpy, parse_numpy
from ._schema import MISSING_IDS, N_CAT, N_DENSE, N_FIELDS, field_name

__all__ = ["ParseResult", "parse_buffer", "describe_error", "reason", "check_on_error", "native_parser_available"]

_MISSING = np.array(MISSING_IDS, dtype=np.int64)
_BAD_CAP = 32  # malformed lines remembered per buffer for the summary (all are counted)


def check_on_error(on_error: str) -> bool:
    """True for "skip", False for "raise"; ConfigError otherwise."""
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    return on_error == "skip"


def native_parser_available() -> bool:
    return _native.available()


@dataclass
class ParseResult:
    """What one buffer gave: the rows, the lines stepped over, and the malformed ones.

    ``bad`` holds ``(line index within the buffer, code, field)`` of up to 32
    skipped lines; ``skipped`` counts all of them.
    """

    block: CriteoBlock
    lines: int
    skipped: int
    bad: np.ndarray


def _parse_native(buf: np.ndarray, first_line: int, stride: int, phase: int, skip: bool, source: str,
                  line_number: int):
    """he_criteo_parse (csrc/criteo.cpp): (labels, dense, cats, lines, skipped, bad); raises
    InputError at a malformed line (its detail says where) unless `skip`."""
    n_lines = _native.call("he_criteo_count_lines", [buf])
    cap = n_lines // stride + 1
    labels = np.empty(cap, np.float32)
    dense = np.empty((cap, N_DENSE), np.float32)
    cats = np.empty((cap, N_CAT), np.int64)
    counts = np.zeros(2, np.int64)  # lines seen, lines skipped
    bad = np.zeros((_BAD_CAP, 3), np.int64)
    try:
        rows = _native.call("he_criteo_parse", [buf, _MISSING, labels, dense, cats, counts, bad],
                            [first_line, stride, phase, int(skip), cap, _BAD_CAP])
    except _native.KernelError as e:
        if e.status != _native.Status.BAD_VALUE:  # cannot happen (cap counts every line): a bug is loud, not silent
            raise RuntimeError(f"{source}: Criteo parser failed: {e}") from e
        line, offset, field, code, nfields = e.detail[:5]
        raise InputError(describe_error(buf, source, line_number + line, offset, code, field, nfields)) from None
    lines, skipped = int(counts[0]), int(counts[1])
    return labels[:rows], dense[:rows], cats[:rows], lines, skipped, bad[: min(skipped, _BAD_CAP)]


def parse_buffer(buf: np.ndarray, *, source: str = "<buffer>", first_line: int = 0, line_number: int = 1,
                 stride: int = 1, phase: int = 0, skip: bool = False, native: bool | None = None) -> ParseResult:
    """Parses the Criteo lines in `buf` (uint8 bytes, whole lines; the last may lack '\\n').

    Args:
        buf: contiguous uint8 ``[nbytes]``.
        source: file name used in error messages.
        first_line: global index of the buffer's first line (selects lines with `stride`/`phase`).
        line_number: 1-based line number of the buffer's first line in `source`.
        stride, phase: parse only lines with ``(first_line + i) % stride == phase``.
        skip: skip malformed lines (counted) instead of raising InputError.
        native: force the native kernel (True) or the NumPy twin (False); None = native if built.

    Raises:
        InputError: at the first malformed selected line unless `skip`, e.g.
            ``train.txt:17: field C3 (column 17): not a hex id of 1-8 digits: 'zz12'``.
    """
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise InputError("parse_buffer: buf must be a contiguous 1-D uint8 array")
    if stride < 1 or not 0 <= phase < stride:
        raise ConfigError(f"parse_buffer: need stride >= 1 and 0 <= phase < stride, got {stride}, {phase}")
    if native is None:
        native = _native.available()
    if native:
        labels, dense, cats, lines, skipped, bad = _parse_native(buf, first_line, stride, phase, skip, source,
                                                                 line_number)
        return ParseResult(CriteoBlock(dense, cats, labels), lines, skipped, bad)
    cap = count_lines_numpy(buf) // stride + 1
    status, labels, dense, cats, info, bad = parse_numpy(buf, first_line, stride, phase, skip, cap, _MISSING, _BAD_CAP)
    if status == 2:  # cannot happen: cap counts every line; kept so a bug is loud, not silent
        raise RuntimeError(f"{source}: Criteo parser ran out of output rows")
    if status == 1:
        line = int(info[3])
        raise InputError(describe_error(buf, source, line_number + line, int(info[4]), int(info[6]), int(info[5]), int(info[7])))
    return ParseResult(CriteoBlock(dense, cats, labels), int(info[1]), int(info[2]), bad)


def _line_text(buf: np.ndarray, offset: int) -> bytes:
    rest = buf[offset:]
    nl = np.flatnonzero(rest[: 1 << 20] == 10)
    line = rest[: nl[0]] if nl.size else rest[: 1 << 20]
    text = line.tobytes()
    return text[:-1] if text.endswith(b"\r") else text


def _show(raw: bytes, limit: int = 40) -> str:
    s = raw.decode("utf-8", "backslashreplace")
    return repr(s if len(s) <= limit else s[:limit] + "...")


def describe_error(buf: np.ndarray, source: str, line_number: int, offset: int, code: int, field: int, nfields: int) -> str:
    """One-line message for a malformed line: file, line number, field, offending text."""
    where = f"{source}:{line_number}"
    if code == FIELD_COUNT:
        return (f"{where}: expected {N_FIELDS} tab-separated fields (label, I1..I13, C1..C26), "
                f"got {nfields}")
    parts = _line_text(buf, offset).split(b"\t")
    value = _show(parts[field]) if field < len(parts) else "''"
    name = field_name(field)
    column = f"field {name} (column {field + 1})"
    if code == BAD_LABEL:
        return f"{where}: {column}: label must be 0 or 1, got {value}"
    if code == BAD_INT:
        return f"{where}: {column}: not an integer of at most 18 digits: {value}"
    if code == BAD_HEX:
        return f"{where}: {column}: not a hex id of 1-8 digits: {value}"
    return f"{where}: malformed line (code {code})"


def reason(code: int, field: int) -> str:
    """Short reason for a skipped line, for summaries."""
    if code == FIELD_COUNT:
        return "wrong field count"
    if code == BAD_LABEL:
        return "bad label"
    return {BAD_INT: "bad integer", BAD_HEX: "bad hex id"}.get(code, "malformed") + f" in {field_name(field)}"
