"""The learning-quality flags of `hugeembed train` (--init, --admit-min-count, --lr-count-scale, --lr-decay):
a bad value is one line naming the flag and the value (exit 2, nothing trained); good ones reach the tables."""

from __future__ import annotations

import argparse

import pytest
import torch

from clihelp import assert_one_line_error, run_cli
from hugeembed.cli.train import add_parser, config_from_args
from hugeembed.models import DEFAULT_ADMIT_MIN_COUNT, DEFAULT_INITIALIZER
from hugeembed.store import Uniform
from hugeembed.training import TrainConfig
from hugeembed.training import build_model

Q = ["--steps", "1", "--quiet", "--threads", "1", "--batch-size", "64", "--eval-rows", "128"]


@pytest.mark.parametrize("flags, fragments", [
    (["--init", "gaussian:0.1"], ["init", "'gaussian:0.1'", "uniform:SCALE"]),
    (["--init", "normal:-2"], ["init", "'normal:-2'", "positive"]),
    (["--init", "uniform"], ["table 'C1'", "'uniform'", "capacity"]),  # U(+-sqrt(1/n)) needs n
    (["--admit-min-count", "0"], ["admit-min-count", "0"]),
    (["--admit-min-count", "two"], ["--admit-min-count", "'two'"]),
    (["--lr-count-scale", "-3"], ["lr-count-scale", "-3"]),
    (["--lr-decay", "1.5"], ["lr-decay", "1.5"]),
    (["--choose-epochs", "0"], ["choose-epochs", "0"]),
    (["--choose-holdout", "1.5"], ["choose-holdout", "1.5"]),
    (["--choose-epochs", "3"], ["choose-epochs", "steps=1"]),  # Q's --steps: the run's length given twice
])
def test_a_bad_quality_flag_is_one_line_naming_flag_and_value(tmp_path, flags, fragments):
    proc = run_cli("train", *Q, *flags, "--summary-json", tmp_path / "s.json", cwd=tmp_path)
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "s.json").exists()


def _config(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["train", *argv]))


def test_the_flags_reach_every_table():
    cfg = _config("--init", "uniform:0.2", "--admit-min-count", "4", "--lr-count-scale", "6")
    model, _ = build_model(cfg, torch.device("cpu"))
    for t in model.embeddings.tables:
        assert t.initializer == Uniform(-0.2, 0.2)
        assert (t.admit_min_count, t.shared_row, t.lr_count_scale) == (4, True, 6)


def test_without_flags_the_tables_take_the_measured_defaults():
    cfg = _config()
    model, _ = build_model(cfg, torch.device("cpu"))
    kind, _, scale = DEFAULT_INITIALIZER.partition(":")
    for t in model.embeddings.tables:
        assert kind == "uniform" and t.initializer == Uniform(-float(scale), float(scale))
        assert (t.admit_min_count, t.shared_row, t.lr_count_scale) == (DEFAULT_ADMIT_MIN_COUNT, True, None)
    # --admit-min-count 1: a row at first sight, no shared row (the store's plain behaviour)
    model, _ = build_model(_config("--admit-min-count", "1"), torch.device("cpu"))
    assert {(t.admit_min_count, t.shared_row) for t in model.embeddings.tables} == {(1, False)}


def test_choose_epochs_sets_the_run_length_in_passes():
    cfg = _config("--data", "clicks.csv", "--choose-epochs", "4", "--choose-holdout", "0.2")
    assert (cfg.steps, cfg.choose_epochs, cfg.choose_holdout) == (None, 4, 0.2)
    assert _config("--data", "clicks.csv").choose_epochs is None  # off unless asked (docs/quality.md)
