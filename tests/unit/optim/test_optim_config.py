"""Optimizer configs: validation, state widths, init_state, make_optimizer, to_dict/from_dict."""

from __future__ import annotations

import json

import pytest
import torch

import hugeembed.optim as optim
from hugeembed.errors import ConfigError
from hugeembed.optim import FTRL, SGD, Adagrad, Adam, MomentumSGD, RowWiseAdagrad, SparseOptimizer, make_optimizer

BAD = [
    (SGD, dict(lr=-0.1), "lr", "-0.1"),
    (SGD, dict(lr=float("nan")), "lr", "nan"),
    (SGD, dict(lr="0.1"), "lr", "'0.1'"),
    (SGD, dict(lr=0.1, weight_decay=-1), "weight_decay", "-1"),
    (MomentumSGD, dict(lr=0.1, momentum=1.0), "momentum", "1.0"),
    (MomentumSGD, dict(lr=0.1, momentum=-0.5), "momentum", "-0.5"),
    (MomentumSGD, dict(lr=0.1, momentum=0.0, nesterov=True), "nesterov", "momentum=0.0"),
    (MomentumSGD, dict(lr=0.1, nesterov=1), "nesterov", "1"),
    (Adagrad, dict(lr=0.1, eps=0.0), "eps", "0.0"),
    (Adagrad, dict(lr=0.1, lr_decay=-0.1), "lr_decay", "-0.1"),
    (Adagrad, dict(lr=0.1, initial_accumulator_value=-1.0), "initial_accumulator_value", "-1.0"),
    (RowWiseAdagrad, dict(lr=0.1, eps=-1e-8), "eps", "-1e-08"),
    (Adam, dict(betas=(0.9, 1.0)), "betas[1]", "1.0"),
    (Adam, dict(betas=(-0.1, 0.999)), "betas[0]", "-0.1"),
    (Adam, dict(betas=(0.9,)), "betas", "(0.9,)"),
    (Adam, dict(eps=0), "eps", "0"),
    (Adam, dict(mode="dense"), "mode", "'dense'"),
    (Adam, dict(bias_correction="row"), "bias_correction", "'row'"),
    (Adam, dict(epsilon="keras"), "epsilon", "'keras'"),
    (Adam, dict(mode="global", bias_correction="per_row"), "bias_correction", "'per_row'"),
    (Adam, dict(mode="global", weight_decay=0.1), "weight_decay", "decoupled_weight_decay=True"),
    (FTRL, dict(lr=0.0), "lr", "0.0"),
    (FTRL, dict(lr=0.1, lr_power=0.5), "lr_power", "0.5"),
    (FTRL, dict(lr=0.1, l1=-1.0), "l1", "-1.0"),
    (FTRL, dict(lr=0.1, l2_shrinkage=-1.0), "l2_shrinkage", "-1.0"),
    (FTRL, dict(lr=0.1, beta=float("inf")), "beta", "inf"),
]


@pytest.mark.parametrize("rule,kwargs,field,value", BAD, ids=lambda x: str(x)[:40])
def test_bad_config_names_optimizer_field_and_value(rule, kwargs, field, value):
    with pytest.raises(ConfigError) as err:
        rule(**kwargs)
    msg = str(err.value)
    assert rule.__name__ in msg and field in msg and value in msg, msg


def test_configs_are_frozen_and_normalised():
    opt = Adam(lr=1, betas=[0.5, 0.6])
    assert opt.lr == 1.0 and isinstance(opt.lr, float) and opt.betas == (0.5, 0.6)
    with pytest.raises(AttributeError):
        opt.lr = 0.5  # type: ignore[misc]


@pytest.mark.parametrize("opt,width", [
    (SGD(lr=0.1), 0),
    (MomentumSGD(lr=0.1), 7),
    (Adagrad(lr=0.1), 7),
    (RowWiseAdagrad(lr=0.1), 1),
    (Adam(), 14),
    (Adam(bias_correction="per_row"), 15),
    (Adam(mode="global"), 15),
    (FTRL(lr=0.1), 14),
])
def test_state_width(opt, width):
    assert opt.state_width(7) == width


