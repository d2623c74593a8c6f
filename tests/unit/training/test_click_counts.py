"""Click counts inside DLRM: each id's clicks and hits counted from earlier rows only (every pass from zero), as a
smoothed log-odds the model adds to its logit; checked against a plain Python loop over the rows; the snapshot,
the export and the served model read the same counts; an option of the command line (off by default)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hugeembed import SparseFeatures
from hugeembed.errors import ConfigError
from hugeembed.models import ClickCountUpdater, make_model
from hugeembed.models._counts import COUNT_WEIGHT_SCALE
from hugeembed.optim import Adam

PRIOR = 20.0


class Oracle:
    """Counting written out: per feature and id, clicks, hits and the log-odds stored at the id's last update."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.rows, self.pos, self.ids = 0, 0.0, {}

    def read(self, feature, bag):
        """What a sample's bag reads: the mean of its ids' stored log-odds (0 unseen, 0 for an empty bag)."""
        vals = [self.ids.get((feature, i), (0.0, 0.0, 0.0))[2] for i in bag]
        return sum(vals) / len(vals) if vals else 0.0

    def lo(self, c, n):
        p = (self.pos + 1) / (self.rows + 2)
        r = (c + PRIOR * p) / (n + PRIOR)
        return math.log(r / (1 - r)) - math.log(p / (1 - p))

    def add(self, bags, labels):
        self.rows += len(labels)
        self.pos += sum(labels)
        touched = set()
        for feature, rows in bags.items():
            for bag, y in zip(rows, labels):
                for i in set(bag):  # one hit per sample
                    c, n, _ = self.ids.get((feature, i), (0.0, 0.0, 0.0))
                    self.ids[(feature, i)] = (c + y, n + 1, 0.0)
                    touched.add((feature, i))
        for k in touched:  # the touched ids' log-odds at the click rate after the batch
            c, n, _ = self.ids[k]
            self.ids[k] = (c, n, self.lo(c, n))


def _batches(steps=4, B=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        bags = {"a": [[int(torch.randint(0, 5, (1,), generator=g))] for _ in range(B)],
                # bags of 0-3 ids, repeats included (one hit per sample, every id read by the mean)
                "b": [torch.randint(0, 4, (int(k),), generator=g).tolist() for k in torch.randint(0, 4, (B,), generator=g)]}
        out.append((torch.rand(B, 2, generator=g), bags, (torch.rand(B, generator=g) < 0.4).float()))
    return out


def _model():
    model, _ = make_model("dlrm", embedding_dim=4, sparse_optimizer=Adam(lr=0.01), features=("a", "b"), num_dense=2,
                          combiner="mean", click_counts=True, bottom_mlp=(8,), top_mlp=(8,))
    return model


def _read(model, out):
    """[B, F] the count log-odds the forward read (column 0 of each count output), in the model's order."""
    return torch.stack([out[n][:, 0] for n in model.counts.names], 1)


def test_each_batch_reads_the_counts_of_earlier_rows_only_and_each_pass_starts_from_zero():
    model, oracle = _model(), Oracle()
    counts = ClickCountUpdater(model)
    features = [model.embeddings.tables[[t.name for t in model.embeddings.tables].index(n)].features[0]
                for n in model.counts.tables]
    assert features == ["a", "b"]
    for epoch in range(2):
        for step, (dense, bags, labels) in enumerate(_batches()):
            counts.before_step(step)
            if step == 0:
                oracle.reset()
            sparse = SparseFeatures.from_lists(bags)
            out = model.lookup(dense, sparse)
            want = torch.tensor([[oracle.read(f, bags[f][b]) for f in features] for b in range(len(labels))])
            torch.testing.assert_close(_read(model, out).double(), want.double(), rtol=1e-5, atol=1e-6)
            if epoch == 0 and step == 0:
                assert float(want.abs().sum()) == 0  # nothing counted yet: no evidence
            F.binary_cross_entropy_with_logits(model.forward_pooled(dense, out), labels).backward()
            model.embeddings.optimizer.step()
            counts.add(sparse, labels)  # after the step: the batch never reads its own labels
            oracle.add(bags, labels.tolist())
        assert model.count_rows.tolist() == [oracle.rows, oracle.pos]
    model.eval()  # the rows as training left them: each id's log-odds at the click rate of its last count
    dense, bags, _ = _batches(1, seed=9)[0]
    bags["b"][0] = [77]  # an id never seen reads zeros
    with torch.no_grad():
        got = _read(model, model.lookup(dense, SparseFeatures.from_lists(bags)))
    want = torch.tensor([[oracle.read(f, bags[f][b]) for f in features] for b in range(len(dense))])
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)
    assert got[0, 1] == 0


def test_the_logit_adds_the_count_log_odds_with_a_learned_weight_per_feature_one_at_first():
    model = _model()
    model.eval()
    dense, bags, labels = _batches(1)[0]
    sparse = SparseFeatures.from_lists(bags)
    counts = ClickCountUpdater(model)
    model.train()
    model.lookup(dense, sparse)
    counts.add(sparse, labels)
    model.eval()
    with torch.no_grad():
        out = model.lookup(dense, sparse)
        with_counts = model.forward_pooled(dense, out)
        model.count_weights.copy_(torch.tensor([0.5, -2.0]))
        reweighted = model.forward_pooled(dense, out)
    s = _read(model, out)
    assert float(s.abs().sum()) > 0
    # weights 1 + COUNT_WEIGHT_SCALE * parameter: 1 at first
    step = torch.tensor([0.5, -2.0]) * COUNT_WEIGHT_SCALE
    torch.testing.assert_close(reweighted - with_counts, (s * step).sum(1), rtol=1e-5, atol=1e-6)
    assert any(p is model.count_weights for p in model.dense_parameters())


