"""SchemaBodyParser, the server's parse step under a data schema: rows by column name and the schema's
own lines read as the training files are (the oracle: hugeembed.data's reader on the same rows as a
file), in the model's feature order; bounded like every request (415, 413, 400)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hugeembed.data import Batch, load_schema, read_table
from hugeembed.errors import InputError
from hugeembed.serving._requests import RequestTooLarge, UnsupportedContentType
from hugeembed.serving._schema_requests import SchemaBodyParser
from tests.unit.data.schema_oracle import SCHEMA, write_rows

pytest.importorskip("pyarrow")
FEATURES = ("city", "history", "genres", "movie_id", "user_id")  # not the schema's order: the model's


@pytest.fixture()
def setup(tmp_path):
    (tmp_path / "s.toml").write_text(SCHEMA)
    schema = load_schema(tmp_path / "s.toml")
    path = write_rows(tmp_path / "rows.csv", 12, seed=3)
    want = Batch.from_block(read_table(path, schema), schema)
    return schema, path, want


def _same(parsed, want):
    np.testing.assert_array_equal(parsed.dense, want.dense.numpy())
    sparse = want.sparse.select(list(FEATURES))
    np.testing.assert_array_equal(parsed.values, sparse.values().numpy())
    np.testing.assert_array_equal(parsed.offsets, sparse.offsets().numpy())


def test_csv_lines_and_rows_by_column_read_as_the_file(setup):
    schema, path, want = setup
    parse = SchemaBodyParser(schema, FEATURES, 2, max_rows=100, native=False)
    _same(parse(path.read_bytes(), "text/csv; charset=utf-8").check(len(FEATURES), 2), want)
    import csv

    with open(path, newline="") as f:
        rows = [{k: v for k, v in r.items() if k != "unused"} for r in csv.DictReader(f)]
    _same(parse(json.dumps({"rows": rows}).encode(), "application/json"), want)


def test_bounded_like_every_request(setup):
    schema, path, _ = setup
    parse = SchemaBodyParser(schema, FEATURES, 2, max_rows=5, native=False)
    with pytest.raises(RequestTooLarge, match="12 rows, more than 5"):
        parse(path.read_bytes(), "text/csv")
    with pytest.raises(RequestTooLarge, match="6 rows, more than 5"):
        parse(json.dumps({"rows": [{"user_id": "a"}] * 6}).encode(), "application/json")
    for ct in ("text/plain", "", "application/x-www-form-urlencoded"):
        with pytest.raises(UnsupportedContentType):
            parse(path.read_bytes(), ct)
    deep = b'{"rows": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(InputError, match="malformed JSON"):
        parse(deep, "application/json")
    with pytest.raises(InputError, match="row 1: missing column"):
        parse(b'{"rows": [{"user_id": "a"}]}', "application/json")
    # model inputs go to the native body parser, whatever the schema
    with pytest.raises(InputError):
        parse(b'{"dense": [[1.0]], "sparse": {}}', "application/json")


def test_a_model_without_schema_takes_model_inputs_only(setup):
    parse = SchemaBodyParser(None, FEATURES, 2, max_rows=5, native=False)
    with pytest.raises(InputError, match="no data schema"):
        parse(b'{"rows": [{"user_id": "a"}]}', "application/json")
