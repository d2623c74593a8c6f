"""A request body -> ParsedRequest under the model's data schema (the server's parse step).

Bodies, by content type (_requests.py refuses any other, or none, with 415)::

    application/json   {"rows": [{"user_id": "196", "genres": "Action|Comedy", "age": 24}, ...]}
                       rows keyed by column name, values as in the data files (a bag as its text, or a
                       list); the label column may be there (it is ignored)
                       {"dense": [[...]], "sparse": {"C1": [[id, ...]], ...}}: model inputs directly
                       (ids as int64; Criteo's as their hex text), parsed by the native kernels
    text/csv           lines in the model's own format: its header line first when the schema has one
    text/tab-separated-values     (a Criteo model: its 39 or 40 fields, no header: the native kernels)

Rows by column name and a schema's own lines go through the same encoder as the training files
(hugeembed.data), so a value is the same id and the same dense input at training and serving time.
Any bad row is an InputError of one line naming row, column and value (the server answers 400
with it); rows count from 1.  More rows than the server takes: RequestTooLarge (413).
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import numpy as np
import torch

from ..data import Batch, Schema, value_text
from ..data._encode import Encoder, Where, require_pyarrow
from ..errors import InputError
from ..features import SparseFeatures
from ._requests import BodyParser, ParsedRequest, RequestTooLarge, media_type

__all__ = ["SchemaBodyParser", "parse_request", "parse_rows", "parse_text"]

_ROWS_FORM = re.compile(rb'\s*\{\s*"rows"\s*:')  # {"rows": ...}: "rows" is its one key


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class SchemaBodyParser:
    """``parser(body, content_type) -> ParsedRequest`` for a model of `features` and `num_dense`
    dense columns under its data `schema` (None: a model without one takes model inputs only).
    Model inputs and Criteo lines go to the native BodyParser; rows by column name and a schema's
    own lines to the schema's encoder."""

    def __init__(self, schema: Schema | None, features: Sequence[str], num_dense: int, *, max_rows: int,
                 native: bool | None = None) -> None:
        self.schema, self.features, self.num_dense, self.max_rows = schema, tuple(features), int(num_dense), max_rows
        self.inputs = BodyParser(self.features, self.num_dense, max_rows=max_rows, native=native)
        self._own_lines = schema is not None and not schema.is_criteo()

    def __call__(self, body: bytes, content_type: str) -> ParsedRequest:
        kind = media_type(content_type)
        if kind == "application/json":
            if not _ROWS_FORM.match(body[:256]):
                return self.inputs(body, content_type)
            if self.schema is None:
                raise InputError('this model has no data schema: send {"dense": ..., "sparse": ...}')
            doc = _load_json(body)
            rows = doc.get("rows") if isinstance(doc, dict) else None
            if isinstance(rows, list) and len(rows) > self.max_rows:
                raise RequestTooLarge(f"{len(rows)} rows, more than {self.max_rows} (--max-request-rows)")
            dense, sparse = parse_rows(doc, self.schema)
        elif self._own_lines:
            dense, sparse = parse_text(body, self.schema, "," if kind == "text/csv" else "\t")
        else:
            return self.inputs(body, content_type)
        if dense.shape[0] > self.max_rows:
            raise RequestTooLarge(f"{dense.shape[0]} rows, more than {self.max_rows} (--max-request-rows)")
        return _parsed(dense, _in_order(sparse, self.features))


def _load_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"malformed JSON: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise InputError("malformed JSON: nested too deep") from None


def _in_order(sparse: SparseFeatures, features: Sequence[str]) -> SparseFeatures:
    """`sparse` in the order of `features` (the artifact's, which groups the features of a table)."""
    if tuple(sparse.keys()) == tuple(features):
        return sparse
    missing = [f for f in features if f not in sparse.keys()]
    if missing:
        raise InputError(f"sparse features {missing} are missing (the model reads {list(features)})")
    return sparse.select(list(features))


def _parsed(dense: torch.Tensor, sparse: SparseFeatures) -> ParsedRequest:
    return ParsedRequest(np.ascontiguousarray(dense.numpy(), dtype=np.float32),
                         np.ascontiguousarray(sparse.values().numpy(), dtype=np.int64),
                         np.ascontiguousarray(sparse.offsets().numpy(), dtype=np.int64))


def parse_request(body: bytes, content_type: str, schema: Schema | None, features: Sequence[str], num_dense: int,
                  max_rows: int = 1 << 20) -> tuple[torch.Tensor, SparseFeatures]:
    """(dense, sparse) of a request body for a model reading `features` and `num_dense` dense
    columns under its data `schema`: SchemaBodyParser's arrays as the model's inputs."""
    parsed = SchemaBodyParser(schema, features, num_dense, max_rows=max_rows)(body, content_type)
    return parsed.check(len(features), num_dense).tensors(features)


