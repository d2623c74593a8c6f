"""Every key of a train config with a value of the wrong type fails when the config is read: one line naming
the key, the value and what it must be (TOML via --config and flags), never later in the run."""

from __future__ import annotations

import dataclasses

import pytest

from hugeembed.errors import ConfigError
from hugeembed.training import MODELS, SPARSE_OPTIMIZERS, TrainConfig
from hugeembed.models import MODEL_NAMES
from hugeembed.optim import make_optimizer
from clihelp import assert_one_line_error, run_cli as cli

# key -> a TOML value of the wrong type (or shape) for it; every field of TrainConfig must appear here
BAD = {
    "model": "5", "data": "5", "eval_data": "{ a = 1 }", "embedding_dim": "1.5", "batch_size": "'64'",
    "steps": "true", "epochs": "1.5", "sparse_optimizer": "5", "sparse_lr": "'fast'", "dense_optimizer": "[1]",
    "dense_lr": "-1.0", "eval_every": "-1", "eval_rows": "0", "eval_fraction": "true",
    "checkpoint_dir": "5", "checkpoint_every": "1.5", "full_checkpoint_every": "0", "keep_checkpoints": "'3'",
    "resume": "'yes'", "overwrite": "1", "size_from_data": "'no'",
    "seed": "1.5", "init_seed": "-1", "capacity": "0", "synthetic_rows": "[]", "synthetic_max_cardinality": "1e3",
    "device": "'cuda:abc'", "threads": "'2'", "prefetch": "-1", "log_every": "0", "sharding": "5",
    "memory_per_rank": "1.5", "dist_timeout": "'soon'", "staleness": "-1", "dense_staleness": "1.5",
    "stale_scale": "'on'", "stale_compensation": "-1.0", "jitter": "'0.2'",
    "data_queue": "0", "servers": "-1", "memory_budget": "1.5", "storage_dir": "5",
    "cache_policy": "'fifo'", "init": "'gaussian:0.1'", "admit_min_count": "0", "lr_count_scale": "1.5", "lr_decay": "1.5",
    "sparse_betas": "[0.9]", "sparse_eps": "0", "average_dense": "'on'", "schema": "5", "first_order": "1", "first_order_lr": "'fast'",
    "first_order_betas": "[0.9]", "first_order_eps": "0", "dropout": "1.0", "click_counts": "1",
    "first_order_admit_min_count": "0", "first_order_lr_count_scale": "1.5",
    "choose_epochs": "0", "choose_holdout": "1.5",
}


def test_every_config_key_is_in_the_table():
    assert set(BAD) == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize("key", sorted(BAD))
def test_wrong_type_in_toml_fails_when_read_naming_key_and_value(tmp_path, key):
    path = tmp_path / "c.toml"
    path.write_text(f"[train]\n{key} = {BAD[key]}\n")
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_toml(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and (key in msg or key.replace("_", "-") in msg), msg
    assert "must" in msg or "unknown" in msg, msg


def test_train_that_is_not_a_table(tmp_path):
    (tmp_path / "c.toml").write_text("train = 5\n")
    with pytest.raises(ConfigError, match="train must be a table"):
        TrainConfig.from_toml(tmp_path / "c.toml")


def test_name_lists_come_from_the_registries():
    assert MODELS == MODEL_NAMES
    for name in SPARSE_OPTIMIZERS:  # every listed name builds, and the list is the registry's
        make_optimizer(name, lr=0.1)
    from hugeembed.optim._registry import NAMES
    assert tuple(NAMES) == SPARSE_OPTIMIZERS


def test_column_wise_tables_take_delta_snapshots():
    assert TrainConfig(sharding=("C2=row_wise", "C1=column_wise@0,1"), full_checkpoint_every=4).full_checkpoint_every \
        == 4


def test_a_single_path_string_is_one_path():
    assert TrainConfig(data="x.tsv").data == ("x.tsv",)
    assert TrainConfig(sharding="C1=row_wise").sharding == ("C1=row_wise",)


@pytest.mark.parametrize("toml,fragments", [
    ("seed = 1.5", ["seed", "1.5", "non-negative integer"]),
    ("device = 'cuda:abc'", ["device", "'cuda:abc'", "cuda:N"]),
    ("data = 5", ["data", "5", "path"]),
    ("train = 5", ["train", "5", "table"]),
    ("sharding = 5", ["sharding", "5"]),
    ("checkpoint_dir = 5", ["checkpoint-dir", "5", "directory path"]),
])
def test_cli_reports_a_bad_config_in_one_line(tmp_path, toml, fragments):
    (tmp_path / "c.toml").write_text(toml + "\n")
    proc = cli("train", "--config", tmp_path / "c.toml", "--steps", "1", "--quiet", cwd=tmp_path)
    assert_one_line_error(proc, "c.toml", *fragments)
    assert not any(p.name != "c.toml" for p in tmp_path.iterdir())  # nothing written


def test_cli_device_flag_is_checked(tmp_path):
    assert_one_line_error(cli("train", "--device", "cuda:abc", "--steps", "1", cwd=tmp_path), "device", "cuda:abc")
