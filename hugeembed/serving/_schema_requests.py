"""A request body -> model inputs ``(dense [B, num_dense] float32, SparseFeatures)`` under the model's data schema.

Bodies, by content type::

    application/json   {"rows": [{"user_id": "196", "genres": "Action|Comedy", "age": 24}, ...]}
                       rows keyed by column name, values as in the data files (a bag as its text, or a
                       list); the label column may be there (it is ignored)
                       {"dense": [[...]], "sparse": {"C1": [[id, ...]], ...}}: model inputs directly
                       (ids as int64; Criteo's as their hex text), as before schemas existed
    text/csv           lines in the model's own format: its header line first when the schema has one
    text/tab-separated-values     (a Criteo model: its 39 or 40 tab-separated fields, no header)

The rows go through the same encoder as the training files (hugeembed.data), so a value is the
same id and the same dense input at training and serving time.  Any bad row is an InputError of
one line naming row, column and value (the server answers 400 with it); rows count from 1.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from ..data import Batch, Schema, value_text
from ..data._encode import Encoder, Where, require_pyarrow
from ..errors import InputError
from ..features import SparseFeatures
from ._requests import parse_json, parse_tsv

__all__ = ["parse_request", "parse_rows", "parse_text"]

_TEXT_TYPES = {"text/csv": ",", "text/tab-separated-values": "\t", "text/tsv": "\t", "text/plain": "\t"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_request(body: bytes, content_type: str, schema: Schema | None, features: Sequence[str], num_dense: int
                  ) -> tuple[torch.Tensor, SparseFeatures]:
    """(dense, sparse) of a request body for a model reading `features` and `num_dense` dense columns,
    under its data `schema` (None: a model without one takes model inputs as JSON only).  The sparse
    features come in the order of `features` (the artifact's, which groups the features of a table)."""
    dense, sparse = _parse(body, content_type, schema, features, num_dense)
    if tuple(sparse.keys()) != tuple(features):
        missing = [f for f in features if f not in sparse.keys()]
        if missing:
            raise InputError(f"sparse features {missing} are missing (the model reads {list(features)})")
        sparse = sparse.select(list(features))
    return dense, sparse


def _parse(body: bytes, content_type: str, schema: Schema | None, features: Sequence[str], num_dense: int
           ) -> tuple[torch.Tensor, SparseFeatures]:
    kind = content_type.split(";")[0].strip().lower()
    if kind in ("application/json", ""):
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(f"malformed JSON: {str(e).splitlines()[0]}") from None
        if isinstance(doc, dict) and "rows" in doc:
            if schema is None:
                raise InputError('this model has no data schema: send {"dense": ..., "sparse": ...}')
            return parse_rows(doc, schema)
        return parse_json(body, features, num_dense)
    if kind in _TEXT_TYPES:
        if schema is None:
            raise InputError('this model has no data schema: send JSON {"dense": ..., "sparse": ...}')
        if schema.is_criteo():
            if kind == "text/csv":
                raise InputError("a Criteo model takes its lines tab-separated: send text/tab-separated-values")
            return parse_tsv(body, features, num_dense)
        return parse_text(body, schema, _TEXT_TYPES[kind] if kind != "text/plain" else None)
    raise InputError(f"content type {kind!r}: send application/json, text/csv or text/tab-separated-values")


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

