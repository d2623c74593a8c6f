"""Training runs on schema data: a CSV file and its shards train the same model, a resumed run equals the
straight one, and the schema (with its fitted statistics) travels in the snapshot."""

from __future__ import annotations

import pytest

from hugeembed import checkpoint as ckpt
from hugeembed.data import convert, load_schema
from hugeembed.training import RunRecord, TrainConfig, Trainer
from tests.unit.data.schema_oracle import SCHEMA, write_rows

pytest.importorskip("pyarrow")
pytestmark = pytest.mark.slow

STANDARDIZED = SCHEMA.replace('[dense.score]\nfill = -1.5', '[dense.score]\nfill = -1.5\ntransform = "standardize"')


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("schema-runs")
    (d / "s.toml").write_text(STANDARDIZED)
    write_rows(d / "train.csv", 900, seed=4)
    write_rows(d / "test.csv", 200, seed=5)
    return d


def _cfg(d, data, **kw):
    settings = dict(steps=8, batch_size=64, embedding_dim=4, eval_every=0, threads=1) | kw
    return TrainConfig(schema=str(d / "s.toml") if str(data).endswith(".csv") else None, data=(str(data),),
                       eval_data=(str(d / "test.csv"),), **settings)


def test_csv_and_its_shards_train_the_same_model(files):
    convert(files / "train.csv", files / "shards", schema=load_schema(files / "s.toml"), rows_per_shard=256)
    a = Trainer(_cfg(files, files / "train.csv")).fit()
    b = Trainer(_cfg(files, files / "shards")).fit()
    assert a["auc"] == b["auc"] and a["logloss"] == b["logloss"] and a["table_rows"] == b["table_rows"]


def test_resume_equals_the_straight_run_and_keeps_the_fitted_schema(files, tmp_path):
    straight = Trainer(_cfg(files, files / "train.csv")).fit()
    run = tmp_path / "run"
    Trainer(_cfg(files, files / "train.csv", steps=4, checkpoint_dir=str(run), lr_decay=0.0)).fit()
    record = RunRecord.from_dict(ckpt.read_extra(ckpt.latest(run)), "snap")
    score = next(d for d in record.schema.dense if d.name == "score")
    assert score.transform == "standardize" and score.mean is not None and score.std > 0
    cut = Trainer(_cfg(files, files / "train.csv", steps=8, checkpoint_dir=str(run), resume=True, lr_decay=0.0)).fit()
    whole = Trainer(_cfg(files, files / "train.csv", steps=8, lr_decay=0.0)).fit()
    assert cut["auc"] == whole["auc"] and cut["logloss"] == whole["logloss"]
    assert straight["steps"] == 8


def test_first_order_run_keeps_its_per_id_biases_in_the_snapshot(files, tmp_path):
    """--first-order: DLRM with a dim-1 table beside each table; the snapshot rebuilds the same model
    (its evaluation scores the run's own figures)."""
    from hugeembed.training import evaluate_snapshot, load_snapshot_model

    run = tmp_path / "fo"
    s = Trainer(_cfg(files, files / "train.csv", first_order=True, checkpoint_dir=str(run))).fit()
    model, cfg, _ = load_snapshot_model(ckpt.latest(run), device="cpu")
    wide = [t.name for t in model.embeddings.tables if t.dim == 1]
    assert cfg.first_order and wide and all(n.startswith("wide_") for n in wide)
    assert len(model.first_order) == len(model.fields)  # one bias per feature (a shared table: per reader)
    again = evaluate_snapshot(ckpt.latest(run), data=[str(files / "test.csv")])
    assert again["auc"] == pytest.approx(s["auc"], abs=1e-6) and again["logloss"] == pytest.approx(s["logloss"], abs=1e-6)
