"""Request bodies -> (dense, SparseFeatures): JSON or Criteo TSV lines.  Every error is an InputError
of one line naming the feature, row and value, so the server answers 400 with it.

JSON::

    {"dense": [[0.1, 2.0, ... 13 floats], ...],          the model's dense input (as Batch.dense)
     "sparse": {"C1": [[id, ...], ...], ..., "C26": [...]}}   a bag of ids per row and feature

An id is an int64, or a raw Criteo field: a string of 1-8 hex digits, read as the Criteo
reader reads it (its hex value; "" is the feature's missing id).  A bag may be empty
(pools to zeros) or hold several ids.

TSV (``text/tab-separated-values``): Criteo lines, the label column present (40 fields) or
absent (39), parsed by the Criteo reader's own parser (dense ``log(1 + max(x, 0))``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import numpy as np
import torch

from ..data import CAT_NAMES, N_DENSE, missing_id, parse_buffer, sparse_from_ids
from ..errors import InputError
from ..features import SparseFeatures

__all__ = ["parse_json", "parse_tsv", "parse_body", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 64 << 20
_HEX = re.compile(r"[0-9a-fA-F]{1,8}")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_body(body: bytes, content_type: str, features: Sequence[str], num_dense: int
               ) -> tuple[torch.Tensor, SparseFeatures]:
    """(dense [B, num_dense] float32, sparse) of a request body, by its content type."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in ("text/tab-separated-values", "text/plain", "text/tsv"):
        return parse_tsv(body, features, num_dense)
    if kind in ("application/json", ""):
        return parse_json(body, features, num_dense)
    raise InputError(f"content type {kind!r}: send application/json or text/tab-separated-values")


def parse_json(body: bytes, features: Sequence[str], num_dense: int) -> tuple[torch.Tensor, SparseFeatures]:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"malformed JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(doc, dict) or "dense" not in doc or "sparse" not in doc:
        raise InputError('the body must be a JSON object with "dense" and "sparse"')
    dense = _dense(doc["dense"], num_dense)
    B = dense.shape[0]
    sparse = doc["sparse"]
    if not isinstance(sparse, dict):
        raise InputError('"sparse" must be an object of feature name -> list of id lists')
    missing = [f for f in features if f not in sparse]
    if missing:
        raise InputError(f'"sparse" lacks features {missing[:5]}{" ..." if len(missing) > 5 else ""}')
    values, lengths = [], []
    for f in features:
        v, n = _feature_ids(f, sparse[f], B)
        values.append(v)
        lengths.append(n)
    vals = torch.from_numpy(np.concatenate(values)) if values else torch.zeros(0, dtype=torch.int64)
    lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return dense, SparseFeatures(list(features), vals, offsets=torch.from_numpy(offsets), batch_size=B)


def _dense(rows: Any, num_dense: int) -> torch.Tensor:
    if not isinstance(rows, list) or not rows:
        raise InputError('"dense" must be a non-empty list of rows')
    for i, r in enumerate(rows):
        if not isinstance(r, list) or len(r) != num_dense:
            got = f"{len(r)} values" if isinstance(r, list) else _short(r)
            raise InputError(f'"dense" row {i}: expected {num_dense} numbers, got {got}')
        for j, x in enumerate(r):
            if type(x) not in (int, float):
                raise InputError(f'"dense" row {i}, column {j}: not a number: {_short(x)}')
    arr = np.asarray(rows, dtype=np.float32)
    if not np.isfinite(arr).all():
        i, j = np.argwhere(~np.isfinite(arr))[0]
        raise InputError(f'"dense" row {i}, column {j}: not a finite float32: {rows[i][j]!r}')
    return torch.from_numpy(arr)


def _feature_ids(feature: str, bags: Any, B: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, bag lengths) of one feature's B bags."""
    if not isinstance(bags, list) or len(bags) != B:
        got = f"{len(bags)} bags" if isinstance(bags, list) else _short(bags)
        raise InputError(f'feature {feature!r}: expected {B} bags (one per dense row), got {got}')
    lengths = np.empty(B, np.int64)
    flat: list[Any] = []
    for b, bag in enumerate(bags):
        if not isinstance(bag, list):
            raise InputError(f"feature {feature!r}, row {b}: a bag must be a list of ids, got {_short(bag)}")
        lengths[b] = len(bag)
        flat.extend(bag)
    if all(type(x) is int for x in flat):  # the common case, converted in one call
        try:
            return np.array(flat, dtype=np.int64), lengths
        except OverflowError:
            pass  # named below
    out = np.empty(len(flat), np.int64)
    row = np.repeat(np.arange(B), lengths)
    for i, x in enumerate(flat):
        out[i] = _one_id(feature, int(row[i]), x)
    return out, lengths


def _one_id(feature: str, row: int, x: Any) -> int:
    if type(x) is int:
        if not _INT64[0] <= x <= _INT64[1]:
            raise InputError(f"feature {feature!r}, row {row}: id {x} is out of the int64 range")
        return x
    if isinstance(x, str):
        if x == "":
            if feature not in CAT_NAMES:
                raise InputError(f"feature {feature!r}, row {row}: an empty id names Criteo's missing value, and "
                                 f"{feature!r} is no Criteo feature")
            return missing_id(CAT_NAMES.index(feature))
        if _HEX.fullmatch(x) is None:
            raise InputError(f"feature {feature!r}, row {row}: not a hex id of 1-8 digits: {_short(x)}")
        return int(x, 16)
    raise InputError(f"feature {feature!r}, row {row}: an id is an integer or a hex string, got {_short(x)}")


def parse_tsv(body: bytes, features: Sequence[str], num_dense: int) -> tuple[torch.Tensor, SparseFeatures]:
    if tuple(features) != CAT_NAMES or num_dense != N_DENSE:
        raise InputError("TSV bodies are Criteo lines; this model reads other features: send JSON")
    lines = body.rstrip(b"\n").split(b"\n")
    if not body.strip():
        raise InputError("empty TSV body: send one Criteo line per row")
    fields = lines[0].count(b"\t") + 1
    if fields == 39:  # no label column: give every line a dummy one, so the reader's parser takes them
        counts = [ln.count(b"\t") + 1 for ln in lines]
        bad = next((i for i, n in enumerate(counts) if n != 39), None)
        if bad is not None:
            raise InputError(f"TSV line {bad + 1}: expected 39 tab-separated fields like line 1 (I1..I13, C1..C26), "
                             f"got {counts[bad]}")
        body = b"\n".join(b"0\t" + ln for ln in lines)
    elif fields != 40:
        raise InputError(f"TSV line 1: expected 40 tab-separated fields (label, I1..I13, C1..C26) or 39 (no label), "
                         f"got {fields}")
    buf = np.frombuffer(body, dtype=np.uint8).copy()
    block = parse_buffer(buf, source="request line")  # InputError: "request line:3: field C7 (column 21): ..."
    if len(block.block) != len(lines):
        raise InputError(f"TSV body: {len(lines)} lines but {len(block.block)} rows parsed (an empty line?)")
    blk = block.block
    dense = torch.from_numpy(np.ascontiguousarray(blk.dense, dtype=np.float32))
    return dense, sparse_from_ids(torch.from_numpy(np.ascontiguousarray(blk.cats)))
