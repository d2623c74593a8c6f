"""Gradients w.r.t. per-id weights against autograd on a dense computation and embedding_bag."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from hugeembed import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.errors import InputError
from hugeembed.functional import embedding_lookup_unpooled, safe_embedding_lookup_sparse
from hugeembed.optim import SGD

from tests.conftest import DEVICES

from .test_gradients import dense_reference, nondet_tol
from .test_safe_lookup import batches, to_tensors, tol


@pytest.mark.parametrize("device", DEVICES)
@given(case=batches(), combiner=st.sampled_from(["sum", "mean", "sqrtn"]), use_default=st.booleans(),
       max_norm=st.sampled_from([None, 0.8]))
def test_weight_and_table_gradients_match_dense_autograd(device, case, combiner, use_default, max_norm):
    rows, bags, _ = case
    g = torch.Generator().manual_seed(len(bags))
    W = torch.randn(rows, 4, dtype=torch.float64, generator=g)
    v, o, w = to_tensors(bags, True)
    w = w.double()
    default_id = 0 if use_default else None
    upstream = torch.randn(len(bags), 4, dtype=torch.float64, generator=g)

    # ours on `device`, the dense reference on the CPU (float64: the tolerances hold on CUDA too)
    ours_W, ours_w = W.clone().to(device).requires_grad_(), w.clone().to(device).requires_grad_()
    out = safe_embedding_lookup_sparse(ours_W, (v.to(device), o.to(device), ours_w), combiner=combiner,
                                       default_id=default_id, max_norm=max_norm)
    ref_W, ref_w = W.clone().requires_grad_(), w.clone().requires_grad_()
    ref = dense_reference(ref_W, bags, combiner, default_id, max_norm, ref_w)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=1e-12, atol=1e-12)
    loss = (out * upstream.to(device)).sum()
    if not loss.requires_grad:  # nothing kept anywhere and no default row: no graph at all
        return
    loss.backward()
    ref_loss = (ref * upstream).sum()
    if ref_loss.requires_grad:
        ref_loss.backward()
    expected_w = ref_w.grad if ref_w.grad is not None else torch.zeros_like(w)
    got_w = ours_w.grad.cpu() if ours_w.grad is not None else torch.zeros_like(w)
    torch.testing.assert_close(got_w, expected_w, rtol=1e-10, atol=1e-12)  # dropped ids: exactly 0
    assert bool((got_w[(w <= 0) | (v < 0)] == 0).all())
    if ours_W.grad is not None:
        expected_W = ref_W.grad if ref_W.grad is not None else torch.zeros_like(W)
        torch.testing.assert_close(ours_W.grad.to_dense().cpu(), expected_W, rtol=1e-10, atol=1e-12)


def test_sum_weight_gradient_equals_embedding_bag_per_sample_weights(device):
    g = torch.Generator().manual_seed(3)  # drawn on the CPU (the reference runs there), moved for ours
    W = torch.randn(50, 16, generator=g)
    v = torch.randint(0, 50, (40,), generator=g)
    o = torch.tensor([0, 5, 5, 12, 30, 40])
    w = torch.rand(40, generator=g) + 0.05
    up = torch.randn(5, 16, generator=g)
    ours = w.clone().to(device).requires_grad_()
    (safe_embedding_lookup_sparse(W.to(device), (v.to(device), o.to(device), ours), combiner="sum")
     * up.to(device)).sum().backward()
    ref = w.clone().requires_grad_()
    (F.embedding_bag(v, W, o[:-1], mode="sum", per_sample_weights=ref) * up).sum().backward()
    torch.testing.assert_close(ours.grad.cpu(), ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn", "unpooled"])
def test_weight_gradcheck_float64(combiner, device):
    W = torch.randn(7, 3, dtype=torch.float64).to(device)
    v = torch.tensor([1, 2, 2, 5, -1, 6, 6, 0], device=device)
    o = torch.tensor([0, 3, 3, 5, 8], device=device)
    w = torch.tensor([0.5, 1.0, 2.0, 1.5, 1.0, 0.2, 0.7, 3.0], dtype=torch.float64, device=device, requires_grad=True)
    if combiner == "unpooled":
        fn = lambda x: embedding_lookup_unpooled(W, (v, o, x), max_norm=0.9).values
    else:
        fn = lambda x: safe_embedding_lookup_sparse(W, (v, o, x), combiner=combiner, max_norm=0.9, default_id=3)
    assert torch.autograd.gradcheck(fn, (w,), nondet_tol=nondet_tol(device))


def test_native_backend_refuses_weights_that_need_grad():
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(InputError, match="per-id weights"):
        safe_embedding_lookup_sparse(torch.randn(5, 4), (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), w),
                                     backend="native")


def test_collection_trains_weights_and_rows_together(device):
    """Weights receive the gradient of the rows as read in forward; the rows get their SGD update."""
    g = torch.Generator().manual_seed(5)  # drawn on the CPU (the reference runs there), moved for ours
    cfg = TableConfig("t", dim=4, num_rows=20, features=("f",), combiner="mean")
    ec = EmbeddingCollection([cfg], optimizer=SGD(lr=0.5), seed=1, device=device)
    W0 = ec.store("t").storage()[:, :4].clone().cpu().double()
    v = torch.randint(0, 20, (9,), generator=g)
    lengths = torch.tensor([3, 0, 4, 2])
    w = (torch.rand(9, generator=g) + 0.1).requires_grad_()  # a CPU leaf: its gradient flows back through .to
    up = torch.randn(4, 4, generator=g)
    out = ec(SparseFeatures(["f"], v.to(device), lengths=lengths.to(device), weights=w.to(device)))["f"]
    (out * up.to(device)).sum().backward()

    ref_W, ref_w = W0.clone().requires_grad_(), w.detach().double().clone().requires_grad_()
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    bags = [[(int(v[j]), float(w.detach()[j])) for j in range(int(offs[b]), int(offs[b + 1]))] for b in range(4)]
    ref = dense_reference(ref_W, bags, "mean", None, None, ref_w)
    (ref * up.double()).sum().backward()
    torch.testing.assert_close(w.grad.double(), ref_w.grad, rtol=1e-5, atol=tol(device, 1e-6))
    torch.testing.assert_close(ec.store("t").storage()[:, :4].cpu().double(), W0 - 0.5 * ref_W.grad, rtol=1e-5,
                               atol=tol(device, 1e-6))


def test_weights_prepared_without_grad_refuse_a_lookup_that_would_drop_their_gradient():
    from hugeembed.functional import FeatureSpec, FusedEmbeddingLookup, TableSpec

    lookup = FusedEmbeddingLookup([TableSpec("a", 4, num_rows=5)], [FeatureSpec("f", "a")])
    W = [torch.randn(5, 4)]
    w = torch.ones(3, requires_grad=True)
    sf = SparseFeatures(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]), weights=w)
    with torch.no_grad():
        prep = lookup.prepare(sf, W)
    with pytest.raises(InputError, match="prepared with grad disabled"):
        lookup.lookup(prep, W, lookup.static_slots(prep))
    with torch.no_grad():  # a forward-only lookup of that batch is fine
        assert lookup.lookup(prep, W, lookup.static_slots(prep))["f"].shape == (2, 4)
