"""The apply() contract shared by every rule: input checks, schedules, dtypes, layouts, paths."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from hugeembed import _native
from hugeembed.errors import ConfigError, InputError
from hugeembed.optim import FTRL, SGD, Adagrad, Adam, MomentumSGD, RowWiseAdagrad

from ._optim_oracles import make_problem, run_ours

D = 4
RULES = [
    SGD(lr=0.1),
    MomentumSGD(lr=0.1),
    Adagrad(lr=0.1),
    RowWiseAdagrad(lr=0.1),
    Adam(lr=0.1),
    Adam(lr=0.1, mode="global"),
    FTRL(lr=0.1),
]


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Runs the test through the native kernel, or through the torch twin (kernels disabled)."""
    if request.param == "native" and not _native.available():
        pytest.skip("native kernels not built")
    if request.param == "torch":
        monkeypatch.setattr(_native, "available", lambda: False)
    return request.param


def _table(opt, rows=6, dtype=torch.float32):
    storage = torch.randn(rows, D + opt.state_width(D), dtype=dtype)
    opt.init_state(storage[:, D:])
    return storage


@pytest.mark.parametrize("opt", RULES, ids=lambda o: o.name)
@pytest.mark.parametrize("bad", [6, -1, 2**40])
def test_out_of_range_slot_is_an_index_error_and_changes_nothing(opt, bad, path):
    storage = _table(opt)
    before = storage.clone()
    with pytest.raises(IndexError, match=f"slot {bad} at position 1 is out of range for a table of 6 rows"):
        opt.apply(storage, torch.tensor([0, bad, 2]), torch.ones(3, D), lr=0.1, step=1)
    assert torch.equal(storage, before)


@pytest.mark.parametrize("opt", RULES, ids=lambda o: o.name)
def test_bad_inputs_raise_named_errors(opt, path):
    storage = _table(opt)
    slots, grad = torch.tensor([0, 1]), torch.ones(2, D)
    with pytest.raises(InputError, match="grad must be \\[U, D\\] with U = 2"):
        opt.apply(storage, slots, torch.ones(3, D), lr=0.1, step=1)
    with pytest.raises(InputError, match="need .* columns"):
        opt.apply(storage[:, : D + opt.state_width(D) - 1] if opt.state_width(D) else storage[:, :D],
                  slots, torch.ones(2, D + 1), lr=0.1, step=1)
    with pytest.raises(InputError, match="slots must be int64"):
        opt.apply(storage, slots.float(), grad, lr=0.1, step=1)
    with pytest.raises(InputError, match="storage must be a 2-D tensor"):
        opt.apply(storage.flatten(), slots, grad, lr=0.1, step=1)
    with pytest.raises(InputError, match="step must be >= 1"):
        opt.apply(storage, slots, grad, lr=0.1, step=0)
    with pytest.raises(InputError, match="step must be an integer"):
        opt.apply(storage, slots, grad, lr=0.1, step=1.0)
    with pytest.raises(ConfigError, match="lr \\(runtime\\) must be finite and >= 0.0, got -0.1"):
        opt.apply(storage, slots, grad, lr=-0.1, step=1)


@pytest.mark.parametrize("opt", RULES, ids=lambda o: o.name)
def test_empty_batch_is_a_no_op(opt, path):
    storage = _table(opt)
    before = storage.clone()
    opt.apply(storage, torch.zeros(0, dtype=torch.int64), torch.zeros(0, D), lr=0.1, step=3)
    assert torch.equal(storage, before)


def test_learning_rate_schedule_takes_effect(path):
    sgd = SGD(lr=0.1)
    storage = torch.zeros(3, D)
    g = torch.ones(1, D)
    sgd.apply(storage, torch.tensor([0]), g, lr=0.0, step=1)
    sgd.apply(storage, torch.tensor([1]), g, lr=0.1, step=2)
    sgd.apply(storage, torch.tensor([2]), g, lr=0.2, step=3)
    assert storage[:, 0].tolist() == pytest.approx([0.0, -0.1, -0.2])
    # Adagrad at lr = 0: the accumulator advances, the weight does not.
    ada = Adagrad(lr=0.1)
    table = torch.zeros(2, 2 * D)
    ada.apply(table, torch.tensor([0]), g, lr=0.0, step=1)
    assert table[0, :D].eq(0).all() and table[0, D:].eq(1).all()
    ada.apply(table, torch.tensor([0]), g, lr=0.5, step=2)
    assert table[0, :D].tolist() == pytest.approx([-0.5 / 2**0.5] * D)


@pytest.mark.parametrize("opt", RULES, ids=lambda o: o.name)
def test_non_contiguous_storage_runs_through_the_twin(opt):
    """A column slice of a wider buffer is not contiguous: the twin must handle it, same numbers."""
    w0, steps = make_problem(rows=10, dim=D, n_steps=4)
    width = D + opt.state_width(D)
    wide = torch.full((10, width + 5), 7.0)
    view = wide[:, 2:2 + width]
    view[:, :D] = w0.float()
    opt.init_state(view[:, D:])
    assert not view.is_contiguous()
    for st in steps:
        slots, grad = st.summed()
        opt.apply(view, slots, grad.float(), lr=st.lr, step=st.step)
    want = run_ours(opt, w0, steps, dtype=torch.float32)
    assert_close(view.double(), want, rtol=0, atol=0)
    assert wide[:, :2].eq(7).all() and wide[:, 2 + width:].eq(7).all()


@pytest.mark.parametrize("opt", RULES, ids=lambda o: o.name)
def test_float64_storage_accepts_float32_grads(opt, device):
    w0, steps = make_problem(rows=10, dim=D, n_steps=4)
    storage = torch.zeros(10, D + opt.state_width(D), dtype=torch.float64, device=device)
    storage[:, :D] = w0.to(device)
    opt.init_state(storage[:, D:])
    for st in steps:
        slots, grad = st.summed()
        opt.apply(storage, slots.to(device), grad.float().to(device), lr=st.lr, step=st.step)
    want = run_ours(opt, w0, [st for st in steps], dtype=torch.float64)
    assert_close(storage.cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("opt", [r for r in RULES if not (isinstance(r, Adam) and r.mode == "global")],
                         ids=lambda o: o.name)
def test_bfloat16_storage_through_the_twin(opt, device):
    """bfloat16 rows are computed in float32 and rounded back: close to a float32 run."""
    w0, steps = make_problem(rows=10, dim=D, n_steps=4, lr=0.05)
    ref = run_ours(opt, w0, steps, dtype=torch.float32, device=device)
    got = run_ours(opt, w0, steps, dtype=torch.bfloat16, device=device)
    assert_close(got, ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("opt", RULES, ids=lambda o: o.name)
def test_parameter_storage_and_catch_up_checks(opt, path):
    """A storage that is an nn.Parameter is updated outside autograd; catch_up checks its slots."""
    storage = torch.nn.Parameter(_table(opt))
    before = storage.detach().clone()
    opt.apply(storage, torch.tensor([1]), torch.ones(1, D), lr=0.1, step=1)
    assert not torch.equal(storage.detach()[1], before[1])
    assert storage.grad is None and storage.requires_grad
    with pytest.raises(IndexError, match="slot 9 at position 0"):
        opt.catch_up(storage.detach(), torch.tensor([9]), 3, dim=D)
