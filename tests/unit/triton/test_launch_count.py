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
    """The same launches for 2 and 4 tables, and at most issue 32's 25 for static tables; one read (the prepare's
    report: the static fetch takes its proof and checks nothing again)."""
    few, many = (ops.counted_launches(n, False, samples=2, rows=4, warmup=3) for n in (2, 4))
    assert few.launches() == many.launches() <= 25, (dict(many.kernels), dict(many.torch_launches()))
    assert few.syncs() == many.syncs() == 1, dict(many.ops)
    assert many.kernels["_static_rows"] == 1


@pytest.mark.slow
def test_a_dynamic_triton_step_launches_a_bounded_number_of_kernels(ops):
    """Dynamic tables, steady state (every id known): the same launches for 2 and 4 tables, at most issue
    32's 40, at most 2 reads, and no sort or claim round of the hash index's (no key is new)."""
    few, many = (ops.counted_launches(n, True, samples=2, rows=2, warmup=5) for n in (2, 4))  # every id seen
    assert few.launches() == many.launches() <= 40, (dict(many.kernels), dict(many.torch_launches()))
    assert few.syncs() == many.syncs() <= 2
    assert not any(name.startswith("claim_") for name in many.kernels)
    assert many.kernels["need_kernel"] == 1


@pytest.mark.slow
def test_a_dynamic_triton_step_with_new_keys_reads_twice(ops):
    """Issue 32 items 4-5 in a step that makes rows: three new keys per table (their rows freed before, so no
    table grows): at most 40 launches and two reads (the prepare's report, the index's one read), whatever the
    tables; the new keys placed by one program after the index's read (a few keys: no launched claim round);
    no blocking copy to the device."""
    few, many = (ops.counted_new_keys(n, new=3, samples=4, rows=6, warmup=4) for n in (2, 4))
    assert few.syncs() == many.syncs() == 2, dict(many.ops)
    assert many.ops.get("h2d", 0) == 0
    assert few.launches() == many.launches() <= 40, (dict(many.kernels), dict(many.torch_launches()))
    assert many.kernels["claim_finish_kernel"] == 1
    assert not any(name.startswith("claim_") and name != "claim_finish_kernel" for name in many.kernels)
