"""Row-sparse gradients of the lookup against autograd on a dense computation (float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from hugeembed.functional import FeatureSpec, FusedEmbeddingLookup, TableSpec, safe_embedding_lookup_sparse
from hugeembed.features import SparseFeatures

from tests.conftest import DEVICES

from .test_safe_lookup import batches, skip_native_on_accelerator, to_tensors, tol
from .tf_oracle import clean_bag


def nondet_tol(device: torch.device | str) -> float:
    """gradcheck's tolerance between two backward runs: 0 on the CPU; on CUDA the row gradients are
    summed by atomic adds in no fixed order (float64: differences of ~1e-16)."""
    return 0.0 if torch.device(device).type == "cpu" else 1e-12


def dense_reference(W: torch.Tensor, bags, combiner, default_id, max_norm, wt: torch.Tensor | None = None):
    """The same lookup written with differentiable torch indexing, one bag at a time.

    Ids are kept by TF's rules (clean_bag); `wt` (optional) holds the per-id weights as a
    tensor to differentiate against, one per id of `bags` in order (else they are constants).
    """
    out, p = [], 0
    for bag in bags:
        kept = [(i, p + j) for j, (i, _) in enumerate(bag) if clean_bag([bag[j]], W.shape[0])]
        if wt is None:
            wt_bag = torch.tensor([x for _, x in bag], dtype=W.dtype)
            w = wt_bag[[j - p for _, j in kept]] if kept else None
        else:
            w = wt[torch.tensor([j for _, j in kept])] if kept else None
        p += len(bag)
        if kept:
            ids = torch.tensor([i for i, _ in kept])
        elif default_id is not None:
            ids, w = torch.tensor([default_id]), torch.ones(1, dtype=W.dtype)
        else:
            out.append(torch.zeros(W.shape[1], dtype=W.dtype))
            continue
        rows = W[ids]
        if max_norm is not None:
            norm = torch.sqrt((rows * rows).sum(1, keepdim=True))
            rows = rows * max_norm / torch.maximum(norm, torch.tensor(max_norm, dtype=W.dtype))
        s = (rows * w[:, None]).sum(0)
        if combiner == "mean":
            s = s / w.sum()
        elif combiner == "sqrtn":
            s = s / torch.sqrt((w * w).sum())
        out.append(s)
    return torch.stack(out) if out else torch.zeros(0, W.shape[1], dtype=W.dtype)


@pytest.mark.parametrize("device", DEVICES)
@given(case=batches(), combiner=st.sampled_from(["sum", "mean", "sqrtn"]), use_default=st.booleans(),
       max_norm=st.sampled_from([None, 0.8]))
def test_sparse_gradient_matches_dense_autograd(device, case, combiner, use_default, max_norm):
    rows, bags, with_weights = case
    W = torch.randn(rows, 4, dtype=torch.float64)
    default_id = 0 if use_default else None
    v, o, w = to_tensors(bags, with_weights)
    w = None if w is None else w.double().to(device)
    upstream = torch.randn(len(bags), 4, dtype=torch.float64)

    # ours on `device`, the dense reference on the CPU (float64 everywhere: the tolerance holds on CUDA)
    ours = W.clone().to(device).requires_grad_()
    out = safe_embedding_lookup_sparse(ours, (v.to(device), o.to(device), w), combiner=combiner,
                                       default_id=default_id, max_norm=max_norm)
    (out * upstream.to(device)).sum().backward()

    ref = W.clone().requires_grad_()
    ref_loss = (dense_reference(ref, bags, combiner, default_id, max_norm) * upstream).sum()
    if ref_loss.requires_grad:  # an empty batch has no graph at all
        ref_loss.backward()

    grad = ours.grad
    if grad is None:  # nothing kept anywhere
        assert ref.grad is None or torch.count_nonzero(ref.grad) == 0
        return
    assert grad.is_sparse
    g = grad.coalesce()
    touched = set(g.indices()[0].tolist())
    expected_touched = {i for bag in bags for i, _ in clean_bag(bag, rows)}
    if default_id is not None and any(not clean_bag(bag, rows) for bag in bags):
        expected_touched.add(default_id)
    assert touched == expected_touched  # exactly the rows read, never a dense gradient
    torch.testing.assert_close(g.to_dense().cpu(), ref.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_native_float32_gradient_matches_float64_reference(backend, device):
    skip_native_on_accelerator(backend, device)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(30, 8, generator=g)
    bags = [[(int(i), float(x)) for i, x in zip(torch.randint(0, 30, (k,), generator=g), torch.rand(k, generator=g) + 0.1)]
            for k in [3, 0, 5, 1, 7, 2]]
    v, o, w = to_tensors(bags, True)
    ours = W.clone().to(device).requires_grad_()
    out = safe_embedding_lookup_sparse(ours, (v.to(device), o.to(device), w.to(device)), combiner="sqrtn", max_norm=1.5,
                                       default_id=4, backend=backend)
    up = torch.randn(out.shape, generator=g)
    (out * up.to(device)).sum().backward()
    ref = W.double().clone().requires_grad_()
    (dense_reference(ref, bags, "sqrtn", 4, 1.5) * up.double()).sum().backward()
    torch.testing.assert_close(ours.grad.to_dense().cpu().double(), ref.grad, rtol=1e-5, atol=tol(device, 1e-6))


class _Densify(torch.autograd.Function):
    """Wraps the lookup so gradcheck (which wants strided grads) can check its backward."""

    @staticmethod
    def forward(ctx, W, fn):
        with torch.enable_grad():
            leaf = W.detach().requires_grad_()
            out = fn(leaf)
        ctx.leaf, ctx.out = leaf, out
        return out.detach()

    @staticmethod
    def backward(ctx, g):
        (grad,) = torch.autograd.grad(ctx.out, ctx.leaf, g)
        return grad.to_dense(), None


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_gradcheck_float64(combiner, device):
    W = torch.randn(7, 3, dtype=torch.float64).to(device).requires_grad_()
    v = torch.tensor([1, 2, 2, 5, -1, 6, 6, 0], device=device)
    o = torch.tensor([0, 3, 3, 5, 8], device=device)
    w = torch.tensor([0.5, 1.0, 2.0, 1.5, 1.0, 0.2, 0.7, 3.0], dtype=torch.float64, device=device)
    fn = lambda X: safe_embedding_lookup_sparse(X, (v, o, w), combiner=combiner, max_norm=0.9, default_id=3)
    assert torch.autograd.gradcheck(lambda X: _Densify.apply(X, fn), (W,), nondet_tol=nondet_tol(device))


def _two_table_lookup(backend):
    tables = [TableSpec("a", 4, num_rows=10), TableSpec("b", 4, num_rows=6)]
    feats = [FeatureSpec("x", "a", combiner="sum"), FeatureSpec("y", "a", combiner="mean"),
             FeatureSpec("z", "b", combiner="sum")]
    return FusedEmbeddingLookup(tables, feats, backend=backend)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_hook_receives_unique_rows_with_summed_gradients(backend, device):
    skip_native_on_accelerator(backend, device)
    lookup = _two_table_lookup(backend)
    sf = SparseFeatures(["x", "y", "z"], torch.tensor([3, 3, 4, 3, 9, 1, 1, 1]),
                        lengths=torch.tensor([2, 1, 1, 1, 1, 2])).to(device)
    Wa, Wb = torch.randn(10, 4, device=device), torch.randn(6, 4, device=device)
    seen = {}

    def hook(t, slots, grad):
        assert slots.device == grad.device == Wa.device
        seen[t] = (slots.clone(), grad.clone())

    anchor = torch.zeros(0, device=device, requires_grad=True)
    prep = lookup.prepare(sf, [Wa, Wb])
    out = lookup.lookup(prep, [Wa, Wb], lookup.static_slots(prep), params=[anchor], row_grad_hook=hook)
    out.concat().sum().backward()
    # table a: x bags [3,3], [4]; y bags [3], [9] (mean of one id each) -> row 3 gets 2 + 1, row 4: 1, row 9: 1
    slots_a, grad_a = seen[0]
    got = dict(zip(slots_a.tolist(), grad_a[:, 0].tolist()))
    assert got == {3: 3.0, 4: 1.0, 9: 1.0}
    slots_b, grad_b = seen[1]
    assert dict(zip(slots_b.tolist(), grad_b[:, 0].tolist())) == {1: 3.0}
    assert sorted(seen) == [0, 1]


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_sgd_in_hook_equals_torch_optim_sgd(backend, device):
    """Three steps of SGD applied inside backward equal torch.optim.SGD on the dense problem."""
    skip_native_on_accelerator(backend, device)
    g = torch.Generator().manual_seed(1)  # every draw on the CPU (the reference runs there), moved for ours
    lookup = _two_table_lookup(backend)
    Wa, Wb = torch.randn(10, 4, generator=g), torch.randn(6, 4, generator=g)
    ref = [Wa.clone().double().requires_grad_(), Wb.clone().double().requires_grad_()]
    opt = torch.optim.SGD(ref, lr=0.1)
    ours = [Wa.clone().to(device), Wb.clone().to(device)]
    anchor = torch.zeros(0, device=device, requires_grad=True)

    def hook(t, slots, grad):
        ours[t].index_add_(0, slots, grad, alpha=-0.1)

    for step in range(3):
        values = torch.randint(0, 6, (12,), generator=g)
        sf = SparseFeatures(["x", "y", "z"], values, lengths=torch.tensor([2, 2, 2, 2, 2, 2])).to(device)
        prep = lookup.prepare(sf, ours)
        out = lookup.lookup(prep, ours, lookup.static_slots(prep), params=[anchor], row_grad_hook=hook)
        target = torch.randn(out.concat().shape, generator=g)
        ((out.concat() - target.to(device)) ** 2).sum().backward()
        # reference: the same model with dense autograd and torch.optim.SGD
        opt.zero_grad()
        xa, ya, zb = ref[0][values[:4]].view(2, 2, 4), ref[0][values[4:8]].view(2, 2, 4), ref[1][values[8:]].view(2, 2, 4)
        pooled = torch.cat([xa.sum(1), ya.mean(1), zb.sum(1)], dim=1)
        ((pooled - target.double()) ** 2).sum().backward()
        opt.step()
    torch.testing.assert_close(ours[0].cpu().double(), ref[0].detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1].cpu().double(), ref[1].detach(), rtol=1e-5, atol=1e-5)
