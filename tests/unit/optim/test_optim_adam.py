"""Adam (lazy global_step / lazy per_row / global) against torch.optim and a NumPy oracle (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from hugeembed.optim import Adam

from ._optim_oracles import Step, make_problem, per_row_oracle, run_ours, table_oracle

D = 4


def adam_numpy(w0, steps, *, lr_scale=1.0, betas=(0.9, 0.999), eps=1e-8, wd=0.0, decoupled=False,
               epsilon="torch", mode="lazy_global_step", t0=0):
    """Adam written out per coordinate in float64.

    mode: "lazy_global_step" (touched rows, t = step), "per_row" (touched rows, t = the
    row's own count, starting after t0), "dense" (every row every step, zero gradient
    when untouched: plain dense Adam).  Returns (w, m, v).
    """
    b1, b2 = betas
    w = w0.numpy().copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    count = np.full(w.shape[0], t0)
    for st in steps:
        g_all = st.dense(w.shape[0]).numpy()
        touched = set(st.ids.tolist())
        lr = st.lr * lr_scale
        for r in range(w.shape[0]):
            if mode != "dense" and r not in touched:
                continue
            count[r] += 1
            t = count[r] if mode == "per_row" else st.step
            g = g_all[r].copy()
            if wd and decoupled:
                w[r] *= 1 - lr * wd
            elif wd:
                g += wd * w[r]
            m[r] = b1 * m[r] + (1 - b1) * g
            v[r] = b2 * v[r] + (1 - b2) * g * g
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            if epsilon == "torch":
                w[r] -= lr / bc1 * m[r] / (np.sqrt(v[r]) / math.sqrt(bc2) + eps)
            else:
                w[r] -= lr * math.sqrt(bc2) / bc1 * m[r] / (np.sqrt(v[r]) + eps)
    return torch.from_numpy(w), torch.from_numpy(m), torch.from_numpy(v)


def _assert_state(ours, want_w, want_m, want_v, rtol, atol):
    assert_close(ours[:, :D], want_w, rtol=rtol, atol=atol)
    assert_close(ours[:, D:2 * D], want_m, rtol=rtol, atol=atol)
    assert_close(ours[:, 2 * D:3 * D], want_v, rtol=rtol, atol=atol)


def test_lazy_global_step_tf_matches_torch_sparse_adam(precision, device):
    """torch.optim.SparseAdam places eps like TF: lr * sqrt(bc2) / bc1 * m / (sqrt(v) + eps)."""
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=10, lr=0.05)
    ours = run_ours(Adam(lr=0.05, epsilon="tf"), w0, steps, dtype=dtype, device=device)
    want, opt = table_oracle(w0, steps, lambda p: torch.optim.SparseAdam(p, lr=0.05), sparse=True)
    (state,) = opt.state.values()
    _assert_state(ours, want, state["exp_avg"], state["exp_avg_sq"], rtol, atol)


def _global_step_for_touched_rows(opt, params, st: Step):
    # Makes torch.optim.Adam correct the bias of every touched row with the table's step.
    for p in params:
        if p.grad is None:
            continue
        state = opt.state[p]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"].fill_(st.step - 1)


def test_lazy_global_step_torch_eps_matches_torch_adam(precision, device):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=10, lr=0.05)
    ours = run_ours(Adam(lr=0.05, betas=(0.8, 0.99)), w0, steps, dtype=dtype, device=device)
    want, _ = per_row_oracle(w0, steps, lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.99), foreach=False),
                             before_step=_global_step_for_touched_rows)
    assert_close(ours[:, :D], want, rtol=rtol, atol=atol)
    w, m, v = adam_numpy(w0, steps, betas=(0.8, 0.99))
    _assert_state(ours, w, m, v, rtol, atol)


@pytest.mark.parametrize("wd,decoupled", [(0.0, False), (0.1, False), (0.1, True)])
def test_lazy_per_row_matches_torch_adam_per_row(precision, device, wd, decoupled):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=12, lr=0.05)
    opt = Adam(lr=0.05, bias_correction="per_row", weight_decay=wd, decoupled_weight_decay=decoupled)
    ours = run_ours(opt, w0, steps, dtype=dtype, device=device)
    torch_rule = torch.optim.AdamW if decoupled else torch.optim.Adam
    want, torch_opt = per_row_oracle(w0, steps, lambda p: torch_rule(p, lr=0.05, weight_decay=wd, foreach=False))
    assert_close(ours[:, :D], want, rtol=rtol, atol=atol)
    for r, p in enumerate(torch_opt.param_groups[0]["params"]):
        count = int(torch_opt.state[p]["step"]) if p in torch_opt.state else 0
        assert int(ours[r, 3 * D].to(dtype).view(torch.int32 if dtype == torch.float32 else torch.int64)) == count


def test_per_row_tf_epsilon_matches_formula(precision, device):
    dtype, rtol, atol = precision
    w0, steps = make_problem(dim=D, n_steps=12, lr=0.05)
    ours = run_ours(Adam(lr=0.05, bias_correction="per_row", epsilon="tf"), w0, steps, dtype=dtype, device=device)
    _assert_state(ours, *adam_numpy(w0, steps, epsilon="tf", mode="per_row"), rtol, atol)


def long_gap_problem(rows=12, dim=D, n_steps=400, seed=1):
    """Hot rows every step; rows touched at step 1 then not until 350; rows left after step 3; never-touched rows."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    steps = []
    for t in range(1, n_steps + 1):
        ids = [0, 1, 2, 0, 1]  # duplicates
        if t in (1, 2, 350):
            ids += [4, 5, 4]
        if t <= 3:
            ids += [6]
        ids += [8] if t % 2 else [9, 9]  # alternate steps
        ids_t = torch.tensor(ids)
        steps.append(Step(t, ids_t, torch.randn(len(ids), dim, generator=gen, dtype=torch.float64), 0.02))
    return w0, steps


