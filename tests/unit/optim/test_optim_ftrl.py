"""FTRL against TensorFlow's per-coordinate FTRL update written out in NumPy (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from hugeembed.errors import ConfigError
from hugeembed.optim import FTRL

from ._optim_oracles import make_problem, run_ours

D = 5


def ftrl_numpy(w0, steps, *, lr_power, acc0, l1, l2, l2_shrinkage, beta):
    """TF 2.x SparseApplyFtrlV2 (multiply_linear_by_lr=False) with Keras' beta folded into l2.

    Per coordinate:  gs = g + 2 l2_shrinkage w;  n' = n + g^2;
    z += gs - (n'^-p - n^-p) / lr * w;  w = (clip(z, -l1, l1) - z) / (n'^-p / lr + 2 (l2 + beta / (2 lr)))
    with p = lr_power, and n = n'.
    """
    w = w0.numpy().copy()
    n = np.full_like(w, acc0)
    z = np.zeros_like(w)
    for st in steps:
        slots, grad = st.summed()
        lr = st.lr
        adj_l2 = l2 + beta / (2.0 * lr)
        for s, g in zip(slots.tolist(), grad.numpy()):
            gs = g + 2.0 * l2_shrinkage * w[s]
            n_new = n[s] + g * g
            sigma = (n_new ** -lr_power - n[s] ** -lr_power) / lr
            z[s] = z[s] + gs - sigma * w[s]
            quadratic = n_new ** -lr_power / lr + 2.0 * adj_l2
            w[s] = np.where(np.abs(z[s]) > l1, (np.sign(z[s]) * l1 - z[s]) / quadratic, 0.0)
            n[s] = n_new
    return torch.from_numpy(w), torch.from_numpy(n), torch.from_numpy(z)


CASES = [
    dict(lr_power=-0.5, acc0=0.1, l1=0.0, l2=0.0, l2_shrinkage=0.0, beta=0.0),
    dict(lr_power=-0.5, acc0=0.1, l1=0.3, l2=0.2, l2_shrinkage=0.0, beta=0.0),
    dict(lr_power=-0.5, acc0=0.5, l1=0.05, l2=0.1, l2_shrinkage=0.2, beta=1.0),
    dict(lr_power=-0.7, acc0=0.2, l1=0.1, l2=0.0, l2_shrinkage=0.1, beta=0.5),
    dict(lr_power=0.0, acc0=0.0, l1=0.0, l2=0.3, l2_shrinkage=0.0, beta=0.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_ftrl_matches_tf_formula(precision, device, case):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=10, lr=0.2)
    opt = FTRL(lr=0.2, lr_power=case["lr_power"], initial_accumulator_value=case["acc0"], l1=case["l1"],
               l2=case["l2"], l2_shrinkage=case["l2_shrinkage"], beta=case["beta"])
    ours = run_ours(opt, w0, steps, dtype=dtype, device=device)
    want_w, want_n, want_z = ftrl_numpy(w0, steps, **case)
    assert_close(ours[:, :D], want_w, rtol=rtol, atol=atol)
    assert_close(ours[:, D:2 * D], want_n, rtol=rtol, atol=atol)
    assert_close(ours[:, 2 * D:], want_z, rtol=rtol, atol=atol)


def test_ftrl_l1_makes_weights_exactly_zero():
    w0, steps = make_problem(dim=D, n_steps=4, lr=0.2)
    ours = run_ours(FTRL(lr=0.2, l1=3.0), w0, steps, dtype=torch.float32)
    touched = sorted({int(i) for st in steps for i in st.ids})
    w, z = ours[touched, :D], ours[touched, 2 * D:]
    inside = z.abs() <= 3.0
    assert 0 < int(inside.sum()) < inside.numel()
    assert (w[inside] == 0).all() and (w[~inside] != 0).all()


def test_ftrl_init_state_and_runtime_lr():
    opt = FTRL(lr=0.1, initial_accumulator_value=0.25)
    state = torch.full((3, opt.state_width(4)), 7.0)
    opt.init_state(state)
    assert state[:, :4].eq(0.25).all() and state[:, 4:].eq(0).all()
    storage = torch.zeros(2, 4 + 8)
    with pytest.raises(ConfigError, match="runtime lr must be > 0"):
        opt.apply(storage, torch.tensor([0]), torch.ones(1, 4), lr=0.0, step=1)
