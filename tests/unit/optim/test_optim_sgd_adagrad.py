"""SGD, momentum, Nesterov, Adagrad and row-wise Adagrad against torch.optim / their formulas (float64)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from hugeembed.optim import SGD, Adagrad, MomentumSGD, RowWiseAdagrad

from ._optim_oracles import make_problem, per_row_oracle, run_ours, table_oracle

D = 5


def test_sgd_matches_dense_torch_sgd(precision, device):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D)
    ours = run_ours(SGD(lr=0.1), w0, steps, dtype=dtype, device=device)
    # Dense SGD with zero gradient rows: untouched rows do not move either.
    want, _ = table_oracle(w0, steps, lambda p: torch.optim.SGD(p, lr=0.1), sparse=False)
    assert_close(ours, want, rtol=rtol, atol=atol)


def test_sgd_weight_decay_is_lazy(precision, device):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D)
    ours = run_ours(SGD(lr=0.1, weight_decay=0.2), w0, steps, dtype=dtype, device=device)
    want, _ = per_row_oracle(w0, steps, lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.2))
    assert_close(ours, want, rtol=rtol, atol=atol)
    never = sorted(set(range(w0.shape[0])) - {int(i) for st in steps for i in st.ids})
    assert never, "the problem should leave some rows untouched"
    assert_close(ours[never], w0[never].to(dtype).double(), rtol=0, atol=0)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_momentum_matches_torch_sgd_per_row(precision, device, nesterov, weight_decay):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=10)
    opt = MomentumSGD(lr=0.1, momentum=0.8, nesterov=nesterov, weight_decay=weight_decay)
    ours = run_ours(opt, w0, steps, dtype=dtype, device=device)
    want, torch_opt = per_row_oracle(w0, steps, lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.8, nesterov=nesterov, weight_decay=weight_decay, dampening=0.0))
    assert_close(ours[:, :D], want, rtol=rtol, atol=atol)
    for r, p in enumerate(torch_opt.param_groups[0]["params"]):
        buf = torch_opt.state[p].get("momentum_buffer") if p in torch_opt.state else None
        assert_close(ours[r, D:], buf if buf is not None else torch.zeros(D, dtype=torch.float64),
                     rtol=rtol, atol=atol)


def test_adagrad_matches_torch_sparse_adagrad(precision, device):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=10)
    opt = Adagrad(lr=0.1, initial_accumulator_value=0.2, eps=1e-6, lr_decay=0.05)
    ours = run_ours(opt, w0, steps, dtype=dtype, device=device)
    want, torch_opt = table_oracle(w0, steps, lambda p: torch.optim.Adagrad(
        p, lr=0.1, initial_accumulator_value=0.2, eps=1e-6, lr_decay=0.05), sparse=True)
    assert_close(ours[:, :D], want, rtol=rtol, atol=atol)
    (state,) = torch_opt.state.values()
    assert_close(ours[:, D:], state["sum"], rtol=rtol, atol=atol)


def test_adagrad_weight_decay_matches_torch_per_row(precision, device):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=10)
    opt = Adagrad(lr=0.1, initial_accumulator_value=0.1, weight_decay=0.3)
    ours = run_ours(opt, w0, steps, dtype=dtype, device=device)
    want, _ = per_row_oracle(w0, steps, lambda p: torch.optim.Adagrad(
        p, lr=0.1, initial_accumulator_value=0.1, weight_decay=0.3))
    assert_close(ours[:, :D], want, rtol=rtol, atol=atol)


def rowwise_adagrad_numpy(w0, steps, *, lr_scale=1.0, eps, acc0, wd):
    """FBGEMM EXACT_ROWWISE_ADAGRAD (weight_decay_mode L2), written out per row in float64."""
    w = w0.numpy().copy()
    acc = np.full(w.shape[0], acc0)
    for st in steps:
        slots, grad = st.summed()
        for s, g in zip(slots.tolist(), grad.numpy()):
            gp = g + wd * w[s]
            acc[s] += np.mean(gp * gp)
            mult = st.lr * lr_scale / (np.sqrt(acc[s]) + eps)
            w[s] = (1.0 - mult * wd) * w[s] - mult * g
    return torch.from_numpy(w), torch.from_numpy(acc)


@pytest.mark.parametrize("weight_decay", [0.0, 0.2])
def test_rowwise_adagrad_matches_formula(precision, device, weight_decay):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=10)
    opt = RowWiseAdagrad(lr=0.1, initial_accumulator_value=0.05, weight_decay=weight_decay)
    assert opt.eps == 1e-8  # FBGEMM's default
    ours = run_ours(opt, w0, steps, dtype=dtype, device=device)
    want_w, want_acc = rowwise_adagrad_numpy(w0, steps, eps=1e-8, acc0=0.05, wd=weight_decay)
    assert_close(ours[:, :D], want_w, rtol=rtol, atol=atol)
    assert_close(ours[:, D], want_acc, rtol=rtol, atol=atol)


def test_rowwise_adagrad_matches_fbgemm():
    """The real reference: FBGEMM's fused TBE backward with EXACT_ROWWISE_ADAGRAD (CPU, float32)."""
    with warnings.catch_warnings():  # fbgemm warns about its own optional (SSD) modules on import
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("fbgemm_gpu")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

    rows, dim = 20, 8
    w0, steps = make_problem(rows=rows, dim=dim, n_steps=6, lr=0.05)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-8)
    tbe.split_embedding_weights()[0].copy_(w0.float())
    ours = torch.zeros(rows, dim + 1)
    ours[:, :dim] = w0.float()
    opt = RowWiseAdagrad(lr=0.05)
    for st in steps:
        tbe.set_learning_rate(st.lr)
        # One bag per id (pooling SUM over one id): d pooled / d row = the id's gradient.
        n = st.ids.numel()
        out = tbe(st.ids, torch.arange(n + 1))
        out.backward(st.per_id.float())
        slots, grad = st.summed()
        opt.apply(ours, slots, grad.float(), lr=st.lr, step=st.step)
    assert_close(ours[:, :dim], tbe.split_embedding_weights()[0], rtol=1e-5, atol=1e-6)
    assert_close(ours[:, dim], tbe.split_optimizer_states()[0][0], rtol=1e-5, atol=1e-7)
