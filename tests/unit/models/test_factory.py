"""make_model and the table helpers: names, defaults, seeding, and every refusal."""

from __future__ import annotations

import pytest
import torch

from hugeembed import ConfigError
from hugeembed.features import SparseFeatures
from hugeembed.models import (
    CRITEO_SPARSE_FEATURES,
    MODEL_NAMES,
    DCNv2,
    DeepFM,
    DLRM,
    WideAndDeep,
    criteo_tables,
    deepfm_tables,
    embedding_tables,
    first_order_tables,
    make_model,
)
from hugeembed.nn import EmbeddingCollection
from hugeembed.optim import FTRL, SGD, Adagrad, RowWiseAdagrad
from hugeembed.store import TruncatedNormal, Zeros

CLASSES = {"dlrm": DLRM, "deepfm": DeepFM, "widedeep": WideAndDeep, "dcn": DCNv2}


def criteo_batch(B: int = 8, rows: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sparse = SparseFeatures.from_lists({f: [[int(i)] for i in torch.randint(0, rows, (B,), generator=g)]
                                        for f in CRITEO_SPARSE_FEATURES})
    return torch.rand(B, 13, generator=g), sparse


def small(name: str, **kw):
    sizes = {"dlrm": dict(bottom_mlp=(8,), top_mlp=(8,))}.get(name, dict(deep=(8,)))
    return make_model(name, embedding_dim=4, sparse_optimizer=Adagrad(lr=0.1), **(sizes | kw))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_each_name_builds_its_model_with_criteo_tables(name):
    model, dense_params = small(name)
    assert type(model) is CLASSES[name]
    assert [id(p) for p in dense_params] == [id(p) for p in model.dense_parameters()]
    assert model.embeddings.feature_names() == list(CRITEO_SPARSE_FEATURES)
    assert all(t.is_dynamic for t in model.embeddings.tables)
    dense, sparse = criteo_batch()
    assert model(dense, sparse).shape == (8,)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_seed_fixes_the_model_and_spares_the_global_rng(name):
    dense, sparse = criteo_batch()
    state = torch.random.get_rng_state()
    a, _ = small(name, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    b, _ = small(name, seed=3)
    c, _ = small(name, seed=4)
    logits = []
    for model in (a, b, c):
        torch.manual_seed(0)  # the same dropout masks (DeepFM's default dropout is 0.5)
        logits.append(model(dense, sparse))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    assert not torch.equal(logits[0], logits[2])


def test_bad_name_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown model 'xdeepfm'; choose one of dlrm, deepfm, widedeep, dcn"):
        make_model("xdeepfm", embedding_dim=4, sparse_optimizer=Adagrad(lr=0.1))


@pytest.mark.parametrize("name,option", [("dlrm", dict(deep=(8,))), ("deepfm", dict(top_mlp=(8,))),
                                         ("widedeep", dict(num_cross=2)), ("dcn", dict(bottom_mlp=(4,))),
                                         ("dcn", dict(first_order_optimizer=SGD(lr=0.1))),
                                         ("deepfm", dict(first_order=True))])
def test_an_option_the_model_does_not_take_is_an_error(name, option):
    with pytest.raises(ConfigError, match=f"model {name!r} does not take {next(iter(option))}"):
        make_model(name, embedding_dim=4, sparse_optimizer=Adagrad(lr=0.1), **option)


def test_table_kind_options_must_agree():
    opt = Adagrad(lr=0.1)
    with pytest.raises(ConfigError, match="dynamic=False"):
        make_model("dlrm", embedding_dim=4, sparse_optimizer=opt, cardinalities=[10] * 26)
    with pytest.raises(ConfigError, match="need cardinalities"):
        make_model("dlrm", embedding_dim=4, sparse_optimizer=opt, dynamic=False)
    with pytest.raises(ConfigError, match="capacity"):
        make_model("dlrm", embedding_dim=4, sparse_optimizer=opt, dynamic=False, cardinalities=[10] * 26,
                   capacity=100)
    with pytest.raises(ConfigError, match="sparse_optimizer"):
        make_model("dlrm", embedding_dim=4, sparse_optimizer=torch.optim.SGD)


def test_static_tables_and_model_options_pass_through():
    model, _ = make_model("dcn", embedding_dim=4, sparse_optimizer=RowWiseAdagrad(lr=0.1), dynamic=False,
                          cardinalities=[50] * 26, num_cross=1, low_rank=2, num_experts=2, structure="parallel",
                          deep=(8,), dropout=0.1)
    assert [t.num_rows for t in model.embeddings.tables] == [50] * 26
    assert (model.cross.num_layers, model.cross.low_rank, model.cross.num_experts, model.structure) == \
        (1, 2, 2, "parallel")
    dense, sparse = criteo_batch(rows=50)
    assert model(dense, sparse).shape == (8,)


def test_first_order_optimizer_and_features():
    model, _ = make_model("widedeep", embedding_dim=4, sparse_optimizer=Adagrad(lr=0.1), deep=(8,),
                          first_order_optimizer=FTRL(lr=0.1), features=("u", "i"), num_dense=0)
    rules = {t.name: r.name for t, r in zip(model.embeddings.tables, model.embeddings.rules)}
    assert rules == {"u": "adagrad", "i": "adagrad", "wide_u": "ftrl", "wide_i": "ftrl"}
    assert model.num_dense == 0


def test_meta_device():
    for name in MODEL_NAMES:
        model, params = make_model(name, embedding_dim=16, sparse_optimizer=Adagrad(lr=0.1), device="meta")
        assert all(p.is_meta for p in params)
        dense, sparse = criteo_batch()
        assert model(dense.to("meta"), sparse).shape == (8,)


# -- table helpers ------------------------------------------------------------------------


def test_criteo_tables():
    tables = criteo_tables(16, combiner="mean", optimizer=SGD(lr=0.1), capacity=1000)
    assert [t.name for t in tables] == [f"C{i}" for i in range(1, 27)]
    assert all(t.dim == 16 and t.features == (t.name,) and t.is_dynamic and t.capacity == 1000 and
               t.combiner.value == "mean" and t.optimizer == SGD(lr=0.1) for t in tables)
    static = criteo_tables(8, cardinalities=range(1, 27), capacity=1000)
    assert [t.num_rows for t in static] == list(range(1, 27)) and all(t.capacity is None for t in static)
    with pytest.raises(ConfigError, match="one row count per feature"):
        criteo_tables(8, cardinalities=[10] * 25)


def test_deepfm_tables_output_names_and_initializers():
    tables = deepfm_tables(("x", "y"), 6, first_order_optimizer=FTRL(lr=0.1))
    ec = EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1))
    assert ec.output_keys() == ["x@x", "y@y", "x@wide_x", "y@wide_y"]
    assert [t.dim for t in tables] == [6, 6, 1, 1]
    assert tables[0].initializer == TruncatedNormal(0.0, 0.01) and tables[2].initializer == Zeros()
    assert tables[2].optimizer == FTRL(lr=0.1) and tables[0].optimizer is None


def test_table_helper_errors():
    with pytest.raises(ConfigError, match="at least one feature"):
        embedding_tables((), 4)
    with pytest.raises(ConfigError, match=r"no entry for features \['b'\]"):
        first_order_tables(("a", "b"), cardinalities={"a": 3})
    assert [t.num_rows for t in first_order_tables("a", cardinalities={"a": 3})] == [3]


def test_dlrm_first_order_optimizer_needs_first_order():
    with pytest.raises(ConfigError, match="first_order_optimizer only with first_order=True"):
        make_model("dlrm", embedding_dim=4, sparse_optimizer=Adagrad(lr=0.1), first_order_optimizer=SGD(lr=0.1))
    model, _ = make_model("dlrm", embedding_dim=4, sparse_optimizer=Adagrad(lr=0.1), features=("a", "b"), num_dense=2,
                          first_order=True, first_order_optimizer=SGD(lr=0.1))
    assert [(t.name, t.dim) for t in model.embeddings.tables] == [("a", 4), ("b", 4), ("wide_a", 1), ("wide_b", 1)]
    assert [r.name for r in model.embeddings.rules][2:] == ["sgd", "sgd"]