def test_bad_uses_are_refused():
    from hugeembed.training import TrainConfig

    with pytest.raises(ConfigError, match="model 'deepfm' does not take click_counts"):
        make_model("deepfm", embedding_dim=4, sparse_optimizer=Adam(lr=0.01), click_counts=True)
    with pytest.raises(ConfigError, match="click-counts adds .* model 'dcn'"):
        TrainConfig(model="dcn", click_counts=True)
    with pytest.raises(ConfigError, match="not with --memory-budget"):
        TrainConfig(click_counts=True, memory_budget=1 << 20, storage_dir="/tmp/x")
    with pytest.raises(ConfigError, match="click-counts must be true or false"):
        TrainConfig(click_counts="yes")
    with pytest.raises(ConfigError, match="prior must be a positive number"):
        ClickCountUpdater(_model(), prior=0)


def test_click_counts_are_off_by_default_and_the_flag_turns_them_on():
    from tests.unit.training.test_first_order_lr import _cli_config

    data = ["--schema", "s.toml", "--data", "train.csv", "--epochs", "1"]
    assert not _cli_config(*data).click_counts  # an option: they lose on the NYC flights (docs/quality.md)
    assert _cli_config(*data, "--click-counts").click_counts
    assert not _cli_config("--data", "day_0.tsv", "--epochs", "1").click_counts
    assert _cli_config("--data", "day_0.tsv", "--epochs", "1", "--click-counts").click_counts


@pytest.mark.slow
def test_a_run_its_snapshot_and_its_served_model_read_the_same_counts(tmp_path):
    pytest.importorskip("pyarrow")
    from hugeembed import checkpoint as ckpt
    from hugeembed.data import Batch, read_table
    from hugeembed.serving import ServingModel, export
    from hugeembed.training import TrainConfig, Trainer, evaluate_snapshot, load_snapshot_model
    from tests.unit.data.schema_oracle import SCHEMA, write_rows

    (tmp_path / "s.toml").write_text(SCHEMA)
    write_rows(tmp_path / "train.csv", 600, seed=1)
    write_rows(tmp_path / "test.csv", 80, seed=2)
    cfg = TrainConfig(schema=str(tmp_path / "s.toml"), data=(str(tmp_path / "train.csv"),), steps=None, epochs=2,
                      batch_size=64, embedding_dim=4, eval_data=(str(tmp_path / "test.csv"),),
                      checkpoint_dir=str(tmp_path / "run"), eval_every=0, threads=1, click_counts=True)
    summary = Trainer(cfg).fit()
    model, _, _ = load_snapshot_model(ckpt.latest(tmp_path / "run"), device="cpu")
    assert summary["epochs"] == 2 and float(model.count_rows[0]) == summary["samples"] / 2  # the last pass's rows
    again = evaluate_snapshot(ckpt.latest(tmp_path / "run"), data=[str(tmp_path / "test.csv")])
    assert again["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    served = ServingModel.load(export(tmp_path / "run", tmp_path / "art"))
    batch = Batch.from_block(read_table(tmp_path / "test.csv", model.schema), model.schema)
    with torch.no_grad():
        want = torch.sigmoid(model(batch.dense, batch.sparse))
        model.count_weights.fill_(-1.0 / COUNT_WEIGHT_SCALE)  # weights 0: the model without its counts
        without = torch.sigmoid(model(batch.dense, batch.sparse))
    got = served.predict(batch.dense, batch.sparse)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float((got - without).abs().max()) > 1e-3  # the served model's counts matter


@pytest.mark.slow
def test_a_resumed_run_equals_the_straight_one_across_a_pass(tmp_path):
    pytest.importorskip("pyarrow")
    from hugeembed.training import TrainConfig, Trainer
    from tests.unit.data.schema_oracle import SCHEMA, write_rows

    (tmp_path / "s.toml").write_text(SCHEMA)
    write_rows(tmp_path / "train.csv", 300, seed=1)
    write_rows(tmp_path / "test.csv", 80, seed=2)

    def cfg(steps, **kw):  # 4 batches a pass: the cut at step 6 is inside the second pass
        return TrainConfig(schema=str(tmp_path / "s.toml"), data=(str(tmp_path / "train.csv"),), steps=steps,
                           batch_size=64, embedding_dim=4, eval_data=(str(tmp_path / "test.csv"),), eval_every=0,
                           threads=1, lr_decay=0.0, click_counts=True, **kw)

    whole = Trainer(cfg(10)).fit()
    Trainer(cfg(6, checkpoint_dir=str(tmp_path / "run"))).fit()
    cut = Trainer(cfg(10, checkpoint_dir=str(tmp_path / "run"), resume=True)).fit()
    assert (cut["auc"], cut["logloss"]) == (whole["auc"], whole["logloss"])
