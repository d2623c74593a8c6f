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


def tols(device: torch.device) -> dict:
    """Against the float64 dense twin: float32 Adam on the CPU to 2e-5 relative; on CUDA also 1e-5
    absolute (its float32 math rounds differently near zero)."""
    return dict(rtol=2e-5, atol=1e-7 if device.type == "cpu" else 1e-5)


def rows_of(store, ids: torch.Tensor, dynamic: bool) -> torch.Tensor:
    """The stored rows (weights) of `ids`, as they lie in the store (on its device)."""
    ids = ids.to(store.storage().device)
    return store.storage()[store.find(ids) if dynamic else ids, :D]


def train(dynamic: bool, device: torch.device = torch.device("cpu")):
    cfg = TableConfig("u", dim=D, num_rows=None if dynamic else ROWS, combiner="sum",
                      initializer=Uniform(-0.1, 0.1), optimizer=Adam(lr=LR, mode="global"))
    ec = EmbeddingCollection([cfg], device=device)
    all_ids = SparseFeatures.from_lists({"u": [[i] for i in range(ROWS)]}).to(device)
    if dynamic:  # create every row first (a step with a zero gradient for all of them)
        (ec(all_ids)["u"] * 0).sum().backward()
    init = rows_of(ec.store("u"), torch.arange(ROWS), dynamic).cpu()  # the dense twin runs on the CPU
    w = torch.nn.Parameter(init.clone().double())
    dense = torch.optim.Adam([w], lr=LR)
    if dynamic:  # the dense twin takes the same zero-gradient first step
        w.grad = torch.zeros_like(w)
        dense.step()
    for i, ids in enumerate(STEPS):
        out = ec(SparseFeatures.from_lists({"u": [ids]}).to(device))
        (out["u"] * coef(i).to(device)).sum().backward()
        g = torch.zeros(ROWS, D, dtype=torch.float64)
        g[ids] = coef(i).double()
        w.grad = g
        dense.step()
    return ec, all_ids, w.detach()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_eval_reads_rows_as_dense_adam_has_them_and_changes_nothing(dynamic, device):
    ec, all_ids, dense = train(dynamic, device)
    store = ec.store("u")
    before = store.storage().clone()
    ec.eval()
    got = ec(all_ids)["u"]
    assert_close(got.cpu().double(), dense, **tols(device))
    lagging = ec(SparseFeatures.from_lists({"u": [[4]]}).to(device))["u"]  # id 4: last touched at step 1
    raw = rows_of(store, torch.tensor([4]), dynamic)
    assert not torch.equal(lagging, raw)  # the stored row lags; eval did not read it raw
    assert torch.equal(store.storage(), before)  # reading changed no row
    with torch.no_grad():  # a no-grad forward in train mode reads current rows too
        ec.train()
        assert torch.equal(ec(all_ids)["u"], got)
    assert ec.step == len(STEPS) + dynamic


def test_catch_up_rows_brings_every_row_current_in_place(device):
    ec, all_ids, dense = train(True, device)
    ec.eval()
    seen = ec(all_ids)["u"]
    ec.catch_up_rows()
    store = ec.store("u")
    assert_close(rows_of(store, torch.arange(ROWS), True).cpu().double(), dense, **tols(device))
    assert torch.equal(ec(all_ids)["u"], seen)  # reading caught-up rows again gives the same


@pytest.mark.parametrize("rounding", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_tables_are_read_current_through_their_layout(dtype, rounding, device):
    # packed rows (16-bit weights, float32 Adam state): eval's caught-up copy must equal the
    # rows catch_up_rows writes in place, and reading must change no byte
    cfg = TableConfig("u", dim=D, combiner="sum", dtype=dtype, initializer=Uniform(-0.1, 0.1),
                      optimizer=Adam(lr=LR, mode="global"), stochastic_rounding=rounding)
    ec = EmbeddingCollection([cfg], device=device)
    all_ids = SparseFeatures.from_lists({"u": [[i] for i in range(ROWS)]}).to(device)
    (ec(all_ids)["u"] * 0).sum().backward()
    for i, ids in enumerate(STEPS):
        (ec(SparseFeatures.from_lists({"u": [ids]}).to(device))["u"] * coef(i).to(device)).sum().backward()
    store = ec.store("u")
    before = store.storage().clone()
    ec.eval()
    seen = ec(all_ids)["u"]
    assert torch.equal(store.storage(), before)
    # a row reads the same whichever other ids share its batch (stochastic draws keyed by its slot)
    for others in ([], [0], [3, 1]):
        batch = SparseFeatures.from_lists({"u": [[5], *[[o] for o in others]]}).to(device)
        assert torch.equal(ec(batch)["u"][0], seen[5])
    ec.catch_up_rows()
    assert not torch.equal(store.storage(), before)  # rows 4, 5 lagged
    assert torch.equal(ec(all_ids)["u"], seen)
