"""Plain-Python oracle of the Criteo line format, written from the spec (not from the parser)."""

from __future__ import annotations

import math

import numpy as np

from hugeembed.data import MISSING_IDS

HEX = set("0123456789abcdefABCDEF")


def line(label="1", ints=None, cats=None, sep="\t") -> str:
    """A Criteo line; ints/cats default to simple valid values."""
    ints = [str(i) for i in range(13)] if ints is None else ints
    cats = [f"{j:08x}" for j in range(26)] if cats is None else cats
    return sep.join([label, *ints, *cats])


def parse_line(text: str):
    """(label, dense[13], cats[26]) or raises ValueError(field index) for a malformed line."""
    if text.endswith("\r"):
        text = text[:-1]
    fields = text.split("\t")
    if len(fields) != 40:
        raise ValueError(-1)
    if fields[0] not in ("0", "1"):
        raise ValueError(0)
    dense = []
    for i, f in enumerate(fields[1:14]):
        if f == "":
            dense.append(0.0)
            continue
        digits = f[1:] if f.startswith("-") else f
        if not digits or not digits.isascii() or not digits.isdigit() or len(digits) > 18:
            raise ValueError(1 + i)
        v = int(f)
        dense.append(float(np.float32(math.log1p(v))) if v > 0 else 0.0)
    cats = []
    for j, f in enumerate(fields[14:]):
        if f == "":
            cats.append(MISSING_IDS[j])
            continue
        if len(f) > 8 or not set(f) <= HEX:
            raise ValueError(14 + j)
        cats.append(int(f, 16))
    return float(fields[0]), dense, cats


def parse_text(text: str, skip: bool = False):
    """Oracle for a whole text: lists of labels, dense rows, cat rows; skipped count."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    labels, dense, cats, skipped = [], [], [], 0
    for no, ln in enumerate(lines, 1):
        try:
            y, d, c = parse_line(ln)
        except ValueError as e:
            if not skip:
                raise ValueError((no, e.args[0])) from None
            skipped += 1
            continue
        labels.append(y)
        dense.append(d)
        cats.append(c)
    return labels, dense, cats, skipped
