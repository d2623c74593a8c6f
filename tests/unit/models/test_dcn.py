"""DCN-v2: x0 = [dense, embeddings]; stacked head(MLP(cross(x0))) or parallel head([cross(x0), MLP(x0)])."""

from __future__ import annotations

import pytest
import torch

from hugeembed import ConfigError
from hugeembed.models import DCNv2, criteo_tables
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adagrad

from .helpers import NUM_DENSE, make_batch, train

MIXED = [TableConfig("a", 2, combiner="sum"), TableConfig("b", 5, combiner="mean"), TableConfig("c", 3)]


def trained(**kw):
    ec = EmbeddingCollection(MIXED, optimizer=Adagrad(lr=0.1))
    model = DCNv2(ec, NUM_DENSE, **kw)
    dense, sparse, labels = make_batch(B=6)
    train(model, model.dense_parameters(), dense, sparse, labels, steps=2)
    model.eval()
    return model, dense, sparse, torch.cat([dense, *(ec(sparse)[f] for f in "abc")], dim=1)


def test_stacked_is_head_of_mlp_of_cross():
    model, dense, sparse, x0 = trained(num_cross=2, deep=(8, 4))
    assert x0.shape[1] == model.cross.in_features == NUM_DENSE + 2 + 5 + 3
    want = model.head(model.deep(model.cross(x0)))[:, 0]
    torch.testing.assert_close(model(dense, sparse), want)


def test_parallel_is_head_of_cross_beside_mlp():
    model, dense, sparse, x0 = trained(num_cross=2, deep=(8, 4), structure="parallel")
    assert model.head.in_features == x0.shape[1] + 4
    want = model.head(torch.cat([model.cross(x0), model.deep(x0)], dim=1))[:, 0]
    torch.testing.assert_close(model(dense, sparse), want)


@pytest.mark.parametrize("kw", [dict(low_rank=3), dict(low_rank=2, num_experts=4), dict(deep=())])
def test_low_rank_mixture_and_cross_only(kw):
    model, dense, sparse, x0 = trained(num_cross=3, **kw)
    assert (model.cross.low_rank, model.cross.num_experts) == (kw.get("low_rank"), kw.get("num_experts", 1))
    h = model.cross(x0) if model.deep is None else model.deep(model.cross(x0))
    torch.testing.assert_close(model(dense, sparse), model.head(h)[:, 0])


def test_defaults():
    ec = EmbeddingCollection(criteo_tables(16), optimizer=Adagrad(lr=0.1), device="meta")
    model = DCNv2(ec)
    assert model.structure == "stacked" and model.cross.num_layers == 3 and model.cross.low_rank is None
    assert model.cross.W.shape == (3, 13 + 26 * 16, 13 + 26 * 16)
    assert [l.out_features for l in model.deep.modules() if isinstance(l, torch.nn.Linear)] == [512, 256]


def test_bad_configs():
    ec = EmbeddingCollection(MIXED, optimizer=Adagrad(lr=0.1))
    with pytest.raises(ConfigError, match=r"structure must be one of \('stacked', 'parallel'\)"):
        DCNv2(ec, NUM_DENSE, structure="side-by-side")
    with pytest.raises(ConfigError, match="nothing but a linear model"):
        DCNv2(ec, NUM_DENSE, num_cross=0, deep=())
    with pytest.raises(ConfigError, match="needs low_rank"):
        DCNv2(ec, NUM_DENSE, num_experts=2)
    with pytest.raises(ConfigError, match="num_cross"):
        DCNv2(ec, NUM_DENSE, num_cross=-1)
