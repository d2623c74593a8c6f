"""DeepFM: logit = first order + FM over pairs of fields + MLP, written out term by term."""

from __future__ import annotations

import pytest
import torch

from hugeembed import ConfigError
from hugeembed.features import SparseFeatures
from hugeembed.models import CRITEO_SPARSE_FEATURES, DeepFM, deepfm_tables, embedding_tables, first_order_tables
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD, Adagrad

from .helpers import FEATURES, NUM_DENSE, make_batch, train


def pairs_sum(fields):
    """sum over i < j of <v_i, v_j>, one dot product at a time."""
    total = torch.zeros(fields[0].shape[0])
    for i in range(len(fields)):
        for j in range(i + 1, len(fields)):
            total = total + (fields[i] * fields[j]).sum(dim=1)
    return total


def trained(dense_fields: bool, first_order=None, tables=None):
    ec = EmbeddingCollection(tables or deepfm_tables(FEATURES, 3), optimizer=Adagrad(lr=0.1))
    model = DeepFM(ec, NUM_DENSE, deep=(8, 8), dropout=0.0, dense_fields=dense_fields, first_order=first_order)
    dense, sparse, labels = make_batch(B=6)
    train(model, model.dense_parameters(), dense, sparse, labels, steps=3)  # non-zero first-order weights
    model.eval()
    return model, dense, sparse


@pytest.mark.parametrize("dense_fields", [True, False])
def test_logit_is_first_order_plus_fm_plus_deep(dense_fields):
    model, dense, sparse = trained(dense_fields)
    out = model.embeddings(sparse)
    first = model.bias + dense @ model.dense_linear.weight[0] + sum(out[f"{f}@wide_{f}"][:, 0] for f in FEATURES)
    v = [out[f"{f}@{f}"] for f in FEATURES]
    if dense_fields:  # each dense value scales its own learned vector: one more field per dense feature
        v = [dense[:, k : k + 1] * model.dense_embedding[k] for k in range(NUM_DENSE)] + v
        deep_in = torch.cat(v, dim=1)
    else:
        deep_in = torch.cat([dense] + v, dim=1)
    deep = model.deep_out(model.deep(deep_in))[:, 0]
    torch.testing.assert_close(model(dense, sparse), first + pairs_sum(v) + deep)
    assert float(sum(out[f"{f}@wide_{f}"].abs().sum() for f in FEATURES)) > 0


def test_no_first_order_tables():
    model, dense, sparse = trained(True, first_order=(), tables=embedding_tables(FEATURES, 3))
    assert len(model.first_order) == 0 and len(model.fields) == 3
    out = model.embeddings(sparse)
    v = [dense[:, k : k + 1] * model.dense_embedding[k] for k in range(NUM_DENSE)] + [out[f] for f in FEATURES]
    first = model.bias + dense @ model.dense_linear.weight[0]
    deep = model.deep_out(model.deep(torch.cat(v, dim=1)))[:, 0]
    torch.testing.assert_close(model(dense, sparse), first + pairs_sum(v) + deep)


def test_sparse_only_data():
    ec = EmbeddingCollection(deepfm_tables(FEATURES, 3), optimizer=Adagrad(lr=0.1))
    model = DeepFM(ec, 0, deep=(8,))
    assert model.dense_linear is None and model.dense_embedding is None
    _, sparse, _ = make_batch(B=5)
    assert model(torch.empty(5, 0), sparse).shape == (5,)


def test_paper_defaults():
    ec = EmbeddingCollection(deepfm_tables(CRITEO_SPARSE_FEATURES, 10), optimizer=Adagrad(lr=0.1), device="meta")
    model = DeepFM(ec)
    linears = [(m.in_features, m.out_features) for m in model.deep.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == [((13 + 26) * 10, 400), (400, 400), (400, 400)]
    assert [m.p for m in model.deep.modules() if isinstance(m, torch.nn.Dropout)] == [0.5, 0.5, 0.5]
    assert len(model.first_order) == 26 and model.first_order.names[0] == "C1@wide_C1"


def test_explicit_first_order_tables_and_their_checks():
    tables = embedding_tables(FEATURES, 3) + first_order_tables(FEATURES, optimizer=SGD(lr=0.1), prefix="lin_")
    ec = EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1))
    model = DeepFM(ec, NUM_DENSE, first_order=[f"lin_{f}" for f in FEATURES], deep=(4,))
    assert model.first_order.names == ("a@lin_a", "b@lin_b", "c@lin_c")
    with pytest.raises(ConfigError, match=r"\['nope'\] are not in the collection"):
        DeepFM(ec, NUM_DENSE, first_order=["nope"])
    with pytest.raises(ConfigError, match=r"dim 1.*\{'a': 3\}"):
        DeepFM(ec, NUM_DENSE, first_order=["a"])


def test_fm_needs_one_dim_and_some_embedding_tables():
    mixed = [TableConfig("a", 3), TableConfig("b", 5), TableConfig("wide_a", 1, features=("a",))]
    with pytest.raises(ConfigError, match=r"FM term.*'a': 3, 'b': 5"):
        DeepFM(EmbeddingCollection(mixed, optimizer=Adagrad(lr=0.1)), NUM_DENSE)
    only_wide = first_order_tables(FEATURES)
    with pytest.raises(ConfigError, match="every table is a first-order"):
        DeepFM(EmbeddingCollection(only_wide, optimizer=Adagrad(lr=0.1)), NUM_DENSE)
    with pytest.raises(ConfigError, match="dropout"):
        DeepFM(EmbeddingCollection(deepfm_tables(FEATURES, 3), optimizer=Adagrad(lr=0.1)), NUM_DENSE, dropout=1.5)


def test_initial_fm_term_is_small():
    """deepfm_tables starts the embeddings small, so the FM sum does not swamp the first logits."""
    ec = EmbeddingCollection(deepfm_tables(CRITEO_SPARSE_FEATURES, 16), optimizer=Adagrad(lr=0.1))
    model = DeepFM(ec)
    g = torch.Generator().manual_seed(0)
    sparse = SparseFeatures.from_lists({f: [[int(i)] for i in torch.randint(0, 10**6, (64,), generator=g)]
                                        for f in CRITEO_SPARSE_FEATURES})
    out = ec(sparse)  # training mode: rows are created with their initial values
    v = torch.stack([out[f"{f}@{f}"] for f in CRITEO_SPARSE_FEATURES], dim=1).detach()
    assert float(v.abs().max()) > 0
    fm = model.fm(v)
    # TF's default std 1/sqrt(D) would give an FM term of order sqrt(26 * 25 / 2 / D) ~ 4.5
    assert 0 < float(fm.abs().max()) < 0.05
