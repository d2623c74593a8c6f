"""choose_epochs: the held-out tail is exactly the data's last whole batches and is never trained on; the trial's
AUC after k passes is that of a run of k passes on the head scored on the tail (written as files of their own);
the run then equals a run given the chosen passes; bad values fail in one line naming the setting."""

from __future__ import annotations

import csv
import random

import pytest

from hugeembed.data import load_schema
from hugeembed.errors import ConfigError
from hugeembed.training import TrainConfig, Trainer
from hugeembed.training._choose import TailSource

pytest.importorskip("pyarrow")

SCHEMA = """format = "csv"
[label]
column = "y"
[dense.row]
[sparse.item]
[sparse.group]
"""


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["y", "row", "item", "group"])
        w.writerows(rows)


def _rows(n, seed=3):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        item, group = rng.randint(0, 30), rng.randint(0, 4)
        p = 0.15 + 0.5 * (item % 3 == 0) + 0.2 * (group == 1)
        out.append([int(rng.random() < p), i, f"i{item}", f"g{group}"])
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("choose")
    (d / "s.toml").write_text(SCHEMA)
    rows = _rows(1005)
    _write(d / "train.csv", rows)
    _write(d / "test.csv", _rows(300, seed=9))
    return d, rows


def _cfg(d, **kw):
    settings = dict(schema=str(d / "s.toml"), data=(str(d / "train.csv"),), eval_data=(str(d / "test.csv"),),
                    batch_size=50, embedding_dim=4, eval_every=0, threads=1, steps=None)
    return TrainConfig(**(settings | kw))


def _row_numbers(batches):
    return [int(v) for b in batches for v in b.dense[:, 0].tolist()]


def test_tail_is_the_last_whole_batches_and_the_head_the_rest(data):
    d, rows = data
    cfg = _cfg(d, epochs=1)
    src = TailSource(cfg, load_schema(d / "s.toml"), 0.15)
    whole = len(rows) // 50  # 20 whole batches; the last 5 rows are read by neither side, as a run drops them
    tail = round(0.15 * whole)  # 3
    assert src.tail == tail and src.steps_per_epoch == whole - tail
    for epoch in (0, 1):  # every pass trains on the same head, in file order
        assert _row_numbers(src.train_batches(epoch)) == list(range((whole - tail) * 50))
    assert _row_numbers(src.eval_batches()) == list(range((whole - tail) * 50, whole * 50))
    assert _row_numbers(src.train_batches(0, skip=2)) == list(range(100, (whole - tail) * 50))


def test_without_eval_data_the_runs_held_out_head_is_read_by_neither_side(data):
    """The run evaluates on its first eval_rows rows; the trial neither trains on them nor scores them."""
    from hugeembed.training._choose import choose_epochs

    d, rows = data
    cfg = _cfg(d, eval_data=(), eval_rows=120, choose_epochs=1)  # the run holds out its first 3 batches
    src = TailSource(cfg, load_schema(d / "s.toml"), 0.1, head=3)
    whole = len(rows) // 50
    tail = round(0.1 * (whole - 3))  # 2
    assert _row_numbers(src.train_batches(0)) == list(range(150, (whole - tail) * 50))
    assert _row_numbers(src.eval_batches()) == list(range((whole - tail) * 50, whole * 50))
    assert choose_epochs(cfg, load_schema(d / "s.toml")).tail_batches == tail


@pytest.mark.slow
def test_trial_aucs_are_head_runs_scored_on_the_tail_and_the_run_makes_the_best_count(data, tmp_path):
    d, rows = data
    s = Trainer(_cfg(d, choose_epochs=3, choose_holdout=0.2)).fit()
    assert 1 <= len(s["tail_auc"]) <= 3
    # the oracle: the head and the tail as files of their own, runs of k passes with the trial's settings
    cut = (len(rows) // 50 - round(0.2 * (len(rows) // 50))) * 50
    _write(tmp_path / "head.csv", rows[:cut])
    _write(tmp_path / "tail.csv", rows[cut:len(rows) // 50 * 50])
    for k, auc in enumerate(s["tail_auc"], start=1):
        alone = Trainer(_cfg(d, data=(str(tmp_path / "head.csv"),), eval_data=(str(tmp_path / "tail.csv"),),
                             epochs=k, lr_decay=0.0, average_dense=False)).fit()
        assert alone["auc"] == pytest.approx(auc, abs=1e-6)
    aucs = s["tail_auc"]
    best = max(range(len(aucs)), key=lambda k: (aucs[k], -k)) + 1  # the first best
    assert s["chosen_epochs"] == best and s["epochs"] == best
    # stopped early only after 2 passes without a better AUC
    assert len(aucs) == 3 or len(aucs) - best >= 2
    given = Trainer(_cfg(d, epochs=best)).fit()
    assert given["auc"] == s["auc"] and given["logloss"] == s["logloss"]


@pytest.mark.parametrize("settings,fragments", [
    (dict(choose_epochs=0), ["choose-epochs", "0", "positive integer"]),
    (dict(choose_epochs=2.5), ["choose-epochs", "2.5"]),
    (dict(choose_holdout=0.0), ["choose-holdout", "0.0", "(0, 1)"]),
    (dict(choose_holdout=1.0), ["choose-holdout", "1.0"]),
    (dict(choose_holdout=True), ["choose-holdout", "True"]),
    (dict(choose_epochs=3, steps=10), ["choose-epochs", "steps=10"]),
])
def test_bad_settings_name_the_setting(data, settings, fragments):
    d, _ = data
    with pytest.raises(ConfigError) as e:
        _cfg(d, **settings)
    assert "\n" not in str(e.value) and all(f in str(e.value) for f in fragments), str(e.value)


def test_needs_data_and_enough_batches(data, tmp_path):
    d, rows = data
    with pytest.raises(ConfigError, match="choose-epochs.*--data"):
        TrainConfig(choose_epochs=2, steps=None)
    _write(tmp_path / "one.csv", rows[:60])  # one whole batch: nothing left to train on
    with pytest.raises(ConfigError, match=r"one\.csv has 1 batch\(es\) of 50 rows"):
        Trainer(_cfg(d, data=(str(tmp_path / "one.csv"),), choose_epochs=2))
