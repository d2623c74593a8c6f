"""The learning-quality machinery of a run: the lr decay over the end of the run (by hand), the
run length of text files (from their line count), the evaluation points, the COPC curve."""

from __future__ import annotations

import gzip
import math
import shutil

import pytest
import torch

from hugeembed.errors import CheckpointError, ConfigError
from hugeembed.data import Loader, count_lines, write_criteo_tsv
from hugeembed.training import TrainConfig, Trainer
from hugeembed.training._sources import FileSource

SMALL = dict(batch_size=128, eval_rows=1024, synthetic_max_cardinality=5_000, threads=1, synthetic_rows=100_000)


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


@pytest.mark.slow
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


# -- Adam's training defaults, dense averaging over the decay phase ------------------------------

def _dense(t: Trainer) -> list:
    return [p.detach().clone() for g in t.dense_optimizer.param_groups for p in g["params"]]


def test_adam_rules_get_the_measured_betas_and_eps_unless_given():
    from hugeembed.training._config import TRAIN_ADAM_BETAS, TRAIN_ADAM_EPS

    t = Trainer(TrainConfig(steps=1, **SMALL))
    assert {(r.betas, r.eps, r.bias_correction) for r in t.collection.rules} == \
        {(TRAIN_ADAM_BETAS, TRAIN_ADAM_EPS, "per_row")} == {((0.0, 0.999), 1e-5, "per_row")}
    t = Trainer(TrainConfig(steps=1, sparse_optimizer="global_adam", sparse_betas=(0.5, 0.99), sparse_eps=1e-7,
                            **SMALL))
    assert {(r.betas, r.eps, r.mode) for r in t.collection.rules} == {((0.5, 0.99), 1e-7, "global")}
    t = Trainer(TrainConfig(steps=1, sparse_optimizer="adagrad", **SMALL))
    assert {r.name for r in t.collection.rules} == {"adagrad"}
    with pytest.raises(ConfigError, match="sparse-betas and sparse-eps apply to the Adam optimizers .* 'adagrad'"):
        TrainConfig(sparse_optimizer="adagrad", sparse_betas=(0.9, 0.999), sparse_eps=1e-8)
    with pytest.raises(ConfigError, match=r"sparse-betas must be two numbers in \[0, 1\).*\(0.9, 1.0\)"):
        TrainConfig(sparse_betas=(0.9, 1.0))
    with pytest.raises(ConfigError, match="sparse-eps must be a positive number, got -1e-05"):
        TrainConfig(sparse_eps=-1e-5)


def test_cli_flags_of_adam_settings_and_dense_averaging():
    from hugeembed.cli import build_parser
    from hugeembed.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--sparse-betas", "0.5", "0.99", "--sparse-eps", "1e-6",
                                      "--no-average-dense"])
    cfg = config_from_args(args)
    assert (cfg.sparse_betas, cfg.sparse_eps, cfg.average_dense) == ((0.5, 0.99), 1e-6, False)
    cfg = config_from_args(build_parser().parse_args(["train"]))
    assert (cfg.sparse_betas, cfg.sparse_eps, cfg.average_dense) == (None, None, True)


@pytest.mark.parametrize("model", ["dlrm", "deepfm"])
@pytest.mark.slow
def test_average_dense_ends_the_run_with_the_mean_over_the_decay_phase(model):
    # 8 steps, a tail of round(8 * 0.5) = 4: the rates are below 1 at steps 5, 6, 7 (0-based)
    cfg = TrainConfig(model=model, steps=8, lr_decay=0.5, eval_every=0, **SMALL)
    plain = Trainer(cfg.replace(average_dense=False))
    after: list[list] = []
    step = plain._train_step

    def record(batch):
        step(batch)
        after.append(_dense(plain))

    plain._train_step = record
    s_plain = plain.fit()
    assert [plain.lr_factor(i) < 1 for i in range(8)] == [False] * 5 + [True] * 3
    oracle = [sum(a[k].double() for a in after[5:]) / 3 for k in range(len(after[0]))]

    avg = Trainer(cfg)
    s_avg = avg.fit()
    for p, o, last in zip(_dense(avg), oracle, after[-1]):
        torch.testing.assert_close(p.double(), o, rtol=0, atol=2e-7)
    assert any(not torch.equal(p, last) for p, last in zip(_dense(avg), after[-1]))
    # averaging reads the trajectory, it does not change it: same losses, same table rows
    assert s_avg["history"]["loss"] == s_plain["history"]["loss"]
    rows = {c.name: s.export() for c, s in avg.collection.stores()}
    for c, store in plain.collection.stores():
        a, b = store.export(), rows[c.name]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.rows, b.rows), c.name
    assert avg.state.dense_average is None  # applied, and not carried into a later snapshot


@pytest.mark.slow
def test_a_run_without_decay_is_not_averaged():
    cfg = TrainConfig(steps=4, lr_decay=0.0, eval_every=0, **SMALL)
    a, b = Trainer(cfg), Trainer(cfg.replace(average_dense=False))
    a.fit(), b.fit()
    assert all(torch.equal(x, y) for x, y in zip(_dense(a), _dense(b)))


