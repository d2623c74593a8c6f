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


def test_the_logit_adds_the_count_log_odds_with_a_weight_per_feature_one_at_first_and_an_intercept():
    model = _model()
    dense, bags, labels = _batches(1)[0]
    sparse = SparseFeatures.from_lists(bags)
    counts = ClickCountUpdater(model)
    model.train()
    model.lookup(dense, sparse)
    counts.add(sparse, labels)  # no logits: counted, the weights not fitted
    assert model.count_fit.tolist() == [0.0, 1.0, 1.0]
    model.eval()
    with torch.no_grad():
        out = model.lookup(dense, sparse)
        with_counts = model.forward_pooled(dense, out)
        model.count_fit.copy_(torch.tensor([0.25, 0.5, -2.0]))
        reweighted = model.forward_pooled(dense, out)
    s = _read(model, out)
    assert float(s.abs().sum()) > 0
    torch.testing.assert_close(reweighted - with_counts, 0.25 + (s * torch.tensor([-0.5, -3.0])).sum(1),
                               rtol=1e-5, atol=1e-6)
    assert not any(p is model.count_fit for p in model.dense_parameters())  # fitted apart, not by Adam


def _newton_oracle(fit, hessian, s, z, y, factor, step, decay, ridge):
    """One damped Newton step on [b, w] written out in plain Python (lists, a Gaussian elimination)."""
    n, k = len(y), len(fit)
    x = [[1.0] + list(row) for row in s]
    p = [1.0 / (1.0 + math.exp(-v)) for v in z]
    g = [sum(x[i][a] * (p[i] - y[i]) for i in range(n)) / n for a in range(k)]
    h = [[sum(x[i][a] * x[i][c] * p[i] * (1 - p[i]) for i in range(n)) / n for c in range(k)] for a in range(k)]
    if all(v == 0 for row in hessian for v in row):
        hessian = h
    else:
        hessian = [[decay * hessian[a][c] + (1 - decay) * h[a][c] for c in range(k)] for a in range(k)]
    m = [[hessian[a][c] + (ridge if a == c else 0.0) for c in range(k)] + [g[a]] for a in range(k)]
    for a in range(k):  # Gauss-Jordan with partial pivoting
        piv = max(range(a, k), key=lambda r: abs(m[r][a]))
        m[a], m[piv] = m[piv], m[a]
        for r in range(k):
            if r != a:
                f = m[r][a] / m[a][a]
                m[r] = [u - f * v for u, v in zip(m[r], m[a])]
    delta = [m[a][k] / m[a][a] for a in range(k)]
    return [f - step * factor * d for f, d in zip(fit, delta)], hessian


