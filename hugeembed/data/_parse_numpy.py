"""Vectorised NumPy twin of the native Criteo parser (csrc/criteo.cpp).

Same inputs, outputs and error codes as ``he_criteo_parse``; used where the native
kernels are not built (or disabled with HUGEEMBED_DISABLE_NATIVE=1) and as the
parity oracle's sibling in the tests.  No Python loop runs per line: lines and
fields are located with ``flatnonzero`` over the byte buffer and the digits of all
fields of one column are accumulated together, one digit position at a time.
"""

from __future__ import annotations

import numpy as np

from ._schema import N_CAT, N_DENSE, N_FIELDS

__all__ = ["count_lines_numpy", "parse_numpy", "OK", "FIELD_COUNT", "BAD_LABEL", "BAD_INT", "BAD_HEX"]

OK, FIELD_COUNT, BAD_LABEL, BAD_INT, BAD_HEX = 0, 1, 2, 3, 4

_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10, dtype=np.uint8)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16, dtype=np.uint8)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint8)
_MAX_INT_DIGITS = 18
_MAX_HEX_DIGITS = 8


def count_lines_numpy(buf: np.ndarray) -> int:
    """Number of lines in `buf` (a last line without '\\n' counts)."""
    n = int(np.count_nonzero(buf == 10))
    return n + int(buf.size > 0 and buf[-1] != 10)


def _line_bounds(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nl = np.flatnonzero(buf == 10)
    starts = np.concatenate(([0], nl + 1))
    ends = np.concatenate((nl, [buf.size]))
    if buf.size == 0 or buf[-1] == 10:  # no last line after the final newline
        starts, ends = starts[:-1], ends[:-1]
    return starts.astype(np.int64), ends.astype(np.int64)


def _digits(buf: np.ndarray, start: np.ndarray, length: np.ndarray, table: np.ndarray | None, base: int, max_len: int):
    """Accumulates the digits of many fields at once; returns (value, bad) arrays."""
    value = np.zeros(start.shape, np.int64)
    bad = length > max_len
    width = int(min(length.max(initial=0), max_len))
    last = buf.size - 1
    for k in range(width):
        live = k < length
        c = buf[np.minimum(start + k, last)]
        d = (c.astype(np.int16) - 48) if table is None else table[c].astype(np.int16)
        bad_digit = (d < 0) | (d > base - 1)
        bad |= live & bad_digit
        value = np.where(live & ~bad_digit, value * base + d, value)
    return value, bad


def parse_numpy(buf: np.ndarray, first_line: int, stride: int, phase: int, skip_bad: bool, cap: int,
                missing_ids: np.ndarray, bad_cap: int):
    """Parses `buf` (uint8) like ``he_criteo_parse``.

    Returns ``(status, labels [rows], dense [rows, 13], cats [rows, 26], info [8], bad [k, 3])``
    with the kernel's meaning of status and info.
    """
    info = np.zeros(8, np.int64)
    info[3] = -1
    starts, ends = _line_bounds(buf)
    n_lines = starts.size
    line_idx = np.arange(n_lines, dtype=np.int64)
    sel = ((first_line + line_idx) % stride) == phase
    lines, s, e = line_idx[sel], starts[sel], ends[sel]
    e = e - ((e > s) & (buf[np.maximum(e - 1, 0)] == 13))  # CRLF: drop the '\r'
    m = lines.size

    # field count (tabs inside each selected line)
    tabs = np.flatnonzero(buf == 9).astype(np.int64)
    first_tab = np.searchsorted(tabs, s)
    n_tabs = np.searchsorted(tabs, e) - first_tab
    code = np.where(n_tabs != N_FIELDS - 1, FIELD_COUNT, OK).astype(np.int64)
    field = np.full(m, -1, np.int64)

    good = code == OK
    g = np.flatnonzero(good)
    # field bounds of the lines with the right count: [g, 40]
    t = tabs[first_tab[g][:, None] + np.arange(N_FIELDS - 1)] if g.size else np.zeros((0, N_FIELDS - 1), np.int64)
    fstart = np.concatenate((s[g][:, None], t + 1), axis=1)
    fend = np.concatenate((t, e[g][:, None]), axis=1)
    flen = fend - fstart

    fail = np.zeros((g.size, N_FIELDS), bool)  # which fields of each line are malformed
    label_char = buf[np.minimum(fstart[:, 0], buf.size - 1)] if g.size else np.zeros(0, np.uint8)
    fail[:, 0] = (flen[:, 0] != 1) | ((label_char != 48) & (label_char != 49))

    istart, ilen = fstart[:, 1 : 1 + N_DENSE], flen[:, 1 : 1 + N_DENSE]
    neg = (ilen > 0) & (buf[np.minimum(istart, buf.size - 1)] == 45) if g.size else np.zeros((0, N_DENSE), bool)
    ivalue, ibad = _digits(buf, istart + neg, ilen - neg, None, 10, _MAX_INT_DIGITS)
    fail[:, 1 : 1 + N_DENSE] = ibad | (neg & (ilen == 1))
    ivalue = np.where(neg, -ivalue, ivalue)

    cstart, clen = fstart[:, 1 + N_DENSE :], flen[:, 1 + N_DENSE :]
    cvalue, cbad = _digits(buf, cstart, clen, _HEX, 16, _MAX_HEX_DIGITS)
    fail[:, 1 + N_DENSE :] = cbad
    cvalue = np.where(clen == 0, missing_ids[None, :], cvalue)

    any_fail = fail.any(axis=1)
    first_fail = np.argmax(fail, axis=1)
    field_codes = np.array([BAD_LABEL] + [BAD_INT] * N_DENSE + [BAD_HEX] * N_CAT, np.int64)
    code[g[any_fail]] = field_codes[first_fail[any_fail]]
    field[g[any_fail]] = first_fail[any_fail]

    ok_in_g = ~any_fail
    rows_all = np.flatnonzero(code == OK)  # positions among the selected lines
    bad_pos = np.flatnonzero(code != OK)
    status = 0
    keep_g = ok_in_g
    if bad_pos.size and not skip_bad:
        stop = bad_pos[0]  # rows before the first malformed line are kept, as the kernel does
        status = 1
        keep_g = ok_in_g & (g < stop)
        info[3] = lines[stop]
        info[4] = s[stop]
        info[5] = field[stop]
        info[6] = code[stop]
        info[7] = n_tabs[stop] + 1 if code[stop] == FIELD_COUNT else 0
        info[1] = lines[stop]
        rows_all = rows_all[rows_all < stop]
    else:
        info[1] = n_lines
        info[2] = bad_pos.size
    if rows_all.size > cap:
        status = 2
    rows = min(rows_all.size, cap)
    info[0] = rows

    dense_all = np.where(ivalue[keep_g] > 0, np.log1p(np.maximum(ivalue[keep_g], 0).astype(np.float64)), 0.0)
    labels = (label_char[keep_g].astype(np.float32) - 48)[:rows]
    dense = dense_all.astype(np.float32)[:rows]
    cats = cvalue[keep_g][:rows]
    bad = np.stack((lines[bad_pos], code[bad_pos], field[bad_pos]), axis=1)[:bad_cap] if skip_bad else np.zeros((0, 3), np.int64)
    return status, labels, np.ascontiguousarray(dense), np.ascontiguousarray(cats), info, bad
