"""TableConfig.describe(): every field, so ranks comparing it cannot disagree on one undetected."""

from __future__ import annotations

import dataclasses
import json

import torch

from hugeembed.nn import TableConfig
from hugeembed.optim import SGD, Adagrad
from hugeembed.store import Normal, Uniform

BASE = TableConfig("t", dim=4)
# one other valid value per field (a dynamic table's fields; static-only ones on a static base)
OTHER = dict(name="t2", dim=8, features=("a", "b"), combiner="sum", initializer=Uniform(-0.1, 0.1),
             optimizer=SGD(lr=0.1), trainable=False, max_norm=1.0, default_id=3, out_of_range="prune",
             prune_negative=False, dtype=torch.float64, capacity=100, on_full="error", eviction_policy="lru",
             admit_min_count=2, admit_probability=0.5, max_pending=10, ttl=5, evict_norm_below=0.1,
             evict_interval=7, seed=11, state_dtype=torch.float16, stochastic_rounding=True,
             storage_dir="/other", memory_budget=2048, cache_policy="lru", shared_row=True, lr_count_scale=4)
TIERED = TableConfig("t", dim=4, storage_dir="/tier", memory_budget=1024)


def test_describe_has_every_field_and_is_plain_data():
    d = BASE.describe()
    assert set(d) == {f.name for f in dataclasses.fields(TableConfig)}
    json.dumps(d)  # manifests and the ranks' comparison need plain data


def test_a_change_in_any_one_field_changes_describe():
    fields = {f.name for f in dataclasses.fields(TableConfig)}
    assert fields - {"num_rows"} == set(OTHER), "give every new field an alternative value here"
    for name, value in OTHER.items():
        base = {"out_of_range": TableConfig("t", dim=4, num_rows=10),  # static tables only
                "stochastic_rounding": TableConfig("t", dim=4, dtype=torch.float16),  # 16-bit only
                "state_dtype": TableConfig("t", dim=4, dtype=torch.float16),
                "storage_dir": TIERED, "memory_budget": TIERED}.get(name, BASE)  # together only
        assert dataclasses.replace(base, **{name: value}).describe() != base.describe(), name
    static = TableConfig("t", dim=4, num_rows=10)
    assert dataclasses.replace(static, num_rows=11).describe() != static.describe()


def test_equal_configs_describe_equally_initializers_and_optimizers_by_value():
    a = TableConfig("t", dim=4, initializer=Normal(0.0, 0.1), optimizer=Adagrad(lr=0.1))
    b = TableConfig("t", dim=4, initializer=Normal(0.0, 0.1), optimizer=Adagrad(lr=0.1))
    assert a.describe() == b.describe()
    assert a.describe() != dataclasses.replace(a, initializer=Normal(0.0, 0.2)).describe()
