"""Initializer specs (``--init``, make_model's ``initializer=``): what each names, the moments of the rows
it draws against the distributions' closed forms, and one-line errors naming the value."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed.errors import ConfigError
from hugeembed.store import (Normal, TruncatedNormal, Uniform, check_initializer_spec, initializer_from_spec)

KEYS = torch.arange(20_000, dtype=torch.int64) * 7919 + 3  # 20 000 rows x 16 columns: 320 000 values


def _moments(init, seed=5):
    x = init.generate(KEYS, 16, seed).double().flatten()
    return float(x.mean()), float(x.var()), float(x.min()), float(x.max())


def _tol(var: float) -> float:
    return 5 * math.sqrt(var / (KEYS.numel() * 16))  # 5 standard errors of a mean of 320 000 values


@pytest.mark.parametrize("scale", [0.01, 0.5])
def test_uniform_scale_has_the_moments_of_u_minus_s_s(scale):
    init = initializer_from_spec(f"uniform:{scale}", None)
    assert init == Uniform(-scale, scale)
    mean, var, lo, hi = _moments(init)
    want_var = scale**2 / 3  # (b - a)^2 / 12 with b - a = 2 s
    assert abs(mean) < _tol(want_var)
    assert var == pytest.approx(want_var, rel=0.01)
    assert -scale <= lo and hi <= scale and lo < -0.99 * scale and hi > 0.99 * scale


def test_normal_std_has_the_moments_of_n_0_std():
    init = initializer_from_spec("normal:0.02", None)
    assert init == Normal(0.0, 0.02)
    mean, var, _, _ = _moments(init)
    assert abs(mean) < _tol(0.02**2)
    assert var == pytest.approx(0.02**2, rel=0.01)


def test_truncnormal_std_has_the_variance_of_a_normal_cut_at_two_std():
    init = initializer_from_spec("truncnormal:0.25", None)
    assert init == TruncatedNormal(0.0, 0.25)
    mean, var, lo, hi = _moments(init)
    # Var of N(0, s^2) restricted to [-2s, 2s]: s^2 (1 - 2 * 2 phi(2) / (2 Phi(2) - 1))
    phi2 = math.exp(-2.0) / math.sqrt(2 * math.pi)
    mass = math.erf(2 / math.sqrt(2))
    want = 0.25**2 * (1 - 4 * phi2 / mass)
    assert var == pytest.approx(want, rel=0.01) and abs(mean) < _tol(want)
    assert -0.5 <= lo and hi <= 0.5


@pytest.mark.parametrize("rows", [1, 4, 1000, 10_000_000])
def test_uniform_alone_scales_by_the_tables_rows(rows):
    init = initializer_from_spec("uniform", rows, table="C3")
    bound = math.sqrt(1.0 / rows)
    assert init == Uniform(-bound, bound)
    _, var, lo, hi = _moments(init)
    assert var == pytest.approx(bound**2 / 3, rel=0.01) and -bound <= lo and hi <= bound


def test_uniform_alone_on_an_unbounded_dynamic_table_names_the_table_and_the_fix():
    with pytest.raises(ConfigError, match=r"table 'C3'.*'uniform'.*capacity") as e:
        initializer_from_spec("uniform", None, table="C3")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", ["gaussian:0.1", "uniform:", "normal", "normal:abc", "normal:-1", "truncnormal:0",
                                  "uniform:nan", "uniform:inf", "", ":0.1", "Uniform:0.1"])
def test_a_bad_spec_is_one_line_naming_the_key_and_the_value(spec):
    with pytest.raises(ConfigError) as e:
        check_initializer_spec(spec, "init")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("init") and repr(spec) in msg, msg


@settings(max_examples=50, deadline=None)
@given(kind=st.sampled_from(["uniform", "normal", "truncnormal"]),
       scale=st.floats(min_value=1e-6, max_value=10.0, allow_nan=False, allow_infinity=False))
def test_every_positive_scale_round_trips_through_its_spec(kind, scale):
    init = initializer_from_spec(f"{kind}:{scale!r}", None)
    if kind == "uniform":
        assert (init.low, init.high) == (-scale, scale)
    else:
        assert init.std == scale and init.mean == 0.0
    rows = init.generate(torch.arange(64), 4, 0)
    bound = scale if kind == "uniform" else 2 * scale if kind == "truncnormal" else math.inf
    assert bool(rows.abs().max() <= bound * (1 + 1e-6))
