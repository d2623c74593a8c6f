"""bench/ops.py's CountLaunches (the launches a GPU would make, counted without one) against a hand count,
and issue 32's bound on a triton training step counted with it."""

from __future__ import annotations

import pytest
import torch

from hugeembed._triton import dedup
from hugeembed._triton._grid import launch

from tests.bench._load import load_bench

from ._batches import DEV

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def ops():
    return load_bench("ops")


def test_counts_kernels_and_launching_ops_by_hand(ops):
    keys = torch.tensor([3, 1, 1, 7], dtype=torch.int32, device=DEV)
    with ops.CountLaunches() as counter:
        x = torch.zeros(4, dtype=torch.int32, device=DEV)  # 1: a fill
        y = x.view(2, 2)[0]  # views: none
        heads = torch.empty(4, dtype=torch.int32, device=DEV)  # uninitialized: none
        launch(dedup._segment_heads, 2, keys, heads, 4, 9, BLOCK=2)  # 1 launch of a 2-program grid
        z = (heads + y.sum()).tolist()  # sum, add: 2, the read: 1 copy
    assert z == [1, 1, 0, 1]
    assert dict(counter.kernels) == {"_segment_heads": 1}
    assert dict(counter.torch_launches()) == {"zeros": 1, "sum": 1, "add": 1, "tolist": 1}
    assert counter.launches() == 5 and counter.syncs() == 1


@pytest.mark.slow
def test_a_static_triton_step_launches_a_bounded_number_of_kernels(ops):
    """The same launches for 2 and 4 tables, and at most issue 32's 25 for static tables; two reads (the prepare's
    checks, then the static fetch's key check: issue 32 asks for one)."""
    few, many = (ops.counted_launches(n, False, samples=2, rows=4, warmup=3) for n in (2, 4))
    assert few.launches() == many.launches() <= 25, (dict(many.kernels), dict(many.torch_launches()))
    assert few.syncs() == many.syncs() == 2


@pytest.mark.slow
def test_a_dynamic_triton_step_launches_a_bounded_number_of_kernels(ops):
    """Dynamic tables, steady state (every id known): the same launches for 2 and 4 tables, at most issue
    32's 40, at most 2 reads, and no sort or claim round of the hash index's (no key is new)."""
    few, many = (ops.counted_launches(n, True, samples=2, rows=2, warmup=5) for n in (2, 4))  # every id seen
    assert few.launches() == many.launches() <= 40, (dict(many.kernels), dict(many.torch_launches()))
    assert few.syncs() == many.syncs() <= 2
    assert not any(name.startswith("claim_") for name in many.kernels)
    assert many.kernels["need_kernel"] == 1
