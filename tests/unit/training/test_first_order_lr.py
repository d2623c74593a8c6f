"""first_order_lr: the per-id bias tables of DLRM's first_order train at their own learning rate, under the run's
sparse optimizer and its schedule; the other tables keep sparse_lr.  dropout: the model's MLP dropout, from the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hugeembed import SparseFeatures
from hugeembed.data import CAT_NAMES
from hugeembed.errors import ConfigError
from hugeembed.training import TrainConfig, Trainer
from hugeembed.training._build import build_model
from tests.unit.models.helpers import table_rows

EPS = 1e-5  # the training runs' Adam eps (TRAIN_ADAM_EPS), beta1 0


def _batch(B: int = 12, rows: int = 6):
    """Dense [B, 13], the bags of every Criteo feature (one or two ids of `rows`) as lists, labels [B]."""
    g = torch.Generator().manual_seed(3)
    bags = {f: [torch.randint(0, rows, (int(k),), generator=g).tolist() for k in torch.randint(1, 3, (B,), generator=g)]
            for f in CAT_NAMES}
    return torch.rand(B, 13, generator=g), bags, (torch.rand(B, generator=g) < 0.4).float()


def _rows_by_id(bags: list[list[int]], grad: torch.Tensor) -> dict[int, torch.Tensor]:
    """Plain sum over the batch of d loss / d pooled for each id of a sum-pooled feature (its row's gradient)."""
    out: dict[int, torch.Tensor] = {}
    for b, ids in enumerate(bags):
        for i in ids:
            out[i] = out.get(i, torch.zeros_like(grad[b])) + grad[b]
    return out


def test_one_step_moves_bias_rows_by_first_order_lr_and_embedding_rows_by_sparse_lr():
    cfg = TrainConfig(first_order=True, first_order_lr=0.003, sparse_lr=0.05, embedding_dim=4, admit_min_count=1)
    model, _ = build_model(cfg, torch.device("cpu"))
    dense, bags, labels = _batch()
    sparse = SparseFeatures.from_lists(bags)
    ec = model.embeddings
    feats = ("C1", "C7")
    ids = {f: sorted({i for bag in bags[f] for i in bag}) for f in feats}
    out = model.lookup(dense, sparse)  # the rows are born here (the biases at zero)
    before = {(f, t): table_rows(ec, t, ids[f]) for f in feats for t in (f, f"wide_{f}")}
    assert all(float(before[(f, f"wide_{f}")].abs().sum()) == 0 for f in feats)
    for g in out.groups():
        g.retain_grad()
    F.binary_cross_entropy_with_logits(model.forward_pooled(dense, out), labels).backward()  # tables step here
    for f in feats:
        for table, lr in ((f"wide_{f}", 0.003), (f, 0.05)):
            g_idx, k = out._where[f"{f}@{table}"]
            grads = _rows_by_id(bags[f], out.groups()[g_idx].grad[:, k])
            # Adam's first step of a row, beta1 0, per-row bias correction: w -= lr * g / (|g| + eps)
            want = torch.stack([before[(f, table)][n] - lr * grads[i] / (grads[i].abs() + EPS)
                                for n, i in enumerate(ids[f])])
            torch.testing.assert_close(table_rows(ec, table, ids[f]), want, rtol=1e-5, atol=1e-7)


def test_the_schedule_scales_the_bias_rate_as_the_others():
    cfg = TrainConfig(steps=4, lr_decay=0.5, eval_every=0, batch_size=128, eval_rows=512, threads=1,
                      synthetic_rows=10_000, synthetic_max_cardinality=1000, first_order=True, first_order_lr=0.004)
    t = Trainer(cfg)
    t.fit()
    lrs = {g["table"]: g["lr"] for g in t.collection.optimizer.param_groups if g["table"] is not None}
    assert lrs and all(v == pytest.approx((0.004 if n.startswith("wide_") else cfg.sparse_lr) / 2)
                       for n, v in lrs.items())
    assert any(n.startswith("wide_") for n in lrs)


@pytest.mark.parametrize("value", [0, -0.1, float("nan"), float("inf"), "fast", True])
def test_bad_first_order_lr_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="first-order-lr must be a positive number"):
        TrainConfig(first_order=True, first_order_lr=value)


def test_first_order_lr_needs_first_order():
    with pytest.raises(ConfigError, match="first-order-lr .* needs first-order"):
        TrainConfig(first_order_lr=0.01)


def test_the_flag_sets_the_field():
    from hugeembed.cli import build_parser
    from hugeembed.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--first-order", "--first-order-lr", "0.01"])
    cfg = config_from_args(args)
    assert cfg.first_order and cfg.first_order_lr == 0.01
    assert TrainConfig.from_dict(cfg.to_dict()).first_order_lr == 0.01  # snapshots rebuild the same rule


def test_dropout_reaches_the_model_and_bad_values_are_refused():
    from hugeembed.cli import build_parser
    from hugeembed.cli.train import config_from_args

    cfg = config_from_args(build_parser().parse_args(["train", "--dropout", "0.25"]))
    model, _ = build_model(cfg.replace(embedding_dim=4), torch.device("cpu"))
    assert [m.p for m in model.top.modules() if isinstance(m, torch.nn.Dropout)] == [0.25, 0.25, 0.25]
    plain, _ = build_model(TrainConfig(embedding_dim=4), torch.device("cpu"))
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    for bad in (1.0, -0.5, float("nan"), "0.1", True):
        with pytest.raises(ConfigError, match="dropout must be a probability in"):
            TrainConfig(dropout=bad)


def _cli_config(*argv: str) -> TrainConfig:
    from hugeembed.cli import build_parser
    from hugeembed.cli.train import config_from_args

    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_schema_data_gets_per_id_biases_by_default_unless_the_run_says_otherwise(tmp_path):
    from hugeembed.cli.train import SCHEMA_FIRST_ORDER_LR

    data = ["--schema", "s.toml", "--data", "train.csv", "--epochs", "1"]
    cfg = _cli_config(*data)
    assert (cfg.model, cfg.first_order, cfg.first_order_lr) == ("dlrm", True, SCHEMA_FIRST_ORDER_LR)
    assert not _cli_config("--epochs", "1").first_order  # Criteo's (synthetic) runs keep the plain DLRM
    assert not _cli_config("--data", "day_0.tsv", "--epochs", "1").first_order
    assert not _cli_config(*data, "--no-first-order").first_order
    assert _cli_config(*data, "--first-order", "--first-order-lr", "0.2").first_order_lr == 0.2
    assert _cli_config(*data, "--model", "deepfm").first_order is False  # its own first-order tables
    (tmp_path / "c.toml").write_text("[train]\nfirst_order = false\n")
    assert not _cli_config(*data, "--config", str(tmp_path / "c.toml")).first_order
