"""Native C++ optimizer kernels vs their plain-PyTorch twins, on random float32 data.

Both run the same sequence of float32 operations, so they must agree to the last
bit; the only exceptions allowed are powers of beta / of the FTRL accumulator, which
both compute in float64 with different pow implementations (glibc vs ATen) and round
once: they may differ in a double-rounding tie, which never happened in these runs
but is not excluded, hence the 1-ulp-level tolerance on those rules.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed import _native
from hugeembed.optim import FTRL, SGD, Adagrad, Adam, MomentumSGD, RowWiseAdagrad

pytestmark = pytest.mark.skipif(not _native.available(), reason="native kernels not built")

EXTRA = 3  # columns past D + S that no rule may touch

CONFIGS = [
    SGD(lr=0.1),
    SGD(lr=0.05, weight_decay=0.01),
    MomentumSGD(lr=0.1, momentum=0.9),
    MomentumSGD(lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.02),
    Adagrad(lr=0.1),
    Adagrad(lr=0.1, initial_accumulator_value=0.3, lr_decay=0.01, weight_decay=0.01, eps=1e-6),
    RowWiseAdagrad(lr=0.1),
    RowWiseAdagrad(lr=0.1, weight_decay=0.05, initial_accumulator_value=0.2),
    Adam(lr=0.01),
    Adam(lr=0.01, epsilon="tf", weight_decay=0.01),
    Adam(lr=0.01, bias_correction="per_row", weight_decay=0.02, decoupled_weight_decay=True),
    Adam(lr=0.01, bias_correction="per_row", epsilon="tf", weight_decay=0.01),
    Adam(lr=0.01, mode="global"),
    Adam(lr=0.01, mode="global", epsilon="tf", betas=(0.8, 0.99)),
    Adam(lr=0.01, mode="global", weight_decay=0.1, decoupled_weight_decay=True),
    FTRL(lr=0.1),
    FTRL(lr=0.1, lr_power=-0.7, l1=0.01, l2=0.02, l2_shrinkage=0.03, beta=0.5),
    FTRL(lr=0.1, lr_power=0.0, l1=0.001),
]
# Rules whose twin and kernel call different pow implementations (see module docstring).
USES_POW = (Adam, FTRL)


def _ids(opt):
    return repr(opt).replace(" ", "")


def _run(opt, steps, storage, *, native: bool) -> torch.Tensor:
    storage = storage.clone()
    with pytest.MonkeyPatch.context() as mp:
        if not native:
            mp.setattr(_native, "available", lambda: False)
        for step, slots, grad, lr in steps:
            opt.apply(storage, slots, grad, lr=lr, step=step)
        if isinstance(opt, Adam) and opt.mode == "global":
            opt.catch_up(storage, torch.arange(storage.shape[0]), steps[-1][0], dim=steps[-1][2].shape[1])
    return storage


def _problem(opt, rows=150, dim=19, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = opt.state_width(dim)
    storage = torch.randn(rows, dim + S + EXTRA, generator=gen)
    opt.init_state(storage[:, dim:dim + S])
    # Step numbers with gaps, so that global Adam replays hundreds of skipped steps.
    step_numbers = [1, 2, 3, 5, 40, 41, 250]
    steps = []
    for i, step in enumerate(step_numbers):
        n = int(torch.randint(1, rows, (1,), generator=gen))
        slots = torch.randperm(rows, generator=gen)[:n]
        grad = torch.randn(n, dim, generator=gen) * (10.0 ** float(torch.randint(-3, 2, (1,), generator=gen)))
        steps.append((step, slots, grad, 0.1 / (1 + i)))  # a decaying lr schedule
    return storage, steps


def _assert_same(opt, a, b):
    if isinstance(opt, USES_POW):
        torch.testing.assert_close(a, b, rtol=4 * 2**-23, atol=1e-30, equal_nan=False)
    else:
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("opt", CONFIGS, ids=_ids)
def test_native_matches_twin(opt):
    storage, steps = _problem(opt)
    a = _run(opt, steps, storage, native=True)
    b = _run(opt, steps, storage, native=False)
    D = steps[0][2].shape[1]
    # Columns past D + S are never touched.
    torch.testing.assert_close(a[:, -EXTRA:], storage[:, -EXTRA:], rtol=0, atol=0)
    _assert_same(opt, a, b)
    assert not torch.equal(a[:, :D], storage[:, :D])


@settings(max_examples=40)
@given(opt=st.sampled_from(CONFIGS), rows=st.integers(1, 40), dim=st.integers(1, 40),
       extra=st.integers(0, 3), seed=st.integers(0, 2**31 - 1), gaps=st.lists(st.integers(1, 60), min_size=1,
                                                                                max_size=4))
def test_native_matches_twin_on_any_shape(opt, rows, dim, extra, seed, gaps):
    gen = torch.Generator().manual_seed(seed)
    S = opt.state_width(dim)
    storage = torch.randn(rows, dim + S + extra, generator=gen)
    opt.init_state(storage[:, dim:dim + S])
    steps, step = [], 0
    for gap in gaps:
        step += gap
        slots = torch.randperm(rows, generator=gen)[: int(torch.randint(1, rows + 1, (1,), generator=gen))]
        steps.append((step, slots, torch.randn(slots.numel(), dim, generator=gen), 0.05))
    a = _run(opt, steps, storage, native=True)
    b = _run(opt, steps, storage, native=False)
    _assert_same(opt, a, b)
    assert torch.equal(a[:, dim + S:], storage[:, dim + S:])
