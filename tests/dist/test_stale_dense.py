"""Delayed dense steps under staleness (training/_stale.py): step t's gradient applied at step t+D at
1 / (1 + D) of the learning rate (the default), or at the full rate with stale_scale=False.

Oracle: SGD on a linear loss written out here (the gradient of step t is its coefficient vector).
One in-process gloo rank (DelayedDenseGrads all-reduces over the default group).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hugeembed.training._stale import StaleRun


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("scaled", [True, False])
def test_step_t_is_applied_at_t_plus_d_at_the_scaled_rate(one_rank, scaled):
    d, lr, steps = 2, 0.3, 6
    coefs = [torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(steps)]
    w = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    opt = torch.optim.SGD([w], lr=lr)
    run = StaleRun(None, [w], 0, d, None, seed=0, rank=0, timeout=10.0, stale_scale=scaled)
    rate = lr / (1 + d) if scaled else lr
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        (w * coefs[t]).sum().backward()
        run.dense_step(t + 1, opt)
        want = -rate * sum(coefs[: max(0, t + 1 - d)], torch.zeros(5, dtype=torch.float64))
        torch.testing.assert_close(w.detach(), want, msg=lambda m: f"after step {t + 1}: {m}")
        assert opt.param_groups[0]["lr"] == lr  # the optimizer's own rate is left as it was
    run.drain(opt)
    torch.testing.assert_close(w.detach(), -rate * sum(coefs, torch.zeros(5, dtype=torch.float64)))
