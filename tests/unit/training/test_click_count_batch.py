"""ClickCountUpdater.add in one pass over all count tables equals, bit for bit, the per-feature loop it
replaced (kept below as the oracle, with the Newton step as it read then): bags with repeated ids, empty bags,
negative ids, ids the forward never saw, ids evicted from a count table, a batch naming its features in
another order than the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hugeembed import SparseFeatures
from hugeembed.models import ClickCountUpdater, count_log_odds, make_model
from hugeembed.optim import Adam

FEATURES = ("a", "b", "c")


def _old_fit_step(fit, hessian, counts, logits, labels, lr_factor, step=0.1, decay=0.9, ridge=1e-4):
    b = counts.shape[0]
    if b == 0 or lr_factor <= 0.0:
        return
    x = torch.cat([torch.ones(b, 1, dtype=torch.float64), counts.double()], 1)
    p = torch.sigmoid(logits.detach().double().reshape(-1))
    y = labels.detach().double().reshape(-1)
    grad = x.T @ (p - y) / b
    h = ((x * (p * (1.0 - p)).unsqueeze(1)).T @ x / b).to(hessian)
    if bool((hessian == 0).all()):
        hessian.copy_(h)
    else:
        hessian.mul_(decay).add_(h, alpha=1.0 - decay)
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype)
    delta = torch.linalg.solve(hessian + ridge * eye, grad.to(hessian))
    if bool(torch.isfinite(delta).all()):
        fit.sub_((step * lr_factor * delta).to(fit))


def _old_add(model, sparse, labels, logits, lr_factor, prior=20.0):
    """The per-feature loop of ClickCountUpdater.add as it was (hugeembed 3433410)."""
    with torch.no_grad():
        y = labels.reshape(-1).double()
        _old_fit_step(model.count_fit, model.count_hessian, model.count_inputs, logits, y, lr_factor)
        model.count_inputs = None
        model.count_rows += torch.stack([y.new_tensor(float(y.numel())), y.sum()]).to(model.count_rows)
        rows, positives = model.count_rows.tolist()
        bags = sparse.to_dict()
        for f in FEATURES:
            jf = bags[f]
            if jf.values.numel() == 0:
                continue
            store = model.embeddings.store("count_" + f)
            offsets = jf.offsets.long()
            samples = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets[1:] - offsets[:-1])
            pairs = torch.unique(torch.stack([samples, jf.values.long()], 1), dim=0)
            ids, inverse = torch.unique(pairs[:, 1], return_inverse=True)
            clicks = torch.zeros(ids.numel(), dtype=torch.float64).index_add_(0, inverse, y[pairs[:, 0]])
            hits = torch.bincount(inverse, minlength=ids.numel()).double()
            slots = store.find(ids)
            keep = slots >= 0
            slots = slots[keep]
            old = store.gather(slots).double()
            c = old[:, 1] + clicks[keep]
            n = old[:, 2] + hits[keep]
            store.scatter(slots, torch.stack([count_log_odds(c, n, rows, positives, prior), c, n], 1).float())


ids = st.integers(-2, 9)
bag = st.lists(ids, max_size=4)  # repeats and empty bags


@st.composite
def batches(draw):
    B = draw(st.integers(1, 7))
    out = []
    for _ in range(draw(st.integers(1, 3))):
        bags = {"a": [[draw(ids)] for _ in range(B)], "b": [draw(bag) for _ in range(B)],
                "c": [draw(st.lists(ids, max_size=1 if draw(st.booleans()) else 0)) for _ in range(B)]}
        order = draw(st.permutations(FEATURES))  # the batch may name its features in any order
        unseen = draw(st.lists(st.integers(20, 23), max_size=2))  # counted, never looked up: no row, dropped
        out.append(({f: bags[f] for f in order}, unseen, [float(draw(st.booleans())) for _ in range(B)],
                    draw(st.lists(st.integers(-2, 9), max_size=3))))  # ids evicted from count_b before the add
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_one_pass_over_the_count_tables_equals_the_per_feature_loop_bit_for_bit(steps):
    model, oracle = (make_model("dlrm", embedding_dim=4, sparse_optimizer=Adam(lr=0.01), features=FEATURES,
                                num_dense=2, combiner="mean", click_counts=True, bottom_mlp=(4,), top_mlp=(4,))[0]
                     for _ in range(2))
    counts = ClickCountUpdater(model)
    g = torch.Generator().manual_seed(0)
    for bags, unseen, labels, evict in steps:
        y = torch.tensor(labels)
        dense = torch.randn(len(labels), 2, generator=g)
        logits = []
        for m in (model, oracle):
            logits.append(m(dense, SparseFeatures.from_lists(bags)))
            F.binary_cross_entropy_with_logits(logits[-1], y).backward()
            m.embeddings.optimizer.step()
            store = m.embeddings.store("count_b")
            gone = torch.tensor(sorted(set(evict)), dtype=torch.int64)
            store.remove(gone[store.find(gone) >= 0])
        counted = dict(bags, b=[b + unseen for b in bags["b"]])
        sparse = SparseFeatures.from_lists(counted)
        counts.add(sparse, y, logits[0].detach(), 0.5)
        _old_add(oracle, sparse, y, logits[1].detach(), 0.5)
        got, want = model.state_dict(), oracle.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
