"""DLRM: the composition bottom -> dot interaction -> top, the published layer sizes, dim checks."""

from __future__ import annotations

import pytest
import torch

from hugeembed import ConfigError, SparseFeatures
from hugeembed.models import DLRM, criteo_tables, embedding_tables, first_order_tables
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adagrad

from .helpers import FEATURES, NUM_DENSE, make_batch, train


def linear_sizes(module):
    return [(m.in_features, m.out_features) for m in module.modules() if isinstance(m, torch.nn.Linear)]


def test_forward_is_top_of_dense_and_pairwise_dots():
    D = 4
    ec = EmbeddingCollection(embedding_tables(FEATURES, D), optimizer=Adagrad(lr=0.1))
    model = DLRM(ec, NUM_DENSE, bottom_mlp=(8,), top_mlp=(8,))
    dense, sparse, labels = make_batch(B=6)
    train(model, model.dense_parameters(), dense, sparse, labels, steps=2)  # rows exist, weights moved
    model.eval()
    out = ec(sparse)
    d = model.bottom(dense)
    vectors = [d] + [out[f] for f in FEATURES]  # the bottom output first, then features in table order
    dots = [(vectors[i] * vectors[j]).sum(dim=1) for i in range(4) for j in range(i + 1, 4)]
    want = model.top(torch.cat([d, torch.stack(dots, dim=1)], dim=1)).squeeze(1)
    torch.testing.assert_close(model(dense, sparse), want)
    assert (d >= 0).all()  # ReLU after the bottom MLP's last layer too


def test_published_criteo_layer_sizes():
    """TorchRec's DLRM example: bottom 13-512-256-D, top 512-512-256-1 over D + 27*26/2 inputs."""
    D = 64
    ec = EmbeddingCollection(criteo_tables(D), optimizer=Adagrad(lr=0.1), device="meta")
    model = DLRM(ec)
    assert linear_sizes(model.bottom) == [(13, 512), (512, 256), (256, D)]
    assert linear_sizes(model.top) == [(D + 351, 512), (512, 512), (512, 256), (256, 1)]
    assert sum(p.numel() for p in model.dense_parameters()) == sum(i * o + o for i, o in
                                                                   linear_sizes(model))


def test_self_interaction_widens_the_top():
    ec = EmbeddingCollection(embedding_tables(FEATURES, 4), optimizer=Adagrad(lr=0.1), device="meta")
    model = DLRM(ec, NUM_DENSE, self_interaction=True)
    assert linear_sizes(model.top)[0][0] == 4 + 10  # 4 vectors: 6 pairs + 4 squares


def test_mixed_dims_name_each_table_and_dim():
    ec = EmbeddingCollection([TableConfig("user", 8), TableConfig("item", 8), TableConfig("country", 4)],
                             optimizer=Adagrad(lr=0.1))
    with pytest.raises(ConfigError, match=r"one embedding dim.*'user': 8, 'item': 8, 'country': 4"):
        DLRM(ec, NUM_DENSE)


def test_without_dense_features_the_dense_field_is_a_learned_vector():
    ec = EmbeddingCollection(embedding_tables(FEATURES, 4), optimizer=Adagrad(lr=0.1))
    model = DLRM(ec, 0)
    sparse = SparseFeatures.from_lists({f: [[1], [2, 3], []] for f in FEATURES})
    logits = model(torch.zeros(3, 0), sparse)
    logits.sum().backward()
    assert logits.shape == (3,) and model.bottom.vector.grad is not None
    # the interaction reads the vector as its dense field: the same for every sample
    d = model.bottom(torch.zeros(3, 0))
    assert torch.equal(d[0], model.bottom.vector.detach()) and torch.equal(d[0], d[2])


def test_valid_mlps():
    ec = EmbeddingCollection(embedding_tables(FEATURES, 4), optimizer=Adagrad(lr=0.1))
    with pytest.raises(ConfigError, match="bottom_mlp"):
        DLRM(ec, NUM_DENSE, bottom_mlp=(8, -1))
    with pytest.raises(ConfigError, match="top_mlp"):
        DLRM(ec, NUM_DENSE, top_mlp="512")


