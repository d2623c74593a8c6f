"""Global Adam's rows are read current (as dense torch.optim.Adam has them) wherever they are
read for anything but a training step, and reading them changes nothing."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adam
from hugeembed.store import Uniform

ROWS, D, LR = 6, 4, 0.02
# each step touches a few ids; ids 4, 5 are touched once, early, then lag
STEPS = [[0, 4], [1, 5], [0, 2], [1], [0, 3], [2], [1, 0]]


def coef(i: int) -> torch.Tensor:
    return torch.tensor([1.0, -2.0, 0.5, 1.5]) * (1 + 0.1 * i)


def train(dynamic: bool):
    cfg = TableConfig("u", dim=D, num_rows=None if dynamic else ROWS, combiner="sum",
                      initializer=Uniform(-0.1, 0.1), optimizer=Adam(lr=LR, mode="global"))
    ec = EmbeddingCollection([cfg])
    all_ids = SparseFeatures.from_lists({"u": [[i] for i in range(ROWS)]})
    if dynamic:  # create every row first (a step with a zero gradient for all of them)
        (ec(all_ids)["u"] * 0).sum().backward()
    init = ec.store("u").storage()[ec.store("u").find(torch.arange(ROWS)) if dynamic else torch.arange(ROWS), :D]
    w = torch.nn.Parameter(init.clone().double())
    dense = torch.optim.Adam([w], lr=LR)
    if dynamic:  # the dense twin takes the same zero-gradient first step
        w.grad = torch.zeros_like(w)
        dense.step()
    for i, ids in enumerate(STEPS):
        out = ec(SparseFeatures.from_lists({"u": [ids]}))
        (out["u"] * coef(i)).sum().backward()
        g = torch.zeros(ROWS, D, dtype=torch.float64)
        g[ids] = coef(i).double()
        w.grad = g
        dense.step()
    return ec, all_ids, w.detach()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_eval_reads_rows_as_dense_adam_has_them_and_changes_nothing(dynamic):
    ec, all_ids, dense = train(dynamic)
    store = ec.store("u")
    before = store.storage().clone()
    ec.eval()
    got = ec(all_ids)["u"]
    assert_close(got.double(), dense, rtol=2e-5, atol=1e-7)
    lagging = ec(SparseFeatures.from_lists({"u": [[4]]}))["u"]  # id 4: last touched at step 1
    raw = store.storage()[store.find(torch.tensor([4])) if dynamic else torch.tensor([4]), :D]
    assert not torch.equal(lagging, raw)  # the stored row lags; eval did not read it raw
    assert torch.equal(store.storage(), before)  # reading changed no row
    with torch.no_grad():  # a no-grad forward in train mode reads current rows too
        ec.train()
        assert torch.equal(ec(all_ids)["u"], got)
    assert ec.step == len(STEPS) + dynamic


def test_catch_up_rows_brings_every_row_current_in_place():
    ec, all_ids, dense = train(True)
    ec.eval()
    seen = ec(all_ids)["u"]
    ec.catch_up_rows()
    store = ec.store("u")
    assert_close(store.storage()[store.find(torch.arange(ROWS)), :D].double(), dense, rtol=2e-5, atol=1e-7)
    assert torch.equal(ec(all_ids)["u"], seen)  # reading caught-up rows again gives the same


@pytest.mark.parametrize("rounding", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_tables_are_read_current_through_their_layout(dtype, rounding):
    # packed rows (16-bit weights, float32 Adam state): eval's caught-up copy must equal the
    # rows catch_up_rows writes in place, and reading must change no byte
    cfg = TableConfig("u", dim=D, combiner="sum", dtype=dtype, initializer=Uniform(-0.1, 0.1),
                      optimizer=Adam(lr=LR, mode="global"), stochastic_rounding=rounding)
    ec = EmbeddingCollection([cfg])
    all_ids = SparseFeatures.from_lists({"u": [[i] for i in range(ROWS)]})
    (ec(all_ids)["u"] * 0).sum().backward()
    for i, ids in enumerate(STEPS):
        (ec(SparseFeatures.from_lists({"u": [ids]}))["u"] * coef(i)).sum().backward()
    store = ec.store("u")
    before = store.storage().clone()
    ec.eval()
    seen = ec(all_ids)["u"]
    assert torch.equal(store.storage(), before)
    # a row reads the same whichever other ids share its batch (stochastic draws keyed by its slot)
    for others in ([], [0], [3, 1]):
        assert torch.equal(ec(SparseFeatures.from_lists({"u": [[5], *[[o] for o in others]]}))["u"][0], seen[5])
    ec.catch_up_rows()
    assert not torch.equal(store.storage(), before)  # rows 4, 5 lagged
    assert torch.equal(ec(all_ids)["u"], seen)
