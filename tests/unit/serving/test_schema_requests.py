"""Requests under a data schema: rows keyed by column name (JSON) or CSV/TSV in the model's format, read by
the training files' encoder; 400s naming row, column and value; Criteo's formats unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hugeembed.data import Batch, format_criteo_lines, read_table, SyntheticConfig, SyntheticCriteo
from hugeembed.errors import InputError
from hugeembed.serving import ServingModel, export
from hugeembed.serving._schema_requests import parse_request
from hugeembed.training import TrainConfig, Trainer
from tests.unit.data.schema_oracle import SCHEMA, write_rows

pa = pytest.importorskip("pyarrow")
pytestmark = pytest.mark.slow  # a module fixture trains and exports a model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("schema-serving")
    (d / "s.toml").write_text(SCHEMA)
    write_rows(d / "train.csv", 600, seed=1)
    write_rows(d / "test.csv", 40, seed=2)
    Trainer(TrainConfig(schema=str(d / "s.toml"), data=(str(d / "train.csv"),), steps=6, batch_size=64,
                        embedding_dim=4, eval_rows=64, checkpoint_dir=str(d / "run"), eval_every=0)).fit()
    return ServingModel.load(export(d / "run", d / "art")), d


def _expected(model, path):
    batch = Batch.from_block(read_table(path, model.schema), model.schema)
    return model.predict(batch.dense, batch.sparse)


def _parse(model, body, ct):
    return parse_request(body, ct, model.schema, model.features, model.num_dense)


def test_json_rows_and_csv_bodies_read_as_the_training_files(served):
    model, d = served
    import csv

    with open(d / "test.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r.pop("unused")
        r["movie_id"] = int(r["movie_id"])  # a number, where the file has its text: one id
        r["history"] = [x for x in r["history"].split(" ") if x]  # a bag as a list
        r["age"] = float(r["age"]) if r["age"] else None  # null: the column's fill
    want = _expected(model, d / "test.csv")
    got = model.predict(*_parse(model, json.dumps({"rows": rows}).encode(), "application/json"))
    torch.testing.assert_close(got, want)
    text = (d / "test.csv").read_bytes()
    torch.testing.assert_close(model.predict(*_parse(model, text, "text/csv")), want)
    tsv = "\n".join("\t".join(line.split(",")) for line in text.decode().splitlines() if '"' not in line)
    n = tsv.count("\n")
    assert model.predict(*_parse(model, tsv.encode(), "text/tab-separated-values")).shape == (n,)


@pytest.mark.parametrize("doc,message", [
    ({"rows": [{"user_id": "a", "age": 1, "city": "x", "genres": "A", "history": "1", "score": 0}]},
     "request: row 1: missing column 'movie_id'"),
    ({"rows": [{"user_id": "a", "age": 1, "city": "x", "genres": "A", "history": "1", "movie_id": 1, "score": 0,
                "colour": 1}]}, "request: row 1: unknown column 'colour'"),
    ({"rows": [{"user_id": "a", "age": 1, "city": "x", "genres": "A", "history": "1", "movie_id": 1, "score": 0},
               {"user_id": "a", "age": "old", "city": "x", "genres": "A", "history": "1", "movie_id": 1,
                "score": 0}]}, "request: row 2: column 'age': not a number: 'old'"),
    ({"rows": [{"user_id": ["a"], "age": 1, "city": "x", "genres": "A", "history": "1", "movie_id": 1, "score": 0}]},
     "request: row 1: column 'user_id': a list, but the column holds one value"),
    ({"rows": []}, '"rows" must be a non-empty list'),
])
def test_bad_json_rows_name_row_column_value(served, doc, message):
    model, _ = served
    with pytest.raises(InputError) as e:
        _parse(model, json.dumps(doc).encode(), "application/json")
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("body,message", [
    (b"clicked,user_id,age\n1,a,2\n", "request: the header line lacks column 'score'; it has ['clicked', 'user_id', 'age']"),
    (b"user_id,age,city,genres,history,movie_id,score\na,1,x,A,1,5\n", "request: line 2: expected 7 fields, got 6"),
    (b"user_id,age,city,genres,history,movie_id,score\na,1,x,A,1,5,zz\n",
     "request: row 1 (line 2): column 'score': not a number: 'zz'"),
])
def test_bad_csv_bodies(served, body, message):
    model, _ = served
    with pytest.raises(InputError) as e:
        _parse(model, body, "text/csv")
    assert message in str(e.value)


def test_through_the_http_app(served):
    import warnings

    from hugeembed.serving._server import ServerConfig, make_app

    model, d = served
    with warnings.catch_warnings():  # starlette's test client asks for httpx2 instead of the httpx we have
        warnings.filterwarnings("ignore", message=".*httpx2.*")
        from starlette.testclient import TestClient

        client = TestClient(make_app(model, ServerConfig(watch_s=0)), base_url="http://localhost")
    with client:
        r = client.post("/predict", content=(d / "test.csv").read_bytes(), headers={"content-type": "text/csv"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["predictions"], _expected(model, d / "test.csv").numpy(), rtol=1e-6)
        r = client.post("/predict", json={"rows": [{"user_id": "a"}]})
        assert r.status_code == 400 and "row 1: missing column" in r.text


def test_criteo_models_take_rows_by_column_too(artifacts):
    model = ServingModel.load(artifacts("fp32"))
    gen = SyntheticCriteo(SyntheticConfig(max_cardinality=20000))
    raw = gen.raw_rows(10**6, 8)
    lines = format_criteo_lines(raw)
    names = ["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]
    rows = [dict(zip(names, line.split("\t"))) for line in lines.decode().splitlines()]
    for r in rows:
        for k in names[1:14]:
            r[k] = int(r[k]) if r[k] else None
    by_tsv = model.predict(*_parse(model, lines, "text/tab-separated-values"))
    by_rows = model.predict(*_parse(model, json.dumps({"rows": rows}).encode(), "application/json"))
    torch.testing.assert_close(by_rows, by_tsv, rtol=0, atol=0)