@pytest.mark.slow
def test_resume_inside_the_decay_phase_equals_the_uninterrupted_run(tmp_path):
    # 16 steps, tail 8: averaging from step 9 on; the snapshot at step 12 holds 4 steps of the mean
    base = TrainConfig(steps=16, lr_decay=0.5, eval_every=0, **SMALL)
    whole = Trainer(base)
    s_whole = whole.fit()
    first = Trainer(base.replace(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=4, keep_checkpoints=10))
    first.fit()
    shutil.rmtree(tmp_path / "ck" / "step-000000016")
    (tmp_path / "ck" / "LATEST").write_text("step-000000012\n")  # as a run that stopped after step 12 left it
    resumed = Trainer(base.replace(checkpoint_dir=str(tmp_path / "ck"), resume=True))
    s_resumed = resumed.fit()
    assert s_resumed["auc"] == s_whole["auc"] and s_resumed["copc"] == s_whole["copc"]
    assert all(torch.equal(a, b) for a, b in zip(_dense(whole), _dense(resumed)))
    # a run resumed with other Adam settings or without averaging is another run
    with pytest.raises(CheckpointError, match=r"sparse optimizer settings .*'betas': \(0.0, 0.999\).*\(0.9, 0.999\)"):
        Trainer(base.replace(checkpoint_dir=str(tmp_path / "ck"), resume=True, sparse_betas=(0.9, 0.999))).fit()
    with pytest.raises(CheckpointError, match=r"average_dense \(True vs False: give --average-dense as saved\)"):
        Trainer(base.replace(checkpoint_dir=str(tmp_path / "ck"), resume=True, average_dense=False)).fit()


def test_a_record_saved_before_these_settings_keeps_torch_adam_and_the_last_step():
    from hugeembed.training._record import RunRecord, TrainState

    cfg = TrainConfig().to_dict()
    for key in ("sparse_betas", "sparse_eps", "average_dense"):
        del cfg[key]
    state = TrainState().to_dict()
    del state["dense_average"], state["dense_average_steps"]
    rec = RunRecord.from_dict({"config": cfg, "train_state": state}, "old")
    assert (rec.config.sparse_betas, rec.config.sparse_eps, rec.config.average_dense) == ((0.9, 0.999), 1e-8, False)
    assert rec.state.dense_average is None
    bad = {**TrainState().to_dict(), "dense_average": [torch.zeros(2)], "dense_average_steps": 0}
    with pytest.raises(CheckpointError, match="dense_average_steps must be 0 exactly when dense_average is null"):
        TrainState.from_dict(bad, "snap")
    cfg_adagrad = {**cfg, "sparse_optimizer": "adagrad"}
    assert RunRecord.from_dict({"config": cfg_adagrad, "train_state": state}, "old").config.sparse_betas is None


@pytest.mark.slow
def test_a_resume_that_changes_the_runs_length_restarts_the_mean_in_its_own_phase(tmp_path):
    # 10 steps, tail 5: the mean starts at step index 6; the step-8 snapshot holds 2 steps of it
    cfg = TrainConfig(steps=10, lr_decay=0.5, eval_every=0, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=4,
                      keep_checkpoints=10, **SMALL)
    Trainer(cfg).fit()
    shutil.rmtree(tmp_path / "ck" / "step-000000010")
    (tmp_path / "ck" / "LATEST").write_text("step-000000008\n")  # as a run that stopped after step 8 left it
    same = Trainer(cfg.replace(resume=True))
    assert same.resume() and same.state.dense_average_steps == 2
    longer = Trainer(cfg.replace(resume=True, steps=30))  # its decay starts at step 24: the mean is dropped
    assert longer.resume() and longer.state.dense_average is None and longer.state.dense_average_steps == 0
    notes = []
    other = Trainer(cfg.replace(resume=True, steps=12), progress=lambda e, i: notes.append((e, i)))
    assert other.resume() and other.state.dense_average is None  # its phase begins at step 7, not 6
    assert any("dense average restarts at step 9" in i.get("message", "") for e, i in notes if e == "note")


@pytest.mark.slow
def test_a_finished_run_whose_averaged_model_was_not_saved_saves_it_on_resume(tmp_path):
    # an epoch of a text file ends at its last batch: the loop's snapshot of that step holds the
    # mean not yet applied; a process that dies there leaves that snapshot as the newest
    path = tmp_path / "d.tsv"
    write_criteo_tsv(path, 3000, seed=2)
    cfg = TrainConfig(data=(str(path),), steps=None, epochs=1, batch_size=256, eval_rows=512, eval_every=0,
                      lr_decay=0.5, threads=1, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1)
    whole = Trainer(cfg.replace(checkpoint_dir=str(tmp_path / "whole")))
    s_whole = whole.fit()
    dying = Trainer(cfg)

    def die():
        raise KeyboardInterrupt("killed")

    dying._apply_dense_average = die
    with pytest.raises(KeyboardInterrupt):
        dying.fit()
    resumed = Trainer(cfg.replace(resume=True))
    s_resumed = resumed.fit()
    assert s_resumed["steps"] == s_whole["steps"] and s_resumed["auc"] == s_whole["auc"]
    assert all(torch.equal(a, b) for a, b in zip(_dense(whole), _dense(resumed)))
    again = Trainer(cfg.replace(resume=True))  # the snapshot now holds the averaged model
    again.resume()
    assert again.state.dense_average is None
    assert all(torch.equal(a, b) for a, b in zip(_dense(whole), _dense(again)))
