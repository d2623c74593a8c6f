"""End-to-end training on synthetic data: it learns, is deterministic, resumes exactly, and eval reproduces it."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from hugeembed import ConfigError
from hugeembed.training import TrainConfig, Trainer, evaluate_snapshot

SMALL = dict(batch_size=256, eval_rows=2048, synthetic_max_cardinality=20_000, log_every=5, threads=1)


def tables(trainer):
    return {c.name: s.export() for c, s in trainer.collection.stores()}


@pytest.mark.slow
def test_dlrm_learns_well_above_chance_and_loss_decreases():
    s = Trainer(TrainConfig(model="dlrm", steps=250, eval_every=125, **SMALL)).fit()
    assert s["auc"] > 0.72, s["auc"]  # chance is 0.5; the true model reaches s["bayes_auc"] ~0.85
    assert s["auc"] < s["bayes_auc"] + 0.01
    losses = s["history"]["loss"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.02
    assert s["history"]["auc"][-1] > s["history"]["auc"][0]
    assert 0.8 < s["copc"] < 1.25 and abs(s["ctr"] - 0.25) < 0.05
    assert s["table_rows"] > 0 and s["samples"] == 250 * 256


@pytest.mark.parametrize("model", ["deepfm", "widedeep", "dcn"])
@pytest.mark.slow
def test_other_models_train(model):
    s = Trainer(TrainConfig(model=model, steps=40, eval_every=0, **SMALL)).fit()
    assert s["auc"] > 0.6 and s["steps"] == 40


@pytest.mark.slow
def test_same_seed_same_run_different_seed_different_run():
    cfg = TrainConfig(steps=15, eval_every=0, **SMALL)
    a, b = Trainer(cfg), Trainer(cfg)
    sa, sb = a.fit(), b.fit()
    assert sa["auc"] == sb["auc"] and sa["history"]["loss"] == sb["history"]["loss"]
    ta, tb = tables(a), tables(b)
    assert all(torch.equal(ta[k].rows, tb[k].rows) for k in ta)
    sc = Trainer(cfg.replace(seed=1)).fit()
    assert sc["history"]["loss"] != sa["history"]["loss"]


@pytest.mark.slow
def test_init_seed_changes_the_model_not_the_data():
    """--init-seed: another init on the same samples (the noise floor of a comparison); equal to seed: the
    seed's run bit for bit."""
    cfg = TrainConfig(steps=4, eval_every=0, **SMALL)
    runs = {name: Trainer(c) for name, c in (("seed", cfg), ("same", cfg.replace(init_seed=0)),
                                                ("other", cfg.replace(init_seed=7)))}
    batches = {name: [b.labels for b in itertools.islice(t.source.train_batches(0), 3)] for name, t in runs.items()}
    dense = {name: next(t.model.parameters()).detach().clone() for name, t in runs.items()}
    fits = {name: t.fit() for name, t in runs.items()}
    assert fits["same"]["history"]["loss"] == fits["seed"]["history"]["loss"]
    assert fits["other"]["history"]["loss"] != fits["seed"]["history"]["loss"]
    assert all(torch.equal(a, b) for a, b in zip(batches["seed"], batches["other"]))
    assert torch.equal(dense["seed"], dense["same"]) and not torch.equal(dense["seed"], dense["other"])
    assert cfg.to_dict().get("init_seed", "absent") == "absent"  # snapshots of runs without it: as older code wrote
    assert cfg.replace(init_seed=7).to_dict()["init_seed"] == 7


@pytest.mark.slow
def test_checkpoint_resume_equals_uninterrupted_and_eval_reproduces(tmp_path):
    base = TrainConfig(steps=24, eval_every=12, **SMALL)
    whole = Trainer(base)
    s_whole = whole.fit()

    # a run that stopped after its step-10 snapshot: the same run (its lr decay follows the run's
    # length, so a 10-step run would be another run), its later snapshots gone
    first = Trainer(base.replace(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5, keep_checkpoints=10))
    first.fit()
    for late in ("step-000000015", "step-000000020", "step-000000024"):
        shutil.rmtree(tmp_path / "ck" / late)
    (tmp_path / "ck" / "LATEST").write_text("step-000000010\n")  # as that run left it
    resumed = Trainer(base.replace(checkpoint_dir=str(tmp_path / "ck"), resume=True))
    s_resumed = resumed.fit()

    assert s_resumed["steps"] == 24
    assert s_resumed["auc"] == s_whole["auc"] and s_resumed["logloss"] == s_whole["logloss"]
    tw, tr = tables(whole), tables(resumed)
    for k in tw:
        assert torch.equal(tw[k].keys, tr[k].keys) and torch.equal(tw[k].rows, tr[k].rows), k
    for a, b in zip(whole.model.dense_parameters(), resumed.model.dense_parameters()):
        assert torch.equal(a, b)
    m = evaluate_snapshot(tmp_path / "ck")  # the final snapshot, scored again
    assert m["step"] == 24
    for key in ("auc", "logloss", "ctr", "pctr", "copc"):
        assert m[key] == s_resumed[key], key


def test_resume_refuses_a_different_run(tmp_path):
    Trainer(TrainConfig(steps=3, eval_every=0, checkpoint_dir=str(tmp_path), **SMALL)).fit()
    with pytest.raises(Exception, match=r"different embedding_dim \(16 vs 8\)"):
        Trainer(TrainConfig(steps=6, eval_every=0, checkpoint_dir=str(tmp_path), resume=True, embedding_dim=8,
                            **SMALL)).fit()


def test_config_errors_and_toml(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'gpt'"):
        TrainConfig(model="gpt")
    with pytest.raises(ConfigError, match="batch-size must be a positive integer, got 0"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="--resume needs --checkpoint-dir"):
        TrainConfig(resume=True)
    with pytest.raises(ConfigError, match="sparse-lr must be a positive number"):
        TrainConfig(sparse_lr=-1.0)
    f = tmp_path / "run.toml"
    f.write_text('[train]\nmodel = "deepfm"\nbatch_size = 128\nsteps = 7\n')
    cfg = TrainConfig.from_toml(f, steps=9)
    assert (cfg.model, cfg.batch_size, cfg.steps) == ("deepfm", 128, 9)
    f.write_text('[train]\nbatch_sise = 128\n')
    with pytest.raises(ConfigError, match=r"unknown settings \['batch_sise'\]"):
        TrainConfig.from_toml(f)
    f.write_text('[train\n')
    with pytest.raises(ConfigError, match="not valid TOML"):
        TrainConfig.from_toml(f)


@pytest.mark.slow
def test_trains_on_criteo_files_with_held_out_rows(tmp_path):
    from hugeembed.data import SyntheticConfig, write_criteo_tsv

    write_criteo_tsv(tmp_path / "day0.tsv.gz", 6000, config=SyntheticConfig(seed=3, max_cardinality=2000))
    s = Trainer(TrainConfig(data=(str(tmp_path / "day0.tsv.gz"),), steps=None, epochs=2, eval_every=0,
                            **{**SMALL, "eval_rows": 1024})).fit()
    assert s["steps"] == 2 * (6000 // 256 - 4)  # 4 batches held out for evaluation
    assert s["count"] == 1024 and s["auc"] > 0.55