def test_init_state_fills_initial_values():
    state = torch.full((4, 3), 9.0)
    Adagrad(lr=0.1, initial_accumulator_value=0.3).init_state(state)
    assert state.eq(0.3).all()
    row = torch.full((4, 1), 9.0)
    RowWiseAdagrad(lr=0.1, initial_accumulator_value=0.2).init_state(row)
    assert torch.allclose(row, torch.full_like(row, 0.2))
    adam = torch.full((4, 7), 9.0)
    Adam(mode="global").init_state(adam)
    assert adam.eq(0).all()
    with pytest.raises(ValueError, match="state columns"):
        Adam(mode="global").init_state(torch.zeros(4, 6))


ALL_NAMES = ["sgd", "momentum", "nesterov", "adagrad", "rowwise_adagrad", "adam", "lazy_adam", "global_adam", "ftrl"]


def test_make_optimizer_by_name():
    assert make_optimizer("sgd", lr=0.1) == SGD(lr=0.1)
    assert make_optimizer("nesterov", lr=0.1) == MomentumSGD(lr=0.1, nesterov=True)
    assert make_optimizer("global_adam") == Adam(mode="global")
    assert make_optimizer("lazy_adam", bias_correction="per_row") == Adam(bias_correction="per_row")
    for name in ALL_NAMES:
        assert isinstance(make_optimizer(name, lr=0.1), SparseOptimizer)


def test_make_optimizer_errors():
    with pytest.raises(ConfigError) as err:
        make_optimizer("adamw", lr=0.1)
    assert all(name in str(err.value) for name in ALL_NAMES)
    with pytest.raises(ConfigError, match="momentum_decay"):
        make_optimizer("momentum", lr=0.1, momentum_decay=0.1)
    with pytest.raises(ConfigError, match="implies mode='global'"):
        make_optimizer("global_adam", mode="lazy")
    with pytest.raises(ConfigError, match="lr"):
        make_optimizer("sgd")
    with pytest.raises(ConfigError, match="has no option name"):
        make_optimizer("sgd", lr=0.1, name="adam")


EVERY = [
    SGD(lr=0.1, weight_decay=1e-5),
    MomentumSGD(lr=0.3, momentum=0.95, nesterov=True, weight_decay=0.01),
    Adagrad(lr=0.1, initial_accumulator_value=0.1, eps=1e-7, lr_decay=1e-3, weight_decay=2e-4),
    RowWiseAdagrad(lr=0.02, eps=1e-6, initial_accumulator_value=0.01, weight_decay=0.1),
    Adam(lr=0.1 + 0.2, betas=(0.85, 0.9995), eps=1e-7, weight_decay=0.3, decoupled_weight_decay=True,
         mode="global", epsilon="tf"),
    Adam(bias_correction="per_row"),
    FTRL(lr=0.05, lr_power=-0.7, initial_accumulator_value=0.2, l1=1e-3, l2=2e-3, l2_shrinkage=1e-4, beta=1.0),
]


@pytest.mark.parametrize("opt", EVERY, ids=lambda o: o.name)
def test_to_dict_from_dict_round_trips_through_json(opt):
    data = json.loads(json.dumps(opt.to_dict()))
    assert data["name"] == opt.name
    again = SparseOptimizer.from_dict(data)
    assert again == opt and type(again) is type(opt)
    assert type(opt).from_dict(data) == opt
    assert again.to_dict() == opt.to_dict()


def test_from_dict_rejects_bad_data():
    data = Adam().to_dict()
    with pytest.raises(ConfigError, match="unknown config keys \\['amsgrad'\\]"):
        SparseOptimizer.from_dict({**data, "amsgrad": True})
    with pytest.raises(ConfigError, match="not 'sgd'"):
        SGD.from_dict(data)
    with pytest.raises(ConfigError, match="unknown name 'adamax'"):
        SparseOptimizer.from_dict({"name": "adamax", "lr": 0.1})
    with pytest.raises(ConfigError, match="lr"):
        SparseOptimizer.from_dict({"name": "sgd"})
    with pytest.raises(ConfigError, match="betas\\[1\\]"):
        SparseOptimizer.from_dict({**data, "betas": [0.9, 2.0]})


def test_public_surface():
    assert sorted(optim.__all__) == sorted(
        ["SparseOptimizer", "SGD", "MomentumSGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL", "make_optimizer"])