def _inputs(block, schema: Schema) -> tuple[torch.Tensor, SparseFeatures]:
    batch = Batch.from_block(block, schema)
    return batch.dense, batch.sparse


def parse_rows(doc: dict, schema: Schema) -> tuple[torch.Tensor, SparseFeatures]:
    """``{"rows": [{column: value, ...}, ...]}`` -> model inputs (see the module docstring)."""
    pa = require_pyarrow()
    rows = doc["rows"]
    if not isinstance(rows, list) or not rows:
        raise InputError('"rows" must be a non-empty list of objects (column name -> value)')
    extra = sorted(set(doc) - {"rows"})
    if extra:
        raise InputError(f"unknown keys {extra} beside \"rows\"")
    label = schema.label.column if schema.label else None
    needed = [c for c in schema.needed_columns() if c != label]
    allowed = set(needed) | ({label} if label else set())
    bags = {s.column: s for s in schema.sparse if s.is_bag}
    dense = {d.column for d in schema.dense}
    columns: dict[str, list] = {c: [] for c in needed}
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise InputError(f"request: row {i}: a row is an object of column name -> value, got {_short(row)}")
        missing = [c for c in needed if c not in row]
        if missing:
            raise InputError(f"request: row {i}: missing column {missing[0]!r} (the model reads {needed})")
        unknown = [c for c in row if c not in allowed]
        if unknown:
            raise InputError(f"request: row {i}: unknown column {unknown[0]!r} (the model reads {needed})")
        for c in needed:
            columns[c].append(_cell(row[c], c, i, c in dense, bags.get(c)))
    arrays = {c: pa.array(v, type=pa.list_(pa.string()) if c in bags else pa.string()) for c, v in columns.items()}
    block = Encoder(schema).encode(pa.table(arrays), Where("request"), need_label=False)
    return _inputs(block, schema)


def _cell(value: Any, column: str, row: int, dense: bool, bag) -> Any:
    """A JSON value as the text a file would hold (a bag feature: the list of its items)."""
    if value is None:
        return [] if bag is not None else None
    if isinstance(value, list):
        if bag is None:
            raise InputError(f"request: row {row}: column {column!r}: a list, but the column holds one value: "
                             f"{_short(value)}")
        if not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in value):
            raise InputError(f"request: row {row}: column {column!r}: a bag holds strings or numbers: {_short(value)}")
        return [value_text(x) for x in value]
    if dense:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise InputError(f"request: row {row}: column {column!r}: not a number: {_short(value)}")
        return value if isinstance(value, str) else repr(float(value))
    if not isinstance(value, (str, int, float, bool)):
        raise InputError(f"request: row {row}: column {column!r}: a value is a string or a number: {_short(value)}")
    text = value_text(value)
    if bag is not None:
        return [] if text == "" else text.split(bag.separator)
    return text


def parse_text(body: bytes, schema: Schema, delimiter: str | None) -> tuple[torch.Tensor, SparseFeatures]:
    """CSV / TSV lines in the model's format (its header line first when the schema has one)."""
    pa = require_pyarrow()
    from pyarrow import csv

    if not body.strip():
        raise InputError("empty body: send the header line and one line per row")
    delimiter = schema.delimiter or delimiter or ("," if schema.format == "csv" else "\t")
    label = schema.label.column if schema.label else None
    needed = [c for c in schema.needed_columns() if c != label]
    if schema.header:
        import csv as pycsv

        first = body.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r")
        names = next(pycsv.reader([first], delimiter=delimiter))
        lacking = [c for c in needed if c not in names]
        if lacking:
            raise InputError(f"request: the header line lacks column {lacking[0]!r}; it has {names} "
                             f"(the model reads {needed})")
        column_names = None
    else:
        names = list(schema.columns or ())
        column_names = names
    bad: list = []

    def on_invalid(row) -> str:
        bad.append(row)
        return "error"

    try:
        table = csv.read_csv(pa.BufferReader(body), read_options=csv.ReadOptions(column_names=column_names),
                             parse_options=csv.ParseOptions(delimiter=delimiter, invalid_row_handler=on_invalid),
                             convert_options=csv.ConvertOptions(include_columns=needed,
                                                                column_types={c: pa.string() for c in needed}))
    except pa.ArrowInvalid as e:
        if bad:
            r = bad[0]
            lines = [ln.rstrip("\r") for ln in body.decode("utf-8", "replace").split("\n")]
            number = r.number if r.number is not None and r.number > 0 else \
                next((i for i, ln in enumerate(lines, 1) if ln == r.text), "?")
            raise InputError(f"request: line {number}: expected {r.expected_columns} fields, got "
                             f"{r.actual_columns}: {_short(r.text)}") from None
        raise InputError(f"request: {str(e).splitlines()[0]}") from None
    if table.num_rows == 0:
        raise InputError("request: no rows under the header line")
    block = Encoder(schema).encode(table, Where("request", 0, 1 if schema.header else 0), need_label=False)
    return _inputs(block, schema)

