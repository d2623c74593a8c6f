"""first_order_admit_min_count / first_order_lr_count_scale: the per-id bias tables of DLRM's first_order with
rare-id rules of their own (admission, per-row lr by hit count); the embedding tables keep the run's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from hugeembed import SparseFeatures
from hugeembed.errors import ConfigError
from hugeembed.training import TrainConfig
from hugeembed.training._build import build_model
from tests.unit.models.helpers import table_rows
from tests.unit.training.test_first_order_lr import EPS, _batch, _cli_config, _rows_by_id


def test_the_bias_tables_take_their_own_options_and_the_embedding_tables_the_runs():
    cfg = TrainConfig(first_order=True, admit_min_count=4, lr_count_scale=7, first_order_admit_min_count=1,
                      first_order_lr_count_scale=5)
    model, _ = build_model(cfg, torch.device("cpu"))
    tables = model.embeddings.tables
    assert {t.name for t in tables if t.name.startswith("wide_")} == {f"wide_{t.name}" for t in tables if t.dim > 1}
    for t in tables:
        want = (1, False, 5) if t.name.startswith("wide_") else (4, True, 7)
        assert (t.admit_min_count, t.shared_row, t.lr_count_scale) == want, t.name
    same = build_model(TrainConfig(first_order=True, admit_min_count=4), torch.device("cpu"))[0].embeddings.tables
    assert all((t.admit_min_count, t.shared_row, t.lr_count_scale) == (4, True, None) for t in same)  # None: the run's


def test_one_step_gives_every_id_a_bias_scaled_by_its_hits_while_rare_ids_share_an_embedding_row():
    lr, n = 0.01, 3
    cfg = TrainConfig(first_order=True, first_order_lr=lr, embedding_dim=4, admit_min_count=3,
                      first_order_admit_min_count=1, first_order_lr_count_scale=n)
    model, _ = build_model(cfg, torch.device("cpu"))
    dense, bags, labels = _batch()
    out = model.lookup(dense, SparseFeatures.from_lists(bags))
    for g in out.groups():
        g.retain_grad()
    F.binary_cross_entropy_with_logits(model.forward_pooled(dense, out), labels).backward()  # tables step here
    ec = model.embeddings
    for f in ("C1", "C7"):
        hits = Counter(i for bag in bags[f] for i in bag)
        ids = sorted(hits)
        assert min(hits.values()) < 3 <= max(hits.values())  # both kinds of id in the batch
        # the embedding table: a row of its own only from the 3rd hit; the bias table: every id at first sight
        own = ec.store(f).find(torch.tensor(ids)) >= 0
        assert own.tolist() == [hits[i] >= 3 for i in ids]
        assert bool((ec.store(f"wide_{f}").find(torch.tensor(ids)) >= 0).all())
        g_idx, k = out._where[f"{f}@wide_{f}"]
        grads = _rows_by_id(bags[f], out.groups()[g_idx].grad[:, k])
        # Adam's first step of a zero bias (beta1 0, per-row bias correction) at lr * min(1, hits / n)
        want = torch.stack([-lr * min(1.0, hits[i] / n) * grads[i] / (grads[i].abs() + EPS) for i in ids])
        torch.testing.assert_close(table_rows(ec, f"wide_{f}", ids), want, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("key", ["first_order_admit_min_count", "first_order_lr_count_scale"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3"])
def test_a_bad_value_is_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"{key.replace('_', '-')} must be a positive integer, got {value!r}"):
        TrainConfig(first_order=True, **{key: value})


@pytest.mark.parametrize("key", ["first_order_admit_min_count", "first_order_lr_count_scale"])
def test_the_options_need_first_order(key):
    with pytest.raises(ConfigError, match=f"{key.replace('_', '-')} sets the per-id bias tables' .* needs first-order"):
        TrainConfig(**{key: 2})


def test_the_flags_set_the_fields():
    cfg = _cli_config("--first-order", "--first-order-admit-min-count", "2", "--first-order-lr-count-scale", "9")
    assert (cfg.first_order_admit_min_count, cfg.first_order_lr_count_scale) == (2, 9)