@pytest.mark.parametrize("variant", ["torch", "adamw", "tf"])
def test_global_matches_dense_adam_with_zero_grads(precision, device, variant):
    """Untouched rows keep moving in dense Adam; ours replays the gap on next touch or catch_up."""
    dtype, rtol, atol = precision
    w0, steps = long_gap_problem()
    rows, T = w0.shape[0], steps[-1].step
    kw = {"weight_decay": 0.05, "decoupled_weight_decay": True} if variant == "adamw" else {}
    opt = Adam(lr=0.02, mode="global", epsilon="tf" if variant == "tf" else "torch", **kw)
    storage = run_ours(opt, w0, steps, dtype=dtype, device=device)
    if variant == "tf":
        want_w, want_m, want_v = adam_numpy(w0, steps, epsilon="tf", mode="dense")
    else:
        rule = torch.optim.AdamW if variant == "adamw" else torch.optim.Adam
        wd = kw.get("weight_decay", 0.0)
        want_w, torch_opt = table_oracle(w0, steps, lambda p: rule(p, lr=0.02, weight_decay=wd, foreach=False),
                                         sparse=False)
        (state,) = torch_opt.state.values()
        want_m, want_v = state["exp_avg"], state["exp_avg_sq"]
    # Rows touched at the last step are up to date; the others only after catch_up.
    hot = [0, 1, 2, 9]
    _assert_state(storage[hot], want_w[hot], want_m[hot], want_v[hot], rtol, atol)
    assert not torch.allclose(storage[[4, 6, 7], :D], want_w[[4, 6, 7]])
    table = storage.to(device=device, dtype=dtype)
    opt.catch_up(table, torch.arange(rows, device=device), T, lr=0.02)
    _assert_state(table.cpu().double(), want_w, want_m, want_v, rtol, atol)
    if variant != "adamw":  # without decay, never-touched rows (m = v = 0) never move
        assert_close(table[[3, 7], :D].cpu().double(), w0[[3, 7]].to(dtype).double(), rtol=0, atol=0)


def dense_zero_grad_replay(w, m, v, t0, t1, *, lr, betas, eps):
    """Plain float64 dense Adam with zero gradient for steps t0+1 .. t1.

    Runs step by step until |m| < 1e-200: every later step then moves w by less than
    lr / (1 - b1) * 1e-200 / eps, a total below 1e-180 -- nothing in float64 next to
    |w| ~ 1.  Then only the moments' decay is left: m *= b1^rest, v *= b2^rest.
    """
    b1, b2 = betas
    w, m, v = list(w), list(m), list(v)
    for t in range(t0 + 1, t1 + 1):
        if max(abs(x) for x in m) < 1e-200:
            rest = t1 - t + 1
            m = [x * b1**rest for x in m]
            v = [x * b2**rest for x in v]
            break
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        for d in range(len(w)):
            m[d] *= b1
            v[d] *= b2
            w[d] -= lr / bc1 * m[d] / (math.sqrt(v[d]) / math.sqrt(bc2) + eps)
    return w, m, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_global_replay_of_a_huge_gap_is_exact_and_stops_early(dtype):
    """A row last touched at step 3 and touched again at step 10^9: the replay must stop early.

    (It would take hours to replay 10^9 steps; pytest-timeout fails the test if it does.)
    """
    opt = Adam(lr=0.01, mode="global")
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(1, 3, generator=gen, dtype=torch.float64)
    grads = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    storage = torch.zeros(1, 3 + opt.state_width(3), dtype=dtype)
    storage[:, :3] = w0.to(dtype)
    for t in range(1, 4):
        opt.apply(storage, torch.tensor([0]), grads[t - 1:t].to(dtype), lr=0.01, step=t)
    big = 10**9
    opt.catch_up(storage, torch.tensor([0]), big - 1)
    w3, m3, v3 = adam_numpy(w0, [Step(t, torch.tensor([0]), grads[t - 1:t], 0.01) for t in range(1, 4)],
                            lr_scale=1.0, mode="dense")
    w, m, v = dense_zero_grad_replay(w3[0].tolist(), m3[0].tolist(), v3[0].tolist(), 3, big - 1, lr=0.01,
                                     betas=(0.9, 0.999), eps=1e-8)
    got = storage[0].double()
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-300)
    assert_close(got[:3], torch.tensor(w, dtype=torch.float64), **tol)
    assert_close(got[3:9], torch.tensor(m + v, dtype=torch.float64), **tol)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int64
    assert int(storage[0, 9:10].view(int_dtype)) == big - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["per_row", "global"])
