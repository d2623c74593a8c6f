"""bench/quality.py's reference model is what it claims (not timed): per-feature vocabularies of the
training file with index 0 for missing and unseen ids, U(+-sqrt(1/n)) tables, and the variants parse."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hugeembed.data import MISSING_ID_BASE
from hugeembed.training import TrainConfig

from ._load import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("quality")


def test_vocabulary_indices_are_1_based_with_0_for_missing_and_unseen(bench):
    train = np.array([[5, 9], [7, MISSING_ID_BASE + 1], [5, 3]], np.int64)
    test = np.array([[7, 3], [6, MISSING_ID_BASE + 1], [5, 100]], np.int64)
    vocab = bench.vocabularies(train)
    # the oracle: a dict per feature over the training file's present ids, in sorted order
    maps = [{v: i + 1 for i, v in enumerate(sorted({int(x) for x in col if x < MISSING_ID_BASE}))} for col in train.T]
    want = [[maps[j].get(int(x), 0) for j, x in enumerate(row)] for row in test]
    assert bench.to_indices(test, vocab).tolist() == want
    assert [len(v) + 1 for v in vocab] == [3, 3]  # rows per table: the vocabulary and row 0


def test_reference_tables_start_uniform_within_sqrt_1_over_n(bench):
    model = bench.ReferenceDLRM([4, 10_000])
    for table, n in zip(model.tables, (4, 10_000)):
        w = table.weight.detach()
        assert w.abs().max() <= math.sqrt(1 / n) and w.abs().max() > 0.9 * math.sqrt(1 / n)
        assert table.sparse


@pytest.mark.parametrize("name", ["old_defaults", "admit1", "lr_count_scale10", "init_uniform_rows", "batch1024"])
def test_every_built_in_variant_is_a_valid_config(bench, name):
    _, overrides = bench.parse_variant(name)
    TrainConfig.from_dict({"data": ["x.tsv"], "steps": None, **overrides})


def test_an_ad_hoc_variant_reads_numbers_and_strings(bench):
    assert bench.parse_variant("mine:sparse_optimizer=adagrad,sparse_lr=0.05,batch_size=512") == (
        "mine", {"sparse_optimizer": "adagrad", "sparse_lr": 0.05, "batch_size": 512})
