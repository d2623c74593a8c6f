"""first_order_betas / first_order_eps: the per-id bias tables of DLRM's first_order step with Adam settings of
their own; the other tables keep the run's (sparse_betas / sparse_eps, or the measured defaults)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hugeembed import SparseFeatures
from hugeembed.errors import ConfigError
from hugeembed.training import TrainConfig
from hugeembed.training._build import build_model
from hugeembed.training._config import TRAIN_ADAM_BETAS, TRAIN_ADAM_EPS
from tests.unit.models.helpers import table_rows
from tests.unit.training.test_first_order_lr import _batch, _rows_by_id


def _adam_per_row(w: float, grads: list[float], lr: float, betas: tuple[float, float], eps: float) -> float:
    """Adam written out for one scalar weight updated at each of `grads`, bias correction by the row's own
    step count, eps added to sqrt(v_hat) (torch.optim.Adam's formula)."""
    b1, b2 = betas
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w -= lr * (m / (1 - b1 ** t)) / (math.sqrt(v / (1 - b2 ** t)) + eps)
    return w


def test_two_steps_move_bias_rows_by_their_own_betas_and_eps_and_embedding_rows_by_the_runs():
    lr, betas, eps = 0.003, (0.5, 0.9), 1e-3  # far from the run's (0, 0.999), 1e-5: each term shows
    cfg = TrainConfig(first_order=True, first_order_lr=lr, first_order_betas=betas, first_order_eps=eps,
                      sparse_lr=0.05, embedding_dim=4, admit_min_count=1)
    model, _ = build_model(cfg, torch.device("cpu"))
    dense, bags, labels = _batch()
    sparse = SparseFeatures.from_lists(bags)
    ec = model.embeddings
    feats = ("C1", "C7")
    ids = {f: sorted({i for bag in bags[f] for i in bag}) for f in feats}
    before, grads = None, {(f, t): [] for f in feats for t in (f, f"wide_{f}")}
    for _ in range(2):  # the same batch twice: every row hit at both steps, with different gradients
        out = model.lookup(dense, sparse)
        if before is None:  # the rows are born at the first lookup (the biases at zero)
            before = {key: table_rows(ec, key[1], ids[key[0]]).double() for key in grads}
        for g in out.groups():
            g.retain_grad()
        F.binary_cross_entropy_with_logits(model.forward_pooled(dense, out), labels).backward()  # tables step
        for f, table in grads:
            g_idx, k = out._where[f"{f}@{table}"]
            grads[(f, table)].append(_rows_by_id(bags[f], out.groups()[g_idx].grad[:, k].double()))
    for (f, table), steps in grads.items():
        rule = (lr, betas, eps) if table.startswith("wide_") else (0.05, TRAIN_ADAM_BETAS, TRAIN_ADAM_EPS)
        want = torch.tensor([[_adam_per_row(float(before[(f, table)][n, c]), [float(s[i][c]) for s in steps], *rule)
                              for c in range(before[(f, table)].shape[1])] for n, i in enumerate(ids[f])],
                            dtype=torch.float64)
        assert all(float(steps[1][i].abs().max()) > 1e-7 for i in ids[f])  # the 2nd step moves every row
        torch.testing.assert_close(table_rows(ec, table, ids[f]).double(), want, rtol=1e-4, atol=1e-6)


def test_the_run_settings_differ_from_the_biases_only_where_given():
    cfg = TrainConfig(first_order=True, first_order_eps=1e-8)
    assert cfg.first_order_optimizer_options() == {"lr": cfg.sparse_lr, "betas": TRAIN_ADAM_BETAS, "eps": 1e-8}
    assert TrainConfig(first_order=True).first_order_optimizer_options() is None  # the run's optimizer itself
    both = TrainConfig(first_order=True, sparse_betas=(0.5, 0.99), first_order_lr=0.01, first_order_betas=[0.9, 0.999])
    assert both.first_order_optimizer_options() == {"lr": 0.01, "betas": (0.9, 0.999), "eps": TRAIN_ADAM_EPS}
    assert both.sparse_optimizer_options()["betas"] == (0.5, 0.99)
    assert TrainConfig.from_dict(both.to_dict()) == both  # snapshots rebuild the same rules


@pytest.mark.parametrize("kwargs, match", [
    ({"first_order_betas": (1.0, 0.999)}, r"first-order-betas must be two numbers in \[0, 1\)"),
    ({"first_order_betas": (0.9,)}, r"first-order-betas must be two numbers"),
    ({"first_order_betas": (0.9, float("nan"))}, r"first-order-betas must be two numbers"),
    ({"first_order_betas": "0.9 0.999"}, r"first-order-betas must be two numbers"),
    ({"first_order_eps": 0}, "first-order-eps must be a positive number, got 0"),
    ({"first_order_eps": float("inf")}, "first-order-eps must be a positive number"),
    ({"first_order_eps": True}, "first-order-eps must be a positive number"),
    ({"first_order_eps": 1e-8, "sparse_optimizer": "adagrad"}, "first-order-eps applies to the Adam optimizers .* "
                                                              "not to sparse optimizer 'adagrad'"),
])
def test_bad_bias_adam_settings_are_refused_naming_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(first_order=True, **kwargs)


def test_bias_adam_settings_need_first_order():
    with pytest.raises(ConfigError, match="first-order-betas and first-order-eps: .* need first-order"):
        TrainConfig(first_order_betas=(0.9, 0.999), first_order_eps=1e-8)


def test_the_flags_set_the_fields():
    from hugeembed.cli import build_parser
    from hugeembed.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--first-order", "--first-order-betas", "0.9", "0.99",
                                      "--first-order-eps", "1e-7"])
    cfg = config_from_args(args)
    assert (cfg.first_order_betas, cfg.first_order_eps) == ((0.9, 0.99), 1e-7)


def test_schema_data_gets_the_biases_adam_settings_by_default_unless_the_run_says_otherwise():
    from hugeembed.cli.train import SCHEMA_FIRST_ORDER_BETAS, SCHEMA_FIRST_ORDER_EPS
    from tests.unit.training.test_first_order_lr import _cli_config

    data = ["--schema", "s.toml", "--data", "train.csv", "--epochs", "1"]
    cfg = _cli_config(*data)
    assert (cfg.first_order_betas, cfg.first_order_eps) == (SCHEMA_FIRST_ORDER_BETAS, SCHEMA_FIRST_ORDER_EPS)
    assert cfg.sparse_optimizer_options()["betas"] == TRAIN_ADAM_BETAS  # the embedding tables keep the run's
    plain = _cli_config("--data", "day_0.tsv", "--epochs", "1")  # Criteo's runs: no biases
    assert (plain.first_order_betas, plain.first_order_eps) == (None, None)
    adagrad = _cli_config(*data, "--sparse-optimizer", "adagrad")  # no Adam settings for a rule without them
    assert adagrad.first_order and (adagrad.first_order_betas, adagrad.first_order_eps) == (None, None)
    own = _cli_config(*data, "--first-order", "--first-order-eps", "1e-6")  # the run's own choice, whole
    assert (own.first_order_betas, own.first_order_eps, own.first_order_lr) == (None, 1e-6, None)