def test_counters_stay_exact_past_2_pow_24(dtype, mode, monkeypatch):
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int64
    opt = Adam(lr=0.01, mode="global") if mode == "global" else Adam(lr=0.01, bias_correction="per_row")
    base = 2**24 + 1  # a float32 VALUE could not hold base + 1
    storage = torch.zeros(3, D + opt.state_width(D), dtype=dtype)
    storage[:, :D] = 1.0
    storage[:, 3 * D:].view(int_dtype).fill_(base)
    g = torch.full((2, D), 0.5, dtype=dtype)
    step = base + 3  # global: rows replay steps base+1, base+2, then take step base+3
    opt.apply(storage, torch.tensor([0, 2]), g, lr=0.01, step=step)
    counters = storage[:, 3 * D].view(int_dtype).tolist()
    assert counters == ([step, base, step] if mode == "global" else [base + 1, base, base + 1])
    # With m = v = 0 before, the replayed steps move nothing; then one Adam step at t.
    t = step if mode == "global" else base + 1
    w_steps = [Step(1, torch.tensor([0]), torch.full((1, D), 0.5, dtype=torch.float64), 0.01)]
    want_w, want_m, _ = adam_numpy(torch.ones(1, D, dtype=torch.float64), w_steps, mode="per_row", t0=t - 1)
    tol = dict(rtol=2e-6, atol=0) if dtype == torch.float32 else dict(rtol=1e-14, atol=0)
    assert_close(storage[0, :D].double(), want_w[0], **tol)
    assert_close(storage[0, D:2 * D].double(), want_m[0], **tol)


def test_counter_range_is_checked():
    opt = Adam(lr=0.01, mode="global")
    storage = torch.zeros(2, D + opt.state_width(D))
    with pytest.raises(ValueError, match="step 2147483648 exceeds"):
        opt.apply(storage, torch.tensor([0]), torch.ones(1, D), lr=0.01, step=2**31)


def test_low_precision_storage(device):
    """bfloat16 storage runs through the twin (computing in float32); counters need 32-bit storage."""
    w0, steps = make_problem(dim=D, n_steps=6, lr=0.05)
    ref = run_ours(Adam(lr=0.05), w0, steps, dtype=torch.float32, device=device)
    got = run_ours(Adam(lr=0.05), w0, steps, dtype=torch.bfloat16, device=device)
    assert_close(got, ref, rtol=2e-2, atol=2e-2)
    for opt in (Adam(lr=0.05, mode="global"), Adam(lr=0.05, bias_correction="per_row")):
        with pytest.raises(ValueError, match="float32 or float64 storage"):
            run_ours(opt, w0, steps, dtype=torch.bfloat16, device=device)


def test_catch_up_is_a_no_op_when_lazy_and_needs_dim_when_ambiguous():
    storage = torch.randn(5, 3 * D)
    before = storage.clone()
    Adam(lr=0.1).catch_up(storage, torch.arange(5), 100)
    assert torch.equal(storage, before)
    wide = torch.zeros(5, 3 * D + 1 + 2)
    with pytest.raises(ValueError, match="pass dim="):
        Adam(lr=0.1, mode="global").catch_up(wide, torch.arange(5), 10)
    Adam(lr=0.1, mode="global").catch_up(wide, torch.arange(5), 10, dim=D)
    assert wide[:, 3 * D].view(torch.int32).tolist() == [10] * 5