def test_shared_table_outputs_are_fields_too():
    """One table read by two features gives two fields of the interaction."""
    ec = EmbeddingCollection([TableConfig("ids", 4, features=("a", "b")), TableConfig("c", 4)],
                             optimizer=Adagrad(lr=0.1))
    model = DLRM(ec, NUM_DENSE, bottom_mlp=(8,), top_mlp=(8,))
    assert model.fields.names == ("a", "b", "c") and model.interaction.num_pairs == 6
    dense, sparse, _ = make_batch(B=5)
    assert model(dense, sparse).shape == (5,)


def test_first_order_tables_add_a_per_id_bias_to_the_logit():
    """logit = DLRM over the embedding tables only + the sum of the dim-1 tables' pooled weights."""
    D = 4
    ec = EmbeddingCollection(embedding_tables(FEATURES, D) + first_order_tables(FEATURES), optimizer=Adagrad(lr=0.1))
    model = DLRM(ec, NUM_DENSE, bottom_mlp=(8,), top_mlp=(8,), first_order=[f"wide_{f}" for f in FEATURES])
    dense, sparse, labels = make_batch(B=6)
    train(model, model.dense_parameters(), dense, sparse, labels, steps=3)
    model.eval()
    assert linear_sizes(model.top)[0] == (D + 6, 8)  # the interaction reads the 3 embedding tables only
    out = ec(sparse)
    bias = sum(out[f"{f}@wide_{f}"][:, 0] for f in FEATURES)
    assert float(bias.abs().sum()) > 0  # the weights moved from their zeros
    d = model.bottom(dense)
    vectors = [d] + [out[f"{f}@{f}"] for f in FEATURES]
    dots = [(vectors[i] * vectors[j]).sum(dim=1) for i in range(4) for j in range(i + 1, 4)]
    want = model.top(torch.cat([d, torch.stack(dots, dim=1)], dim=1)).squeeze(1) + bias
    torch.testing.assert_close(model(dense, sparse), want)


def test_first_order_names_dim_1_tables():
    ec = EmbeddingCollection(embedding_tables(FEATURES, 4), optimizer=Adagrad(lr=0.1), device="meta")
    with pytest.raises(ConfigError, match="dim 1"):
        DLRM(ec, NUM_DENSE, first_order=["a"])
    with pytest.raises(ConfigError, match="not in the collection"):
        DLRM(ec, NUM_DENSE, first_order=["wide_a"])


def test_dropout_after_each_hidden_layer_of_the_top_mlp_only():
    """Training: each hidden activation of the top MLP is zeroed or scaled by 1 / (1 - p) (the plain recomputation
    below, with the masks the dropout drew); eval: the model without dropout."""
    D, p = 4, 0.5
    ec = EmbeddingCollection(embedding_tables(FEATURES, D), optimizer=Adagrad(lr=0.1))
    model = DLRM(ec, NUM_DENSE, bottom_mlp=(8,), top_mlp=(8, 6), dropout=p)
    dense, sparse, _ = make_batch(B=6)
    drops = [m for m in model.top.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(drops) == 2 and not any(isinstance(m, torch.nn.Dropout) for m in model.bottom.modules())
    masks = []
    for m in drops:
        m.register_forward_hook(lambda mod, args, y: masks.append(y != 0))
    out = ec(sparse)
    x = model.interaction(model.bottom(dense), torch.stack([out[f] for f in FEATURES], dim=1))
    lin = [m for m in model.top.modules() if isinstance(m, torch.nn.Linear)]
    got = model.forward_pooled(dense, out)
    h, positive, dropped = x, 0, 0
    for layer, mask in zip(lin[:-1], masks):
        h = torch.relu(layer(h))
        positive, dropped = positive + int((h > 0).sum()), dropped + int(((h > 0) & ~mask).sum())
        h = h * mask / (1 - p)
    torch.testing.assert_close(got, lin[-1](h).squeeze(1))
    assert 0.2 < dropped / positive < 0.8  # about half the live activations dropped
    model.eval()
    h = x
    for layer in lin[:-1]:
        h = torch.relu(layer(h))
    torch.testing.assert_close(model.forward_pooled(dense, out), lin[-1](h).squeeze(1))


@pytest.mark.parametrize("p", [1.0, -0.1, "0.2", True])
def test_bad_dropout_is_refused(p):
    ec = EmbeddingCollection(embedding_tables(FEATURES, 4), optimizer=Adagrad(lr=0.1), device="meta")
    with pytest.raises(ConfigError, match="DLRM: dropout must be a float in"):
        DLRM(ec, NUM_DENSE, dropout=p)
