"""Wide & Deep: logit = (bias + <w, dense> + sum of wide weights) + MLP([dense, embeddings])."""

from __future__ import annotations

import pytest
import torch

from hugeembed import ConfigError
from hugeembed.features import SparseFeatures
from hugeembed.models import CRITEO_SPARSE_FEATURES, WIDE_AND_DEEP_PAPER_DEEP, WideAndDeep, wide_and_deep_tables
from hugeembed.nn import EmbeddingCollection
from hugeembed.optim import FTRL, Adagrad

from .helpers import FEATURES, NUM_DENSE, make_batch, train


def with_cross_feature(dense, sparse):
    """Adds a cross-product feature "a_x_b" (the paper's wide-only crosses) to the batch."""
    a, b = sparse["a"], sparse["b"]
    rows = []
    for i in range(sparse.batch_size):
        ids_a = a.values[a.offsets[i] : a.offsets[i + 1]].tolist()
        ids_b = b.values[b.offsets[i] : b.offsets[i + 1]].tolist()
        rows.append([x * 1000 + y for x in ids_a for y in ids_b])
    lists = {f: [sparse[f].values[sparse[f].offsets[i] : sparse[f].offsets[i + 1]].tolist()
                 for i in range(sparse.batch_size)] for f in FEATURES}
    return dense, SparseFeatures.from_lists(lists | {"a_x_b": rows})


def test_logit_is_wide_plus_deep_with_a_wide_only_cross_feature():
    tables = wide_and_deep_tables(FEATURES, 3, wide_features=FEATURES + ("a_x_b",),
                                  first_order_optimizer=FTRL(lr=0.1))
    ec = EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1))
    model = WideAndDeep(ec, NUM_DENSE, deep=(8, 4))
    assert model.wide_fields.names == ("a@wide_a", "b@wide_b", "c@wide_c", "a_x_b")
    assert model.fields.names == ("a@a", "b@b", "c@c")
    dense, sparse, labels = make_batch(B=8)
    dense, sparse = with_cross_feature(dense, sparse)
    train(model, model.dense_parameters(), dense, sparse, labels, steps=3)
    model.eval()
    out = ec(sparse)
    wide = model.bias + dense @ model.dense_linear.weight[0] + sum(out[n][:, 0] for n in model.wide_fields.names)
    deep = model.deep_out(model.deep(torch.cat([dense] + [out[f"{f}@{f}"] for f in FEATURES], dim=1)))[:, 0]
    torch.testing.assert_close(model(dense, sparse), wide + deep)
    assert float(out["a_x_b"].abs().sum()) > 0  # the cross feature's weights trained (FTRL)


def test_deep_part_takes_mixed_dims():
    tables = wide_and_deep_tables(("a",), 2) + wide_and_deep_tables(("b", "c"), 5)
    model = WideAndDeep(EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1)), NUM_DENSE, deep=(8,))
    assert model.deep.in_features == NUM_DENSE + 2 + 5 + 5
    dense, sparse, _ = make_batch(B=4)
    assert model(dense, sparse).shape == (4,)


def test_defaults_and_paper_alternative():
    ec = EmbeddingCollection(wide_and_deep_tables(CRITEO_SPARSE_FEATURES, 32), optimizer=Adagrad(lr=0.1),
                             device="meta")
    small = WideAndDeep(ec)
    sizes = lambda m: [l.out_features for l in m.deep.modules() if isinstance(l, torch.nn.Linear)]
    assert sizes(small) == [256, 128] and small.deep.in_features == 13 + 26 * 32
    assert sizes(WideAndDeep(ec, deep=WIDE_AND_DEEP_PAPER_DEEP)) == [1024, 512, 256]
    assert not any(isinstance(m, torch.nn.Dropout) for m in small.modules())


def test_bad_configs():
    ec = EmbeddingCollection(wide_and_deep_tables(FEATURES, 3), optimizer=Adagrad(lr=0.1))
    with pytest.raises(ConfigError, match="deep"):
        WideAndDeep(ec, NUM_DENSE, deep=())
    with pytest.raises(ConfigError, match=r"\['wide_z'\] are not in the collection"):
        WideAndDeep(ec, NUM_DENSE, wide=["wide_z"])
    with pytest.raises(ConfigError, match="no entry for features"):
        wide_and_deep_tables(FEATURES, 3, wide_features=("a", "zz"), cardinalities=[10, 10, 10])