def test_the_count_weights_take_a_damped_newton_step_on_each_batch_against_a_plain_python_oracle():
    from hugeembed.models._count_fit import count_fit_step

    g = torch.Generator().manual_seed(3)
    fit = torch.tensor([0.0, 1.0, 1.0, 1.0])
    hessian = torch.zeros(4, 4, dtype=torch.float64)
    want_fit, want_h = fit.tolist(), hessian.tolist()
    for t, factor in enumerate((1.0, 1.0, 0.5)):  # the first batch sets the running Hessian, later ones average
        s = torch.randn(32, 3, generator=g)
        y = (torch.rand(32, generator=g) < 0.3).float()
        z = torch.randn(32, generator=g) + s @ fit[1:] + fit[0]
        count_fit_step(fit, hessian, s, z, y, factor, step=0.5, decay=0.8, ridge=1e-3)
        want_fit, want_h = _newton_oracle(want_fit, want_h, s.tolist(), z.tolist(), y.tolist(), factor, 0.5, 0.8, 1e-3)
        torch.testing.assert_close(hessian, torch.tensor(want_h, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(fit, torch.tensor(want_fit), rtol=1e-5, atol=1e-6)
    before = fit.clone()
    count_fit_step(fit, hessian, s, z, y, 0.0)  # the end of the decay: no step
    assert torch.equal(fit, before)


def test_the_newton_fit_learns_how_much_repeated_evidence_adds():
    """Two copies of one feature's log-odds and one of pure noise: counting's sum counts the evidence twice;
    the fitted weights share it (w1 + w2 near the true 1) and drop the noise (w3 near 0)."""
    from hugeembed.models._count_fit import count_fit_step

    g = torch.Generator().manual_seed(5)
    fit = torch.tensor([0.0, 1.0, 1.0, 1.0])
    hessian = torch.zeros(4, 4, dtype=torch.float64)
    for _ in range(300):
        a = torch.randn(2048, generator=g)
        s = torch.stack([a, a + 0.1 * torch.randn(2048, generator=g), torch.randn(2048, generator=g)], 1)
        y = (torch.rand(2048, generator=g) < torch.sigmoid(a - 1.0)).float()
        count_fit_step(fit, hessian, s, s @ fit[1:] + fit[0], y)
    assert abs(float(fit[1] + fit[2]) - 1.0) < 0.1 and abs(float(fit[3])) < 0.05 and abs(float(fit[0]) + 1.0) < 0.1


def _shift_oracle(logits, positives):
    """Plain Python: the d with sum(sigmoid(l + d)) = positives, by bisection on exact logits."""
    lo, hi = -64.0, 64.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(1 / (1 + math.exp(-(x + mid))) for x in logits) > positives:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def test_the_calibration_shift_makes_the_mean_prediction_the_click_rate_against_a_plain_python_oracle():
    from hugeembed.models._count_fit import LogitHistogram, calibration_shift

    g = torch.Generator().manual_seed(7)
    w = 64 / 4096  # a bin: logits on bin centres are counted exactly
    for mean, std, rate in ((-1.9, 0.7, 0.18), (0.3, 2.0, 0.52), (-4.0, 1.0, 0.01)):
        on_centres = (torch.round((torch.randn(3000, generator=g) * std + mean) / w - 0.5) + 0.5) * w
        y = (torch.rand(3000, generator=g) < rate).float()
        hist = LogitHistogram()
        for a in range(0, 3000, 1000):  # added batch by batch
            hist.add(on_centres[a:a + 1000], y[a:a + 1000])
        d = calibration_shift(hist)
        assert d == pytest.approx(_shift_oracle(on_centres.double().tolist(), float(y.sum())), abs=1e-7)
        assert float(torch.sigmoid(on_centres.double() + d).mean()) == pytest.approx(float(y.double().mean()), abs=1e-9)
        anywhere = torch.randn(3000, generator=g) * std + mean  # off the centres: within half a bin
        hist = LogitHistogram()
        hist.add(anywhere, y)
        assert calibration_shift(hist) == pytest.approx(_shift_oracle(anywhere.double().tolist(), float(y.sum())),
                                                        abs=w / 2)
    assert calibration_shift(LogitHistogram()) == 0.0  # no rows: no shift
    hist = LogitHistogram()
    hist.add(torch.zeros(4), torch.zeros(4))  # no click: half a click, not an infinite shift
    assert calibration_shift(hist) == pytest.approx(_shift_oracle([0.0] * 4, 0.5), abs=w / 2)


@pytest.mark.slow
def test_the_run_ends_with_its_mean_prediction_on_its_training_rows_at_their_click_rate(tmp_path):
    pytest.importorskip("pyarrow")
    from hugeembed.data import Batch, read_table
    from hugeembed.training import Trainer

    tr = Trainer(_schema_run_config(tmp_path, 640, epochs=2))  # 10 whole batches: every row trained
    summary = tr.fit()
    model = tr.model
    schema = tr.source.schema
    batch = Batch.from_block(read_table(tmp_path / "train.csv", schema), schema)
    assert batch.batch_size == 640

    model.eval()  # evaluation, export and serving read the shift

    def mean_prediction():
        with torch.no_grad():
            return float(torch.sigmoid(model(batch.dense, batch.sparse)).double().mean())

    assert float(model.count_shift) == pytest.approx(summary["count_calibration"]) and summary["count_calibration"] != 0
    assert mean_prediction() == pytest.approx(float(batch.labels.double().mean()), abs=2e-3)  # bins of 1/64
    model.train()  # training reads no shift (a run resumed past the end trains as the straight run)
    trained = mean_prediction()
    assert abs(trained - float(batch.labels.double().mean())) > 1e-4


def test_bad_uses_are_refused():
    from hugeembed.training import TrainConfig

    with pytest.raises(ConfigError, match="model 'deepfm' does not take click_counts"):
        make_model("deepfm", embedding_dim=4, sparse_optimizer=Adam(lr=0.01), click_counts=True)
    with pytest.raises(ConfigError, match="click-counts adds .* model 'dcn'"):
        TrainConfig(model="dcn", click_counts=True)
    with pytest.raises(ConfigError, match="not with --memory-budget"):
        TrainConfig(click_counts=True, memory_budget=1 << 20, storage_dir="/tmp/x")
    with pytest.raises(ConfigError, match="not with --staleness 2"):
        TrainConfig(click_counts=True, staleness=2)
    with pytest.raises(ConfigError, match="not with --data-queue"):
        TrainConfig(click_counts=True, data_queue=1000)
    with pytest.raises(ConfigError, match="click-counts must be true or false"):
        TrainConfig(click_counts="yes")
    with pytest.raises(ConfigError, match="prior must be a positive number"):
        ClickCountUpdater(_model(), prior=0)


def test_click_counts_are_on_for_schema_data_with_tables_in_memory_and_synchronous_steps(monkeypatch):
    from tests.unit.training.test_first_order_lr import _cli_config

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    data = ["--schema", "s.toml", "--data", "train.csv", "--epochs", "1"]
    assert _cli_config(*data).click_counts  # the default on data of a schema of its own (docs/quality.md, 8th round)
    assert not _cli_config(*data, "--no-click-counts").click_counts
    assert not _cli_config(*data, "--model", "deepfm").click_counts  # DLRM's only
    # several processes count as one does (tests/dist/test_click_counts_dist.py)
    assert _cli_config(*data, "--nproc", "2").click_counts
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _cli_config(*data).click_counts  # a process of a torchrun / --nproc run
    monkeypatch.delenv("WORLD_SIZE")
    # what the counts do not support keeps the per-id biases alone: tiered tables, asynchronous steps
    assert not _cli_config(*data, "--memory-budget", "1MiB", "--storage-dir", "/tmp/x").click_counts
    assert not _cli_config(*data, "--nproc", "2", "--staleness", "2").click_counts
    assert not _cli_config(*data, "--nproc", "2", "--data-queue", "1000").click_counts  # hands rows out once
    # Criteo's runs are unchanged: off unless asked
    assert not _cli_config("--data", "day_0.tsv", "--epochs", "1").click_counts
    assert _cli_config("--data", "day_0.tsv", "--epochs", "1", "--click-counts").click_counts


def _schema_run_config(tmp_path, train_rows: int, **kw):
    """A schema set's files under tmp_path (train_rows training rows, 80 held out) and a click-count run's
    config over them, batch 64, dim 4, one thread, no periodic evals."""
    from hugeembed.training import TrainConfig
    from tests.unit.data.schema_oracle import SCHEMA, write_rows

    (tmp_path / "s.toml").write_text(SCHEMA)
    write_rows(tmp_path / "train.csv", train_rows, seed=1)
    write_rows(tmp_path / "test.csv", 80, seed=2)
    return TrainConfig(schema=str(tmp_path / "s.toml"), data=(str(tmp_path / "train.csv"),), batch_size=64,
                       embedding_dim=4, eval_data=(str(tmp_path / "test.csv"),), eval_every=0, threads=1,
                       click_counts=True, **kw)


@pytest.mark.slow
def test_a_run_its_snapshot_and_its_served_model_read_the_same_counts(tmp_path):
    pytest.importorskip("pyarrow")
    from hugeembed import checkpoint as ckpt
    from hugeembed.data import Batch, read_table
    from hugeembed.serving import ServingModel, export
    from hugeembed.training import Trainer, evaluate_snapshot, load_snapshot_model

    cfg = _schema_run_config(tmp_path, 600, steps=None, epochs=2, checkpoint_dir=str(tmp_path / "run"))
    summary = Trainer(cfg).fit()
    model, _, _ = load_snapshot_model(ckpt.latest(tmp_path / "run"), device="cpu")
    assert summary["epochs"] == 2 and float(model.count_rows[0]) == summary["samples"] / 2  # the last pass's rows
    again = evaluate_snapshot(ckpt.latest(tmp_path / "run"), data=[str(tmp_path / "test.csv")])
    assert again["auc"] == pytest.approx(summary["auc"], abs=1e-6)
    served = ServingModel.load(export(tmp_path / "run", tmp_path / "art"))
    batch = Batch.from_block(read_table(tmp_path / "test.csv", model.schema), model.schema)
    with torch.no_grad():
        want = torch.sigmoid(model(batch.dense, batch.sparse))
        model.count_fit.zero_()  # weights and intercept 0: the model without its counts
        without = torch.sigmoid(model(batch.dense, batch.sparse))
    got = served.predict(batch.dense, batch.sparse)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float((got - without).abs().max()) > 1e-3  # the served model's counts matter


@pytest.mark.slow
def test_a_resumed_run_equals_the_straight_one_across_a_pass(tmp_path):
    pytest.importorskip("pyarrow")
    from hugeembed.training import Trainer

    base = _schema_run_config(tmp_path, 300, lr_decay=0.0)

    def cfg(steps, **kw):  # 4 batches a pass: the cut at step 6 is inside the second pass
        return base.replace(steps=steps, **kw)

    whole = Trainer(cfg(10)).fit()
    Trainer(cfg(6, checkpoint_dir=str(tmp_path / "run"))).fit()
    cut = Trainer(cfg(10, checkpoint_dir=str(tmp_path / "run"), resume=True)).fit()
    assert (cut["auc"], cut["logloss"]) == (whole["auc"], whole["logloss"])
    # a run saved with click counts resumed without them (or the other way) is another run: one line, named
    from hugeembed.errors import CheckpointError

    plain = cfg(12, checkpoint_dir=str(tmp_path / "run"), resume=True).replace(click_counts=False)
    with pytest.raises(CheckpointError, match=r"click_counts \(True vs False: give --click-counts as saved\)"):
        Trainer(plain).fit()


@pytest.mark.slow
def test_snapshot_deltas_hold_the_counted_rows_and_a_pass_start_writes_a_full_one(tmp_path):
    """The rows a step counts are rows its forward fetched (their last step is the step's): a delta holds them.
    A pass's start zeroes every row, seen or not: the snapshot after it is full."""
    pytest.importorskip("pyarrow")
    import json

    from hugeembed import checkpoint as ckpt
    from hugeembed.training import Trainer, load_snapshot_model

    # 300 rows, batch 64: 4 batches a pass (the short fifth dropped); step 5 starts the second pass
    cfg = _schema_run_config(tmp_path, 300, steps=6, checkpoint_dir=str(tmp_path / "run"), checkpoint_every=1,
                             full_checkpoint_every=10)
    trainer = Trainer(cfg)
    trainer.fit()
    kinds = [json.loads((s / "manifest.json").read_text())["kind"] for s in sorted((tmp_path / "run").glob("step-*"))]
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta"]
    model, _, _ = load_snapshot_model(ckpt.latest(tmp_path / "run"), device="cpu")
    for name in trainer.model.counts.tables:
        want, got = trainer.collection.store(name).export(), model.embeddings.store(name).export()
        order_w, order_g = want.keys.argsort(), got.keys.argsort()
        assert torch.equal(got.keys[order_g], want.keys[order_w])
        assert torch.equal(got.rows[order_g], want.rows[order_w]), name
    assert torch.equal(model.count_rows, trainer.model.count_rows)


def test_a_snapshot_saved_before_count_shift_existed_loads_with_no_shift_and_other_gaps_still_fail():
    from pathlib import Path

    from hugeembed.checkpoint._restore import _load_dense
    from hugeembed.errors import CheckpointError

    saved, model = _model(), _model()
    model.count_shift.fill_(0.7)  # what a model held before the load
    dense = {k: v for k, v in saved.state_dict().items() if not k.startswith("embeddings.") and k != "count_shift"}
    _load_dense(model, model.embeddings, dense, Path("step-1"))
    assert float(model.count_shift) == 0.0 and torch.equal(model.count_fit, saved.count_fit)
    del dense["count_fit"]
    with pytest.raises(CheckpointError, match=r"step-1: dense model does not match: missing \['count_fit'\]"):
        _load_dense(model, model.embeddings, dense, Path("step-1"))
