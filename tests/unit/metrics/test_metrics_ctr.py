"""Log loss, CTR, PCTR, COPC, MetricSet and exact sums, against sklearn / NumPy / math.fsum."""

from __future__ import annotations

import math
from fractions import Fraction
import pickle

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from sklearn.metrics import log_loss as sk_log_loss

from hugeembed.errors import ConfigError, InputError
from hugeembed.metrics import COPC, CTR, PCTR, AUC, ExactSum, LogLoss, MetricSet, copc, ctr, log_loss, pctr, roc_auc


def data(n=2000, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01
    y = (torch.rand(n, generator=g, dtype=torch.float64) < p).long()
    return p.to(device), y.to(device)


def test_values_against_references(device):
    p, y = data(device=device)
    pn, yn = p.cpu().numpy(), y.cpu().numpy()
    assert log_loss(p, y) == pytest.approx(sk_log_loss(yn, pn), rel=1e-12)
    assert ctr(y) == yn.mean()
    assert pctr(p) == pytest.approx(pn.mean(), rel=1e-14)
    assert copc(p, y) == pytest.approx(yn.sum() / pn.sum(), rel=1e-14)
    assert pctr(p) == math.fsum(pn.tolist()) / len(pn)  # exactly rounded mean


def test_log_loss_clips():
    p = torch.tensor([0.0, 1.0, 1e-12, 0.5])
    y = torch.tensor([0, 1, 1, 0])
    eps = 1e-7
    expected = np.mean([-math.log1p(-eps), -math.log(1 - eps), -math.log(eps), -math.log(0.5)])
    assert log_loss(p, y, eps=eps) == pytest.approx(expected, rel=1e-12)
    assert log_loss(torch.tensor([0.0]), torch.tensor([1]), eps=1e-3) == pytest.approx(-math.log(1e-3))
    with pytest.raises(ConfigError, match="eps"):
        log_loss(p, y, eps=0.0)


def test_errors_and_nan_cases():
    with pytest.raises(InputError, match=r"probabilities in \[0, 1\], got 1.5"):
        log_loss(torch.tensor([0.2, 1.5]), torch.tensor([0, 1]))
    with pytest.raises(InputError, match="labels must be 0 or 1"):
        copc(torch.tensor([0.2]), torch.tensor([0.5]))
    with pytest.raises(InputError, match="torch.Tensor"):
        log_loss([0.2], torch.tensor([1]))
    empty = torch.tensor([])
    assert all(math.isnan(v) for v in (log_loss(empty, empty), ctr(empty), pctr(empty), copc(empty, empty)))
    assert math.isnan(copc(torch.zeros(3), torch.tensor([0, 1, 0])))
    out = MetricSet().compute()
    assert out["count"] == 0 and all(math.isnan(out[k]) for k in ("auc", "logloss", "ctr", "pctr", "copc"))


@settings(max_examples=10)
@given(st.integers(0, 2**31), st.integers(1, 5))
def test_metric_set_streaming_and_merge_equal_one_shot_bit_for_bit(seed, n_ranks):
    p, y = data(n=1500, seed=seed)
    p32 = p.float()
    one_shot = {"auc": roc_auc(p32, y), "logloss": log_loss(p32, y), "ctr": ctr(y), "pctr": pctr(p32),
                "copc": copc(p32, y), "count": 1500}
    ranks = []
    for r in range(n_ranks):  # interleaved slices, uneven batch sizes
        m = MetricSet()
        idx = torch.arange(r, 1500, n_ranks)
        for a in range(0, idx.numel(), 149):
            m.update(p32[idx[a : a + 149]], y[idx[a : a + 149]])
        ranks.append(pickle.loads(pickle.dumps(m)))
    merged = ranks[0]
    for m in ranks[1:]:
        merged.merge(m)
    assert merged.compute() == one_shot


def test_single_metric_accumulators(device):
    p, y = data(device=device)
    for cls, fn in ((LogLoss, lambda: log_loss(p, y)), (CTR, lambda: ctr(y)), (PCTR, lambda: pctr(p)),
                    (COPC, lambda: copc(p, y))):
        a, b = cls(), cls()
        a.update(p[:700], y[:700])
        b.update(p[700:], y[700:])
        assert a.merge(b).compute() == fn()
        a.reset()
        assert math.isnan(a.compute())
    with pytest.raises(ConfigError, match="merge"):
        LogLoss(1e-7).merge(LogLoss(1e-3))


def test_metric_set_on_device_matches_cpu(device):
    p, y = data()
    m_dev, m_cpu = MetricSet(), MetricSet()
    m_dev.update(p.to(device), y.to(device))
    m_cpu.update(p, y)
    got, ref = m_dev.compute(), m_cpu.compute()
    assert got["auc"] == ref["auc"] and got["ctr"] == ref["ctr"] and got["pctr"] == ref["pctr"]
    assert got["logloss"] == pytest.approx(ref["logloss"], rel=1e-14)
    both = AUC()
    both.update(p.to(device), y.to(device))
    both.merge(AUC())
    assert both.compute() == ref["auc"]


finite_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)


def exact_float_sum(xs) -> float:
    """The exact sum, rounded once to a float64 (inf beyond the largest float): the oracle.

    math.fsum is not: it raises on an *intermediate* overflow even when the exact sum
    rounds to a finite float (e.g. 2 * 8.99e307 - 1 rounds to the largest float).
    """
    total = sum((Fraction(x) for x in xs), Fraction(0))
    try:
        return float(total)
    except OverflowError:
        return math.inf if total > 0 else -math.inf


@given(st.lists(finite_floats, max_size=60), st.integers(0, 60))
@example([8.988465674311579e307, 8.98846567431158e307, -1.0], 0)  # fsum overflows, the sum does not
def test_exact_sum_equals_the_exact_rounded_sum_in_any_split(xs, cut):
    cut = min(cut, len(xs))
    a, b = ExactSum(), ExactSum()
    a.add(torch.tensor(xs[:cut], dtype=torch.float64))
    b.add(torch.tensor(xs[cut:][::-1], dtype=torch.float64))
    assert a.merge(b).value() == exact_float_sum(xs)
    assert a.count == len(xs)


def test_exact_sum_rejects_non_finite():
    with pytest.raises(InputError, match="finite"):
        ExactSum().add(torch.tensor([1.0, float("inf")]))
