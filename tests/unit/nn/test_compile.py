"""torch.compile and torch.export of models holding an EmbeddingCollection (nn/_ops.py): the lookup
is one custom op in the graph, so a whole model compiles with fullgraph=True and trains exactly as
eager does (oracle: the same model run eagerly from the same seed)."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from hugeembed.errors import InputError
from hugeembed.features import SparseFeatures
from hugeembed.models import make_model
from hugeembed.nn import EmbeddingCollection, TableConfig, _ops
from hugeembed.optim import Adagrad, Adam

FEATURES = ("a", "b", "c")
B = 16


def build(dynamic: bool, backend: str, rule, device=torch.device("cpu")):
    model, dense = make_model("dlrm", embedding_dim=8, sparse_optimizer=rule, seed=1, features=FEATURES, num_dense=3,
                              bottom_mlp=(8,), top_mlp=(8,), backend=backend, dynamic=dynamic,
                              cardinalities=None if dynamic else [50] * len(FEATURES), device=device)
    return model, torch.optim.SGD(dense, lr=0.1)


def batch(i: int, batch_size: int = B, device=torch.device("cpu")):
    g = torch.Generator().manual_seed(i)  # drawn on the CPU (the same batches on every device), then moved
    n = len(FEATURES) * batch_size
    sf = SparseFeatures(FEATURES, torch.randint(0, 50, (n,), generator=g), offsets=torch.arange(n + 1),
                        batch_size=batch_size)
    d, y = torch.randn(batch_size, 3, generator=g), torch.randint(0, 2, (batch_size,), generator=g).float()
    return d.to(device), sf.to(device), y.to(device)


def device_of(model) -> torch.device:
    return model.embeddings.device


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical on the CPU.  On CUDA, float tensors to float32 rounding: the row gradients are
    summed by atomic adds in no fixed order, so two runs of the same ops differ in the last bits."""
    if a.device.type == "cpu" or not a.dtype.is_floating_point:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def train(model, opt, steps, batch_sizes=None):
    losses = []
    for i in range(steps):
        d, sf, y = batch(i, (batch_sizes or [B] * steps)[i], device_of(model))
        loss = F.binary_cross_entropy_with_logits(model(d, sf), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def tables_of(model):
    return {c.name: s.export() for c, s in model.embeddings.stores()}


@pytest.mark.slow
@pytest.mark.parametrize("dynamic,backend,rule", [(True, "auto", Adagrad(lr=0.05)), (False, "torch", Adam(lr=0.01))],
                         ids=["dynamic-native-adagrad", "static-torch-adam"])
def test_compiled_training_equals_eager_bit_for_bit(dynamic, backend, rule, device):
    """aot_eager runs the traced aten ops as they are: any difference would come from the op path
    (on CUDA, "auto" is the torch twin, and floats match to rounding: see same())."""
    eager, eager_opt = build(dynamic, backend, rule, device)
    want = train(eager, eager_opt, 4, [B, B, B, 5])  # a smaller last batch: recompiles, same numbers
    model, opt = build(dynamic, backend, rule, device)
    torch._dynamo.reset()
    got = train(torch.compile(model, fullgraph=True, backend="aot_eager"), opt, 4, [B, B, B, 5])
    same(got, want)
    assert model.embeddings.step == eager.embeddings.step == 4
    for name, e in tables_of(eager).items():
        c = tables_of(model)[name]
        for field in e.__dataclass_fields__:
            a, b = getattr(c, field), getattr(e, field)
            if a.device.type == "cpu" or not a.dtype.is_floating_point:
                assert torch.equal(a, b), (name, field)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {field}: {m}")
    assert not _ops._runs  # every lookup's state was applied and dropped


@pytest.mark.slow
def test_inductor_compiled_training_matches_eager(device):
    """Inductor fuses the dense part's float ops differently: equal to float tolerance, same rows touched.
    (On CUDA inductor generates triton kernels.)"""
    eager, eager_opt = build(True, "auto", Adagrad(lr=0.05), device)
    want = train(eager, eager_opt, 3)
    model, opt = build(True, "auto", Adagrad(lr=0.05), device)
    torch._dynamo.reset()
    got = train(torch.compile(model, fullgraph=True), opt, 3)
    atol = 1e-6 if device.type == "cpu" else 1e-5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    for name, e in tables_of(eager).items():
        c = tables_of(model)[name]
        assert torch.equal(c.keys, e.keys) and torch.equal(c.counts, e.counts), name
        torch.testing.assert_close(c.rows, e.rows, rtol=1e-5, atol=atol)


def test_the_graph_holds_one_lookup_op_whatever_the_number_of_tables(device):
    seen = []

    def backend(gm, inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    names = [f"f{t}" for t in range(12)]
    ec = EmbeddingCollection([TableConfig(n, 4) for n in names], optimizer=Adagrad(lr=0.1), device=device)
    sf = SparseFeatures(names, torch.arange(12 * 4) % 7, offsets=torch.arange(12 * 4 + 1), batch_size=4).to(device)
    torch._dynamo.reset()
    out = torch.compile(lambda s: ec(s).stacked().sum(), fullgraph=True, backend=backend)(sf)
    out.backward()
    assert len(seen) == 1
    assert seen[0].count(torch.ops.hugeembed.collection_lookup.default) == 1
    assert ec.step == 1 and not _ops._runs


def test_export_of_an_eval_model_equals_eager(device):
    model, opt = build(True, "auto", Adagrad(lr=0.05), device)
    train(model, opt, 2)
    model.eval()
    d, sf, _ = batch(7, device=device)
    with torch.no_grad():
        want = model(d, sf)
    ep = torch.export.export(model, (d, sf))
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.hugeembed.collection_lookup.default) == 1
    same(ep.module()(d, sf), want)
    assert model.embeddings.step == 2  # eval: nothing inserted, no step


def test_a_training_graph_dropped_without_backward_releases_its_rows(device):
    model, _ = build(True, "auto", Adagrad(lr=0.05), device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    d, sf, _ = batch(0, device=device)
    out = compiled(d, sf)
    assert len(_ops._runs) == 1
    del out
    gc.collect()
    assert not _ops._runs
    assert model.embeddings.applied_step() == 1  # nothing left in flight


def test_sequence_features_inside_compile_are_refused_by_name():
    ec = EmbeddingCollection([TableConfig("hist", 4, combiner=None)], optimizer=Adagrad(lr=0.1))
    sf = SparseFeatures(["hist"], torch.arange(6), offsets=torch.tensor([0, 2, 6]), batch_size=2)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="'hist'.*sequence .unpooled. features"):
        torch.compile(lambda s: ec(s).unpooled["hist"].values.sum(), fullgraph=True, backend="aot_eager")(sf)


def test_an_op_naming_a_dead_collection_says_so():
    with pytest.raises(InputError, match="no longer exists"):
        _ops._collection(10**9)


def test_weights_that_require_grad_inside_compile_are_refused():
    """The op computes no gradient for per-id weights: refused, never silently dropped."""
    ec = EmbeddingCollection([TableConfig("a", 4, combiner="sum")], optimizer=Adagrad(lr=0.1))
    w = torch.ones(4, requires_grad=True)
    sf = SparseFeatures(["a"], torch.arange(4), offsets=torch.arange(5), weights=w, batch_size=4)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="per-id weights that require grad"):
        torch.compile(lambda s: ec(s).stacked().sum(), fullgraph=True, backend="aot_eager")(sf)
    assert ec.step == 0
