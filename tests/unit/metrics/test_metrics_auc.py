"""AUC against sklearn (ties included), streaming == one-shot == merged, NaN and error cases."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from sklearn.metrics import roc_auc_score

from hugeembed.errors import InputError
from hugeembed.metrics import AUC, roc_auc


def pairwise_auc(scores, labels) -> float:
    """Oracle straight from the definition: P(score_pos > score_neg) + P(tie) / 2, over all pairs."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_small_example_with_ties(device):
    s = torch.tensor([0.1, 0.4, 0.4, 0.8, 0.4], device=device)
    y = torch.tensor([0, 1, 0, 1, 1], device=device)
    assert roc_auc(s, y) == pairwise_auc(s.tolist(), y.tolist()) == pytest.approx(roc_auc_score(y.cpu(), s.cpu()))


@given(st.lists(st.tuples(st.integers(0, 12), st.booleans()), min_size=2, max_size=120))
def test_matches_oracle_and_sklearn_with_heavy_ties(pairs):
    scores = [s / 4 for s, _ in pairs]  # few distinct values: many ties
    labels = [int(y) for _, y in pairs]
    got = roc_auc(torch.tensor(scores), torch.tensor(labels))
    if len(set(labels)) < 2:
        assert np.isnan(got)
        return
    assert got == pytest.approx(pairwise_auc(scores, labels), abs=1e-15)
    assert got == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)


@given(st.integers(0, 2**31), st.integers(1, 6), st.sampled_from([torch.float32, torch.float64, torch.float16]))
def test_streaming_and_merging_equal_one_shot_exactly(seed, n_parts, dtype):
    g = torch.Generator().manual_seed(seed)
    n = 3000
    scores = (torch.randn(n, generator=g) * 3).round(decimals=1).to(dtype)
    labels = (torch.rand(n, generator=g) < torch.sigmoid(scores.double())).to(torch.int64)
    whole = roc_auc(scores, labels)
    cuts = sorted(torch.randint(0, n, (n_parts - 1,), generator=g).tolist())
    bounds = [0, *cuts, n]
    ranks = []
    for a, b in zip(bounds, bounds[1:]):
        acc = AUC()
        for c in range(a, b, 97):  # many small updates per "rank"
            acc.update(scores[c : min(c + 97, b)], labels[c : min(c + 97, b)])
        ranks.append(pickle.loads(pickle.dumps(acc)))  # as all_gather_object would ship it
    merged = ranks[0]
    for other in ranks[1:]:
        merged.merge(other)
    assert merged.compute() == whole  # bit for bit
    assert whole == pytest.approx(roc_auc_score(labels.numpy(), scores.double().numpy()), abs=1e-12)


def test_state_stays_compact(device):
    acc = AUC()
    for i in range(200):
        s = torch.randint(0, 50, (1000,), device=device).float() / 50  # 50 distinct scores
        acc.update(s, (s > 0.5).long())
    assert acc.num_distinct <= 2 * 50 * 8  # a handful of runs of <= 50 distinct scores, not 200k samples
    assert acc.compute() == 1.0


def test_undefined_cases_are_nan_and_bad_inputs_raise(device):
    assert np.isnan(roc_auc(torch.tensor([], device=device), torch.tensor([], device=device)))
    assert np.isnan(roc_auc(torch.tensor([0.3, 0.9], device=device), torch.tensor([1, 1], device=device)))
    acc = AUC()
    assert np.isnan(acc.compute())
    acc.update(torch.tensor([0.2], device=device), torch.tensor([0], device=device))
    assert np.isnan(acc.compute())
    acc.update(torch.tensor([0.7], device=device), torch.tensor([True], device=device))
    assert acc.compute() == 1.0
    acc.reset()
    assert np.isnan(acc.compute())
    with pytest.raises(InputError, match="labels must be 0 or 1, got 2"):
        roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([0, 2]))
    with pytest.raises(InputError, match="2 predictions but 3 labels"):
        roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([0, 1, 1]))
    with pytest.raises(InputError, match="NaN"):
        roc_auc(torch.tensor([0.1, float("nan")]), torch.tensor([0, 1]))


def test_logits_and_probabilities_give_the_same_auc():
    z = torch.randn(500, dtype=torch.float64)
    y = (torch.rand(500) < 0.3).long()
    assert roc_auc(z, y) == roc_auc(torch.sigmoid(z), y)  # AUC depends only on the order
