"""The triton fused pooled forward (hugeembed/_triton/pooled.py) under the interpreter, against the torch
reference, TF's semantics written in NumPy (tests/unit/functional/tf_oracle.py) and F.embedding_bag."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from hugeembed import _triton
from hugeembed.errors import ConfigError, InputError
from hugeembed.features import SparseFeatures
from hugeembed.functional import FeatureSpec, FusedEmbeddingLookup, TableSpec, safe_embedding_lookup_sparse
from hugeembed.functional import _lookup_run, _triton_stages
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD

from tests.unit.functional.test_bad_input import BAD_OFFSETS, _entry_points
from tests.unit.functional.tf_oracle import safe_lookup

# CPU tensors under the interpreter (TRITON_INTERPRET=1, tests/conftest.py, without CUDA), CUDA tensors on a GPU
TRITON_DEVICES = [d for d in ("cpu", "cuda") if (d == "cpu" or torch.cuda.is_available())
                  and _triton_stages.triton_runs_on(torch.device(d))]
pytestmark = [pytest.mark.triton, pytest.mark.skipif(not TRITON_DEVICES, reason="triton runs on no device here")]
interpreter_only = pytest.mark.skipif("cpu" not in TRITON_DEVICES, reason="CPU batches: under the interpreter")

WEIGHTS = [0.0, -1.0, 0.5, 1.0, 2.0, 3.25]
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def tol(dtype: torch.dtype, device: str) -> dict:
    """On CUDA the torch reference sums with atomics, in no fixed order: float32 to 1e-5 there."""
    return TOL[dtype] if device == "cpu" or dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)


@st.composite
def cases(draw):
    """Tiny batches of 1-3 pooled features over one table each (tables as separate tensors, or as views
    of one storage with rows wider than D), every TF rule drawn."""
    rows, D, n, B = draw(st.integers(1, 5)), draw(st.sampled_from([1, 3, 5])), draw(st.integers(1, 3)), \
        draw(st.integers(0, 4))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    weighted = draw(st.booleans())
    max_norm = draw(st.sampled_from([None, 0.7]))
    feats, bags = [], []
    for k in range(n):
        default_id = draw(st.one_of(st.none(), st.integers(0, rows - 1)))
        policy = draw(st.sampled_from(["prune", "default"] if default_id is not None else ["prune"]))
        feats.append(FeatureSpec(f"f{k}", f"t{k}", combiner=draw(st.sampled_from(["sum", "mean", "sqrtn"])),
                                 default_id=default_id, out_of_range=policy, prune_negative=draw(st.booleans())))
        weight = st.sampled_from(WEIGHTS) if weighted else st.just(1.0)
        bags.append(draw(st.lists(st.lists(st.tuples(st.integers(-2, rows + 1), weight), max_size=4),
                                  min_size=B, max_size=B)))
    shared = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if shared:  # a group's rows: the tables one after another, 2 columns of optimizer state beside each row
        big = torch.randn(n * rows, D + 2, generator=g).to(dtype)
        weights = [big[k * rows:(k + 1) * rows, :D] for k in range(n)]
    else:
        weights = [torch.randn(rows, D, generator=g).to(dtype) for _ in range(n)]
    tables = [TableSpec(f"t{k}", D, num_rows=rows, max_norm=max_norm) for k in range(n)]
    return tables, feats, weights, bags, weighted


def batch_of(bags, weighted) -> SparseFeatures:
    """Feature-major bags [(id, weight), ...] per feature as a SparseFeatures."""
    flat = [bag for feature in bags for bag in feature]
    values = torch.tensor([i for bag in flat for i, _ in bag], dtype=torch.int64)
    lengths = torch.tensor([len(bag) for bag in flat], dtype=torch.int64)
    w = torch.tensor([x for bag in flat for _, x in bag], dtype=torch.float32) if weighted else None
    return SparseFeatures([f"f{k}" for k in range(len(bags))], values, lengths=lengths, weights=w,
                          batch_size=len(bags[0]))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@settings(max_examples=40)
@given(case=cases())
@pytest.mark.slow
def test_pooled_forward_equals_the_torch_reference_and_tf_semantics(device, case):
    tables, feats, weights, bags, weighted = case
    sf = batch_of(bags, weighted).to(device)
    weights = [w.to(device) for w in weights]
    dtype = weights[0].dtype
    ref = FusedEmbeddingLookup(tables, feats, backend="torch")([w.clone() for w in weights], sf)
    tri = FusedEmbeddingLookup(tables, feats, backend="triton")
    direct = tri(weights, sf)  # forward only: the direct kernel, straight from the batch
    trained = [w.clone().requires_grad_() for w in weights]
    prepared = tri(trained, sf)  # with grad: torch's prepare, the prepared kernel, torch's backward
    ref_trained = [w.clone().requires_grad_() for w in weights]
    ref_out = FusedEmbeddingLookup(tables, feats, backend="torch")(ref_trained, sf)
    for k, f in enumerate(feats):
        want = ref[f.name]
        assert direct[f.name].dtype == dtype and prepared[f.name].dtype == dtype
        if dtype == torch.float32 and tables[k].max_norm is None and device == "cpu":  # the same sums, same order
            assert torch.equal(direct[f.name], want) and torch.equal(prepared[f.name].detach(), want)
        torch.testing.assert_close(direct[f.name], want, **tol(dtype, device))
        torch.testing.assert_close(prepared[f.name].detach(), want, **tol(dtype, device))
        oracle = safe_lookup(weights[k].double().cpu().numpy(), bags[k], combiner=f.combiner.value,
                             default_id=f.default_id, max_norm=tables[k].max_norm, out_of_range=f.out_of_range.value,
                             prune_negative=f.prune_negative)
        np.testing.assert_allclose(direct[f.name].double().cpu().numpy(), oracle, **tol(dtype, device))
    # the forward's outputs train like the reference's: the same gradients (the backward is torch's)
    loss = sum((prepared[f.name].float() ** 2).sum() for f in feats)
    ref_loss = sum((ref_out[f.name].float() ** 2).sum() for f in feats)
    if any(t.requires_grad for t in [loss, ref_loss]):
        loss.backward()
        ref_loss.backward()
    for w, r in zip(trained, ref_trained):
        assert (w.grad is None) == (r.grad is None)
        if w.grad is not None:
            torch.testing.assert_close(w.grad.to_dense(), r.grad.to_dense(), **tol(dtype, device))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_pooled_forward_equals_embedding_bag(device, mode, weighted):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(7, 6, generator=g).to(device)
    offsets = torch.tensor([0, 3, 3, 4, 9], device=device)  # an empty bag, duplicates below
    values = torch.tensor([1, 1, 6, 0, 2, 2, 2, 5, 3], device=device)
    w = (torch.rand(9, generator=g) + 0.1).to(device) if weighted else None
    want = F.embedding_bag(values, W, offsets[:-1], mode=mode, per_sample_weights=w)
    got = safe_embedding_lookup_sparse(W, (values, offsets, w), combiner=mode, backend="triton")
    torch.testing.assert_close(got, want, **tol(torch.float32, device))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_programs_in_a_shuffled_order_give_the_same_result(monkeypatch, device, seed):
    """Each program of a launch run alone, in a random order, with 2 bags a program: the same output."""
    g = torch.Generator().manual_seed(seed)
    B, rows = 5, 6
    tables = [TableSpec("a", 4, num_rows=rows, max_norm=1.0), TableSpec("b", 4, num_rows=rows)]
    feats = [FeatureSpec("x", "a", combiner="mean", default_id=2), FeatureSpec("y", "b", combiner="sqrtn"),
             FeatureSpec("z", "a", source="y", combiner="sum")]
    big = torch.randn(2 * rows, 6, generator=g).to(device)
    storages = [big[:rows, :4], big[rows:, :4]]
    lengths = torch.randint(0, 4, (2 * B,), generator=g)
    values = torch.randint(-1, rows, (int(lengths.sum()),), generator=g)
    sf = SparseFeatures(["x", "y"], values, lengths=lengths, weights=torch.rand(values.numel(), generator=g),
                        batch_size=B).to(device)
    lookup = FusedEmbeddingLookup(tables, feats, backend="triton")
    want = FusedEmbeddingLookup(tables, feats, backend="torch")(storages, sf).stacked()
    prep = lookup.prepare(sf, storages)
    group = lookup.plan.groups[0]
    one_launch = _triton_stages.pool_triton(lookup.plan, prep, storages, prep.unique_keys, group)
    direct_one, bad = _triton_stages.forward_direct_triton(lookup.plan, sf, storages)
    assert not bad
    torch.testing.assert_close(one_launch, want, **tol(torch.float32, device))
    torch.testing.assert_close(direct_one[0], want, **tol(torch.float32, device))
    from hugeembed._triton import pooled
    monkeypatch.setattr(pooled, "block_bags", lambda dim: (2, triton_next_pow2(dim)))
    shuffled = _triton_stages.pool_triton(lookup.plan, prep, storages, prep.unique_keys, group, shuffle=seed)
    direct, bad = _triton_stages.forward_direct_triton(lookup.plan, sf, storages, shuffle=seed)
    assert not bad
    assert torch.equal(shuffled, one_launch) and torch.equal(direct[0], direct_one[0])


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@interpreter_only
@pytest.mark.parametrize("values, offsets, message", BAD_OFFSETS)
def test_bad_offsets_are_refused_as_by_the_other_backends(values, offsets, message):
    v, o = torch.tensor(values, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)
    W = torch.randn(10, 3)
    lookup = FusedEmbeddingLookup([TableSpec("t", 3, num_rows=10)], [FeatureSpec("a", "t")], backend="triton")
    calls = _entry_points("triton") + [("forward_static", lambda v, o: lookup.forward_static(
        [W], SparseFeatures(["a"], v, offsets=o)))]
    for name, call in calls:
        with pytest.raises(InputError, match=r"feature 'a'.*" + message):
            call(v, o)


@interpreter_only
def test_bad_ids_and_weights_are_refused_with_the_reference_message():
    W = torch.randn(4, 3)
    cases = [((torch.tensor([0, 9]), torch.tensor([0, 2])), None, "id 9 at sample 0 is out of range"),
             ((torch.tensor([0, 1]), torch.tensor([0, 1, 2])), torch.tensor([1.0, float("nan")]), "weight nan"),
             ((torch.tensor([0, 1]), torch.tensor([0, 1, 2])), torch.tensor([float("inf"), 1.0]), "weight inf")]
    for ids, weights, message in cases:
        for requires_grad in (False, True):
            errors = []
            for backend in ("torch", "triton"):
                with pytest.raises(InputError, match=message) as got:
                    safe_embedding_lookup_sparse(W.clone().requires_grad_(requires_grad), ids, weights,
                                                 name="a", backend=backend)
                errors.append(str(got.value))
            assert errors[0] == errors[1]


@interpreter_only
def test_what_the_kernel_does_not_take_runs_on_the_reference(monkeypatch):
    """Pooled fp32 features never reach pool_torch; float64 rows and unpooled features do."""
    calls = []
    real = _lookup_run.pool_torch
    monkeypatch.setattr(_lookup_run, "pool_torch", lambda *a, **k: calls.append(a[-2]) or real(*a, **k))
    sf = SparseFeatures(["a"], torch.tensor([1, 2, 2]), lengths=torch.tensor([2, 1]), batch_size=2)
    for dtype, expect in ((torch.float32, 0), (torch.float64, 1)):
        W = torch.randn(4, 3, dtype=dtype, requires_grad=True)
        out = safe_embedding_lookup_sparse(W, sf, backend="triton")
        assert len(calls) == expect and out.dtype == dtype


@interpreter_only
def test_backend_triton_refuses_what_it_cannot_run_on(monkeypatch):
    W = torch.randn(4, 3)
    ids = (torch.tensor([1]), torch.tensor([0, 1]))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    with pytest.raises(InputError, match="backend='triton' runs on CUDA tensors.*the batch is on cpu"):
        safe_embedding_lookup_sparse(W, ids, backend="triton", table="u")
    monkeypatch.setattr(_triton, "available", lambda: False)
    with pytest.raises(ConfigError, match=r"backend='triton' needs triton: pip install 'hugeembed\[triton\]'"):
        FusedEmbeddingLookup([TableSpec("t", 3, num_rows=4)], [FeatureSpec("a", "t")], backend="triton")
    with pytest.raises(ConfigError, match="backend must be one of .*'triton'"):
        EmbeddingCollection([TableConfig("a", 3, num_rows=4)], optimizer=SGD(lr=0.1), backend="cuda")


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_collection_trains_and_evaluates_like_the_torch_backend(device):
    """Static and dynamic tables of two dims (one bf16), a few SGD steps on a loss of the outputs, then eval."""
    tables = [TableConfig("u", 4, num_rows=20, combiner="mean", features=("x",)),
              TableConfig("v", 4, combiner="sum", features=("y",)),
              TableConfig("w", 8, num_rows=6, features=("x",), max_norm=0.3, default_id=0),
              TableConfig("h", 4, num_rows=9, combiner="sqrtn", features=("y",), dtype=torch.bfloat16)]
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        lengths = torch.randint(0, 3, (8,), generator=g)
        values = torch.randint(0, 6, (int(lengths.sum()),), generator=g)
        batches.append(SparseFeatures(["x", "y"], values, lengths=lengths, batch_size=4).to(device))
    runs = {}
    for backend in ("torch", "triton"):
        ec = EmbeddingCollection(tables, optimizer=SGD(lr=0.5), backend=backend, device=device)
        outs = []
        for sf in batches:
            o = ec(sf)
            outs.append({n: o[n].detach().clone() for n in o.keys()})
            sum((o[n].float() ** 2).sum() for n in o.keys()).backward()
        ec.eval()
        with torch.no_grad():  # ids 6-8 are unknown to the dynamic table: they read zeros (slot -1)
            o = ec(SparseFeatures(["x", "y"], torch.tensor([1, 5, 3, 8, 7, 2, 6]),
                                  lengths=torch.tensor([1, 1, 0, 1, 2, 1, 1, 0]), batch_size=4).to(device))
            outs.append({n: o[n].clone() for n in o.keys()})
        runs[backend] = outs
    for want, got in zip(runs["torch"], runs["triton"]):
        for name in want:
            if name in ("x@u", "y@v") and device == "cpu":  # fp32 without max_norm: the same sums, same order
                assert torch.equal(got[name], want[name]), name
            torch.testing.assert_close(got[name], want[name], **tol(want[name].dtype, device))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_a_lookup_called_with_other_rows_reads_those_rows(device):
    """The launch tables are worked out once per layout of the rows: a call with other tensors (one tensor
    holding both tables, the same tensor with the tables the other way round, separate tensors, the first
    layout again) reads the rows it was given."""
    tables = [TableSpec("a", 4, num_rows=3), TableSpec("b", 4, num_rows=5)]
    feats = [FeatureSpec("x", "a", combiner="sum"), FeatureSpec("y", "b", combiner="mean")]
    lookup = FusedEmbeddingLookup(tables, feats, backend="triton")
    sf = SparseFeatures(["x", "y"], torch.tensor([0, 2, 1, 4, 3]), lengths=torch.tensor([2, 1, 1, 1])).to(device)
    g = torch.Generator().manual_seed(0)
    joined = torch.randn(8, 4, generator=g).to(device)
    # one tensor holding both, the same with b's rows first, separate tensors
    layouts = [[joined[:3], joined[3:]], [joined[5:], joined[:5]],
               [torch.randn(3, 4, generator=g).to(device), torch.randn(5, 4, generator=g).to(device)]]
    for weights in layouts + layouts[:1]:
        want = FusedEmbeddingLookup(tables, feats, backend="torch")(weights, sf)
        with torch.no_grad():
            got = lookup(weights, sf)
        for name in ("x", "y"):
            torch.testing.assert_close(got[name], want[name])
