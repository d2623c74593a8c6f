"""Synthetic Criteo generator: determinism, schema, CTR, Zipf skew, the planted model, learnability."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from hugeembed.data import (MISSING_IDS, SyntheticConfig, SyntheticCriteo, read_criteo, write_criteo_tsv)
from hugeembed.errors import ConfigError

CFG = SyntheticConfig(seed=7, max_cardinality=20_000)


@pytest.fixture(scope="module")
def gen():
    return SyntheticCriteo(CFG)


@pytest.fixture(scope="module")
def sample(gen):
    return gen.rows(0, 100_000)


def test_deterministic_and_independent_of_batching(gen):
    a = gen.rows(5000, 20_000)
    assert a.equals(SyntheticCriteo(CFG).rows(5000, 20_000))
    assert a.slice(3000, 4000).equals(gen.rows(8000, 1000))  # any range, any split
    pieces = list(gen.batches(777, 10, start=5000))
    assert np.array_equal(torch.cat([b.labels for b in pieces]).numpy(), a.labels[:7770])
    other = SyntheticCriteo(SyntheticConfig(seed=8, max_cardinality=20_000)).rows(5000, 20_000)
    assert not np.array_equal(other.cats, a.cats)


def test_schema(gen, sample):
    assert sample.dense.dtype == np.float32 and sample.dense.shape == (100_000, 13)
    assert sample.cats.dtype == np.int64 and sample.cats.shape == (100_000, 26)
    assert set(np.unique(sample.labels).tolist()) == {0.0, 1.0}
    assert (sample.dense >= 0).all() and np.isfinite(sample.dense).all()
    missing = sample.cats == np.array(MISSING_IDS)
    assert ((sample.cats >= 0) & (sample.cats < 2**32) | missing).all()
    for j, card in enumerate(gen.cardinalities):
        assert len(np.unique(sample.cats[~missing[:, j], j])) <= card
    assert gen.cardinalities[2] == 20_000 and gen.cardinalities[8] == 3  # capped / Kaggle counts
    assert 0.35 < missing[:, 18].mean() < 0.53 and missing[:, 0].mean() == 0  # C19 ~44% empty, C1 never
    raw = gen.raw_rows(0, 100_000)
    assert 0.40 < raw.ints_missing[:, 0].mean() < 0.50 and (raw.ints[:, 1] < 0).any()  # I1 ~45% empty, I2 < 0


def test_ctr_near_target(sample):
    assert abs(sample.labels.mean() - 0.25) < 0.01
    hi = SyntheticCriteo(SyntheticConfig(seed=1, max_cardinality=1000, target_ctr=0.1)).rows(0, 50_000)
    assert abs(hi.labels.mean() - 0.1) < 0.01


def test_ids_are_zipf_skewed(sample):
    ids, counts = np.unique(sample.cats[:, 2], return_counts=True)  # C3: 20k ids, 3% missing
    counts = np.sort(counts[ids < 2**32])[::-1].astype(float)
    # P(rank k) ~ k^-1.05: rank 10 vs rank 100 should differ by ~10^1.05 = 11.2
    assert 8 < counts[9] / counts[99] < 15
    assert counts[:100].sum() / counts.sum() > 0.3  # the 100 hottest ids take a big share


def test_bayes_metrics_are_strong_and_consistent(gen):
    best = gen.bayes_metrics(rows=50_000, start=10**9)
    assert 0.8 < best.auc < 0.95
    base = -(0.25 * np.log(0.25) + 0.75 * np.log(0.75))  # log loss of predicting the CTR
    assert best.logloss < base - 0.1
    blk = gen.rows(10**9, 50_000)
    p = gen.true_probabilities(blk)
    from sklearn.metrics import roc_auc_score

    assert best.auc == pytest.approx(roc_auc_score(blk.labels, p), abs=1e-12)


def test_labels_follow_the_planted_logistic_model(gen, sample):
    """Logistic regression on the true logit terms recovers weight 1 for each and the bias."""
    from sklearn.linear_model import LogisticRegression

    terms = gen.logit_terms(sample.dense, sample.cats)
    x = np.stack(list(terms.values()), axis=1)
    lr = LogisticRegression(C=1e6, max_iter=500).fit(x, sample.labels)
    assert np.allclose(lr.coef_[0], 1.0, atol=0.15), dict(zip(terms, lr.coef_[0].round(2)))
    assert lr.intercept_[0] == pytest.approx(gen.bias, abs=0.1)


def test_learnable_by_a_small_embedding_model_in_150_steps(gen):
    """A hashed-embedding FM trained 150 steps x 1024 rows reaches most of the Bayes AUC margin."""
    from sklearn.metrics import roc_auc_score

    torch.manual_seed(0)
    h, d = 1 << 12, 4
    lin = torch.zeros(26 * h, requires_grad=True)
    emb = (torch.randn(26 * h, d) * 0.01).requires_grad_()
    w, b0 = torch.zeros(13, requires_grad=True), torch.zeros(1, requires_grad=True)
    offs = torch.arange(26) * h

    def model(dense, ids):
        idx = ids % h + offs
        v = emb[idx]
        return lin[idx].sum(1) + 0.5 * (v.sum(1) ** 2 - (v**2).sum(1)).sum(1) + dense @ w + b0

    opt = torch.optim.Adagrad([lin, emb, w, b0], lr=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds contention on a busy machine
    try:
        for batch in gen.batches(1024, 150):
            ids = batch.sparse.values().view(26, -1).t()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch.dense, ids), batch.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    test = gen.rows(10**9, 50_000)
    with torch.no_grad():
        p = model(torch.from_numpy(test.dense), torch.from_numpy(test.cats)).numpy()
    auc, best = roc_auc_score(test.labels, p), gen.bayes_metrics(50_000, start=10**9).auc
    assert auc - 0.5 > 0.6 * (best - 0.5), (auc, best)


@pytest.mark.parametrize("name,crlf", [("s.txt", False), ("s.txt.gz", True)])
def test_write_criteo_tsv_round_trip(tmp_path, gen, name, crlf):
    path = write_criteo_tsv(tmp_path / name, 3000, config=CFG, start=11, crlf=crlf, rows_per_write=1000)
    raw = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
    first = raw.split(b"\r\n" if crlf else b"\n")[0].split(b"\t")
    assert len(first) == 40 and b"\t\t" in raw and raw.count(b"\n") == 3000
    assert read_criteo(path).equals(gen.rows(11, 3000))


def test_bad_configs():
    for kwargs, match in [({"max_cardinality": 0}, "max_cardinality"), ({"zipf_exponent": 1.0}, "zipf"),
                          ({"target_ctr": 1.0}, "target_ctr"), ({"effect_features": ("C27",)}, "C27"),
                          ({"interaction_rank": 5}, "interaction_rank")]:
        with pytest.raises(ConfigError, match=match):
            SyntheticConfig(**kwargs)
    with pytest.raises(ConfigError, match="batch_size"):
        next(SyntheticCriteo(CFG).batches(0))
