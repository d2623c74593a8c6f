"""The learning-quality machinery of a run: the lr decay over the end of the run (by hand), the
run length of text files (from their line count), the evaluation points, the COPC curve."""

from __future__ import annotations

import gzip
import math

import pytest

from hugeembed.data import Loader, count_lines, write_criteo_tsv
from hugeembed.training import TrainConfig, Trainer
from hugeembed.training._sources import FileSource

SMALL = dict(batch_size=128, eval_rows=1024, synthetic_max_cardinality=5_000, threads=2, synthetic_rows=100_000)


def test_lr_factor_is_one_then_falls_linearly_to_zero_over_the_last_fraction():
    t = Trainer(TrainConfig(steps=10, lr_decay=0.3, **SMALL))
    # 10 steps, a tail of round(10 * 0.3) = 3 steps: (10 - s) / 3 from step 7 on
    assert [t.lr_factor(s) for s in range(10)] == [1, 1, 1, 1, 1, 1, 1, 1, 2 / 3, 1 / 3]
    flat = Trainer(TrainConfig(steps=10, lr_decay=0.0, **SMALL))
    assert [flat.lr_factor(s) for s in range(10)] == [1.0] * 10


def test_the_decayed_rates_reach_both_optimizers():
    cfg = TrainConfig(steps=4, lr_decay=0.5, eval_every=0, **SMALL)
    t = Trainer(cfg)
    t.fit()
    # the last step (index 3) ran at (4 - 3) / round(4 * 0.5) = 1/2 of each base rate
    assert t.dense_optimizer.param_groups[0]["lr"] == pytest.approx(cfg.dense_lr / 2)
    assert [g["lr"] for g in t.collection.optimizer.param_groups] == \
        pytest.approx([cfg.sparse_lr / 2] * len(t.collection.optimizer.param_groups))


def test_short_runs_evaluate_about_ten_times_and_record_copc():
    s = Trainer(TrainConfig(steps=30, **SMALL)).fit()
    h = s["history"]
    assert h["eval_step"] == [3, 6, 9, 12, 15, 18, 21, 24, 27, 30]  # every 30 // 10 steps, and the end
    assert len(h["copc"]) == len(h["auc"]) == 10 and h["copc"][-1] == s["copc"]
    assert all(math.isfinite(c) and 0.2 < c < 5 for c in h["copc"])


@pytest.mark.parametrize("gz, trailing_newline", [(False, True), (True, True), (False, False)])
def test_count_lines_counts_rows_of_plain_and_gzip_files(tmp_path, gz, trailing_newline):
    path = tmp_path / ("d.tsv.gz" if gz else "d.tsv")
    write_criteo_tsv(path, 1234, seed=3, rows_per_write=500)
    if not trailing_newline:
        data = path.read_bytes()
        path.write_bytes(data[:-1])
    assert count_lines(path) == 1234
    assert count_lines([path, path]) == 2468
    if gz:
        assert gzip.open(path).read().count(b"\n") == 1234


@pytest.mark.parametrize("world", [1, 3])
def test_a_text_files_estimated_steps_are_the_batches_it_trains_on(tmp_path, world):
    path = tmp_path / "d.tsv"
    write_criteo_tsv(path, 5000, seed=1)
    for rank in range(world):
        cfg = TrainConfig(data=(str(path),), batch_size=100, eval_rows=300, threads=1)
        src = FileSource(cfg, rank, world)
        trained = sum(1 for _ in src.train_batches(0))  # the oracle: what the loader yields
        assert src.estimated_steps_per_epoch == trained
        assert src.steps_per_epoch is None  # text: never used to stop training
        assert trained == len(list(Loader(str(path), 100, drop_last=True, rank=rank, world_size=world))) - src.holdout
