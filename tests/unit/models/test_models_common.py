"""What every model does: shapes on each device and on meta, training, input checks, state_dict."""

from __future__ import annotations

import pytest
import torch

from hugeembed import ConfigError, InputError
from hugeembed.models import DCNv2, DLRM, DeepFM, WideAndDeep, deepfm_tables, embedding_tables, \
    wide_and_deep_tables
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adagrad

from .helpers import FEATURES, NUM_DENSE, make_batch, table_rows, train

DIM = 4


def build(name: str, device="cpu", seed: int = 0):
    """A small model of each kind (dropout off, so a fixed batch gives a smooth loss)."""
    torch.manual_seed(seed)
    opt = Adagrad(lr=0.1)
    if name == "dlrm":
        ec = EmbeddingCollection(embedding_tables(FEATURES, DIM), optimizer=opt, device=device, seed=seed)
        return DLRM(ec, NUM_DENSE, bottom_mlp=(16,), top_mlp=(16, 8))
    if name == "deepfm":
        ec = EmbeddingCollection(deepfm_tables(FEATURES, DIM), optimizer=opt, device=device, seed=seed)
        return DeepFM(ec, NUM_DENSE, deep=(16, 16), dropout=0.0)
    if name == "widedeep":
        ec = EmbeddingCollection(wide_and_deep_tables(FEATURES, DIM), optimizer=opt, device=device, seed=seed)
        return WideAndDeep(ec, NUM_DENSE, deep=(16, 8))
    ec = EmbeddingCollection(embedding_tables(FEATURES, DIM), optimizer=opt, device=device, seed=seed)
    return DCNv2(ec, NUM_DENSE, num_cross=2, deep=(16, 8))


NAMES = ["dlrm", "deepfm", "widedeep", "dcn"]
CLASSES = {"dlrm": DLRM, "deepfm": DeepFM, "widedeep": WideAndDeep, "dcn": DCNv2}


@pytest.mark.parametrize("name", NAMES)
def test_forward_gives_one_logit_per_sample(name, device):
    model = build(name, device)
    dense, sparse, _ = make_batch(B=16, device=device)
    logits = model(dense, sparse)
    assert logits.shape == (16,) and logits.dtype == torch.float32 and logits.device.type == device.type
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", NAMES)
def test_default_architecture_on_meta_device(name):
    """Published defaults, shapes only: nothing is allocated or initialised."""
    tables = {"dlrm": embedding_tables(FEATURES, 16), "deepfm": deepfm_tables(FEATURES, 16),
              "widedeep": wide_and_deep_tables(FEATURES, 16), "dcn": embedding_tables(FEATURES, 16)}[name]
    ec = EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1), device="meta")
    model = CLASSES[name](ec, NUM_DENSE)
    assert all(p.is_meta for p in model.dense_parameters())
    dense, sparse, _ = make_batch(B=9)
    logits = model(dense.to("meta"), sparse)
    assert logits.shape == (9,) and logits.is_meta


@pytest.mark.parametrize("name", NAMES)
def test_training_steps_lower_the_loss_and_update_tables_and_dense_layers(name, device):
    model = build(name, device)
    dense, sparse, labels = make_batch(B=32, device=device, seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = sorted(set(sparse["b"].values.tolist()))
    losses = train(model, model.dense_parameters(), dense, sparse, labels, steps=20)
    assert losses[-1] < 0.75 * losses[0], losses
    rows_after = table_rows(model.embeddings, "b", seen)
    model.embeddings.train()
    # one more training step moves the tables (sparse optimizer in backward) ...
    torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels).backward()
    assert not torch.equal(table_rows(model.embeddings, "b", seen), rows_after)
    # ... and torch.optim moved every dense parameter
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n


@pytest.mark.parametrize("name", NAMES)
def test_dense_parameters_are_all_parameters_and_no_table(name):
    model = build(name)
    params = model.dense_parameters()
    assert len({id(p) for p in params}) == len(params) == len(list(model.parameters()))
    assert not list(model.embeddings.parameters())  # tables are not torch Parameters


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_gives_the_same_logits(name):
    model = build(name, seed=0)
    dense, sparse, labels = make_batch(B=8)
    train(model, model.dense_parameters(), dense, sparse, labels, steps=2)
    model.eval()
    other = build(name, seed=5)
    other.load_state_dict(model.state_dict())
    other.eval()
    torch.testing.assert_close(other(dense, sparse), model(dense, sparse))


@pytest.mark.parametrize("name", NAMES)
def test_input_errors_name_the_problem(name):
    model = build(name)
    dense, sparse, _ = make_batch(B=8)
    with pytest.raises(InputError, match=rf"\[B, {NUM_DENSE}\]"):
        model(dense[:, :2], sparse)
    with pytest.raises(InputError, match="dense has 16 samples but the sparse batch has 8"):
        model(torch.cat([dense, dense]), sparse)
    with pytest.raises(InputError, match="floating point"):
        model(dense.long(), sparse)
    with pytest.raises(InputError, match="SparseFeatures"):
        model(dense, {"a": [[1]]})


@pytest.mark.parametrize("name", NAMES)
def test_config_errors(name):
    cls = CLASSES[name]
    with pytest.raises(ConfigError, match="EmbeddingCollection"):
        cls(torch.nn.Linear(2, 2), NUM_DENSE)
    seq = EmbeddingCollection([TableConfig("a", DIM, combiner="none"), TableConfig("b", DIM, combiner="sum")],
                              optimizer=Adagrad(lr=0.1))
    with pytest.raises(ConfigError, match=r"\['a'\] have combiner 'none'"):
        cls(seq, NUM_DENSE)
    with pytest.raises(ConfigError, match="num_dense"):
        cls(build(name).embeddings, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tables_feed_float32_layers(dtype):
    tables = [TableConfig(f, DIM, dtype=dtype, combiner="sum") for f in FEATURES]
    ec = EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1))
    model = DLRM(ec, NUM_DENSE, bottom_mlp=(8,), top_mlp=(8,))
    dense, sparse, labels = make_batch(B=8)
    assert ec(sparse).stacked().dtype == dtype
    losses = train(model, model.dense_parameters(), dense, sparse, labels, steps=3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert model(dense, sparse).dtype == torch.float32
