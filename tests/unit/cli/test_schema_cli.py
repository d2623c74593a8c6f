"""Schema data through the real commands: schema -> convert / train -> eval -> inspect -> export, and every
bad-data case as one line on stderr with exit status 2, nothing written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hugeembed.cli import main
from hugeembed.data import ShardSet, load_schema, read_table

from tests.unit.data.schema_oracle import SCHEMA, write_rows

pa = pytest.importorskip("pyarrow")
HEADER = "clicked,user_id,age,city,genres,history,movie_id,score"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "s.toml").write_text(SCHEMA)
    write_rows(tmp_path / "train.csv", 1200, seed=1)
    write_rows(tmp_path / "test.csv", 300, seed=2)
    return tmp_path


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"hugeembed {command}: error: ") and err.count("\n") == 1, err
    return err


def test_schema_command_prints_a_usable_schema(files, capsys):
    assert main(["schema", str(files / "train.csv")]) == 0
    (files / "guess.toml").write_text(capsys.readouterr().out)
    s = load_schema(files / "guess.toml")
    assert s.label.column == "clicked" and "genres" in s.sparse_names


@pytest.mark.slow
def test_train_eval_inspect_export_read_the_schema_from_the_run(files, capsys):
    run = files / "run"
    assert main(["train", "--schema", str(files / "s.toml"), "--data", str(files / "train.csv"), "--eval-data",
                 str(files / "test.csv"), "--steps", "12", "--batch-size", "64", "--embedding-dim", "4",
                 "--checkpoint-dir", str(run), "--summary-json", str(files / "sum.json"), "--quiet"]) == 0
    summary = json.loads((files / "sum.json").read_text())
    assert summary["steps"] == 12 and 0.0 < summary["auc"] < 1.0
    tables = {"user_id", "movie_id", "genres", "city"}  # history reads movie_id
    # schema data: DLRM with a per-id bias table beside each table and a click-count table per feature by default
    # (hugeembed.cli.train)
    features = {"user_id", "movie_id", "genres", "history", "city"}
    want = tables | {f"wide_{t}" for t in tables} | {f"count_{f}" for f in features}
    assert set(summary["table_rows_per_table"]) == want
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(files / "test.csv"), "--predictions",
                 str(files / "p.txt"), "--summary-json", str(files / "eval.json")]) == 0
    assert json.loads((files / "eval.json").read_text())["auc"] == pytest.approx(summary["auc"])
    assert len((files / "p.txt").read_text().split()) == 300
    assert main(["inspect", str(run)]) == 0
    assert "history" in capsys.readouterr().out  # the schema's features, with the table history reads
    assert main(["export", "--checkpoint", str(run), "--out", str(files / "art")]) == 0
    from hugeembed.serving import ServingModel
    from hugeembed.serving._schema_requests import parse_request

    m = ServingModel.load(files / "art")
    body = (files / "test.csv").read_bytes()
    d, s = parse_request(body, "text/csv", m.schema, m.features, m.num_dense)
    probs = m.predict(d, s).numpy()
    ref = np.array([float(x) for x in (files / "p.txt").read_text().split()], np.float32)
    np.testing.assert_allclose(probs, ref, rtol=1e-5, atol=1e-6)  # served = eval on the same file


def test_convert_with_a_schema(files, capsys):
    assert main(["convert", "--schema", str(files / "s.toml"), str(files / "train.csv"), "--out",
                 str(files / "sh"), "--no-progress"]) == 0
    assert "converted 1,200 rows" in capsys.readouterr().out
    sh = ShardSet(files / "sh")
    assert sh.read_all().equals(read_table(files / "train.csv", load_schema(files / "s.toml")))


@pytest.mark.parametrize("body,message", [
    ("1,u,1,c,,,5\n", "train.csv: line 3: expected 8 fields, got 7: '1,u,1,c,,,5'"),
    ("1,u,abc,c,,,5,0\n", "train.csv: row 2 (line 3): column 'age': not a number: 'abc'"),
    ("2,u,1,c,,,5,0\n", "train.csv: row 2 (line 3): column 'clicked': label must be 0/1 or true/false, got '2'"),
])
@pytest.mark.parametrize("command", ["train", "convert"])
def test_bad_rows_stop_the_command_with_one_line(files, capsys, body, message, command):
    (files / "train.csv").write_text(f"{HEADER}\n1,u,1,c,,,5,0\n{body}" + "0,v,2,d,A,1 2,6,1\n" * 70)
    args = ["--schema", str(files / "s.toml")]
    if command == "train":
        args += ["--data", str(files / "train.csv"), "--steps", "2", "--batch-size", "8", "--checkpoint-dir",
                 str(files / "run")]
    else:
        args += [str(files / "train.csv"), "--out", str(files / "sh"), "--no-progress"]
    assert main([command, *args]) == 2
    assert message in _one_line_error(capsys, command)
    assert not (files / "sh").exists() and not list((files / "run").glob("step-*")) if (files / "run").exists() \
        else True


@pytest.mark.parametrize("command", ["train", "convert"])
def test_a_column_the_header_lacks_is_named_with_the_header(files, capsys, command):
    (files / "train.csv").write_text("clicked,user,age,city,genres,history,movie_id,score\n1,u,1,c,,,5,0\n")
    args = ["--data", str(files / "train.csv")] if command == "train" else [str(files / "train.csv"), "--out",
                                                                             str(files / "sh")]
    assert main([command, "--schema", str(files / "s.toml"), *args]) == 2
    err = _one_line_error(capsys, command)
    assert "names columns ['user_id'] that the header lacks" in err and "'user', 'age', 'city'" in err


def test_a_parquet_column_of_the_wrong_type(files, capsys):
    import pyarrow.parquet as pq

    t = pa.table({"clicked": [1, 0], "user_id": ["a", "b"], "age": [[1], [2]], "city": ["x", "y"],
                  "genres": ["A", "B"], "history": ["1", "2"], "movie_id": [1, 2], "score": [0.5, 1.0]})
    pq.write_table(t, files / "d.parquet")
    (files / "p.toml").write_text((files / "s.toml").read_text().replace('format = "csv"', 'format = "parquet"'))
    assert main(["train", "--schema", str(files / "p.toml"), "--data", str(files / "d.parquet"), "--steps", "1"]) == 2
    assert "d.parquet: column 'age' holds list<element: int64>, a dense column needs numbers" in \
        _one_line_error(capsys, "train")


def test_a_bad_schema_file_is_one_line(files, capsys):
    (files / "bad.toml").write_text(SCHEMA.replace("combiner = \"mean\"\n[sparse.history]", "combiner = \"mean\"\n"
                                                                                            "typo = 1\n[sparse.history]"))
    assert main(["train", "--schema", str(files / "bad.toml"), "--data", str(files / "train.csv")]) == 2
    assert "unknown key sparse.genres.'typo'" in _one_line_error(capsys, "train")
