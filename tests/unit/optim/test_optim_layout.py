"""Optimizers on 16-bit weights with float32 state (the packed RowLayout), via the one update path.

Oracles: the same rule on a plain float32 table whose weights are rounded to the 16-bit dtype
after every step (round-to-nearest must match it bit for bit); hand formulas for stochastic
rounding (unbiased: E[round(x)] = x) and for sub-ulp updates.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed import _native
from hugeembed.errors import InputError
from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import FTRL, SGD, Adagrad, Adam, MomentumSGD, RowWiseAdagrad
from hugeembed.optim import _adam
from hugeembed.optim._rounding import round_stochastic
from hugeembed.store import ArrayStore, HashStore, RowLayout

from ._optim_oracles import make_problem

LOW = [torch.float16, torch.bfloat16]
RULES = {
    "sgd": SGD(lr=0.1, weight_decay=0.01),
    "momentum": MomentumSGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": Adagrad(lr=0.1, weight_decay=0.01, lr_decay=0.01, initial_accumulator_value=0.1),
    "rowwise_adagrad": RowWiseAdagrad(lr=0.1, weight_decay=0.01),
    "adam_lazy": Adam(lr=0.05, weight_decay=0.01),
    "adam_per_row": Adam(lr=0.05, bias_correction="per_row", epsilon="tf"),
    "adam_global": Adam(lr=0.05, mode="global", weight_decay=0.01, decoupled_weight_decay=True),
    "ftrl": FTRL(lr=0.1, l1=0.01, l2=0.01, beta=0.1),
}


def _packed_store(opt, w0, dtype, *, stochastic=False, seed=0):
    rows, dim = w0.shape
    layout = RowLayout(dim, dtype, opt.state_width(dim), stochastic_rounding=stochastic, table="t")
    store = ArrayStore("t", rows, dim, layout.state_width, init_state=opt.init_state, dtype=dtype, layout=layout,
                       seed=seed)
    store.weights()[:] = w0.to(dtype)
    return store


def _rounded_fp32_oracle(opt, w0, steps, dtype, catch_up_to: int | None = None, lr: float | None = None):
    """The rule on a plain float32 table (torch twin) whose weights are rounded to `dtype` after
    each step (at `lr`, default each step's own), then (`catch_up_to`) every row caught up to that step.  Global Adam's replay stops
    at the tolerance of the stored weights' dtype.  Returns (weights in `dtype`, state)."""
    rows, dim = w0.shape
    storage = torch.zeros(rows, dim + opt.state_width(dim))
    storage[:, :dim] = w0.to(dtype).float()
    opt.init_state(storage[:, dim:])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_native, "available", lambda: False)
        m.setattr(_adam, "negligible_fraction", lambda _dt: torch.finfo(dtype).eps / 16)
        for s in steps:
            slots, grad = s.summed()
            opt.apply(storage, slots, grad.float(), lr=s.lr if lr is None else lr, step=s.step)
            storage[:, :dim] = storage[:, :dim].to(dtype).float()
        if catch_up_to is not None:
            opt.catch_up(storage, torch.arange(rows), step=catch_up_to, lr=steps[-1].lr if lr is None else lr)
    return storage[:, :dim].to(dtype), storage[:, dim:]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(RULES))
@given(rows=st.integers(2, 12), dim=st.integers(1, 7), n_steps=st.integers(1, 8), batch=st.integers(1, 30),
       seed=st.integers(0, 2**16))
@settings(max_examples=12, deadline=None)
def test_every_rule_on_packed_16_bit_weights_equals_the_rounded_fp32_oracle(name, dtype, rows, dim, n_steps, batch,
                                                                            seed):
    opt = RULES[name]
    w0, steps = make_problem(rows, dim, n_steps, seed=seed, batch=batch, lr=0.1, scale=2.0)
    store = _packed_store(opt, w0, dtype)
    for s in steps:
        slots, grad = s.summed()  # duplicate ids summed, as the dedup stage does
        opt.update(store, slots, grad.float(), lr=s.lr, step=s.step)
    want_w, want_s = _rounded_fp32_oracle(opt, w0, steps, dtype)
    assert store.storage().dtype == torch.float32 and store.weights().dtype == dtype
    assert torch.equal(store.weights(), want_w)
    assert torch.equal(store.state().view(torch.int32), want_s.view(torch.int32))  # counters bit for bit


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_fp16_adagrad_accumulator_no_longer_overflows(backend):
    if backend == "native" and not _native.available():
        pytest.skip("native kernels not built")
    opt = Adagrad(lr=1.0)  # after the big step, each unit gradient moves a weight by ~1/300: several fp16 ulps
    keys, big = torch.tensor([5]), torch.full((1, 2), 300.0)  # g^2 = 90000 > 65504, fp16's largest finite
    old = HashStore("t", 2, 2, dtype=torch.float16, init_state=opt.init_state, backend=backend)  # 16-bit state
    new = HashStore("t", 2, 2, dtype=torch.float16, init_state=opt.init_state, backend=backend,
                    layout=TableConfig("t", 2, dtype=torch.float16).row_layout(opt))
    for store, stuck in ((old, True), (new, False)):
        slot = store.find_or_insert(keys, step=1)
        before = store.weights()[slot].clone()
        opt.update(store, slot, big, lr=1.0, step=1)
        history = [store.weights()[slot].clone()]
        for step in range(2, 6):
            opt.update(store, slot, torch.full((1, 2), 1.0), lr=1.0, step=step)
            history.append(store.weights()[slot].clone())
        assert bool(torch.isinf(store.state()[slot]).all()) == stuck
        moved = [not torch.equal(a, b) for a, b in zip([before] + history, history)]
        if stuck:  # the documented failure of 16-bit state: the row never moves again
            assert not any(moved[1:])
        else:
            assert all(moved) and float(store.state()[slot][0, 0]) == 90000.0 + 4.0


# ---------------------------------------------------------------------- stochastic rounding

@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(dtype):
    ulp1 = torch.finfo(dtype).eps  # the gap above 1.0
    tiny = torch.finfo(dtype).tiny  # subnormal range below it
    xs = torch.tensor([1.0 + 0.3 * ulp1, -(3.0 + 2 * 0.7 * ulp1), 1.0 + 0.02 * ulp1, 0.37 * tiny, 2.0 - 0.5 * ulp1])
    xs = xs.float()
    draws = 4000
    got = torch.stack([round_stochastic(xs[None], dtype, seeds=11, step=s, keys=torch.tensor([2]))[0]
                       for s in range(1, draws + 1)])  # [draws, 5]
    near = xs.to(dtype).float()
    other = torch.nextafter(xs.to(dtype), torch.where(near < xs, torch.tensor(float("inf")),
                                                      torch.tensor(-float("inf"))).to(dtype)).float()
    lo, hi = torch.minimum(near, other).double(), torch.maximum(near, other).double()
    g = got.double()
    assert bool(((g == lo) | (g == hi)).all())  # always one of the two neighbours
    p = (xs.double() - lo) / (hi - lo)
    se = (hi - lo) * torch.sqrt(p * (1 - p) / draws)
    err = (g.mean(0) - xs.double()).abs()
    assert bool((err <= 4 * se + 1e-30).all()), (err / se)


def test_stochastic_rounding_keeps_exact_and_non_finite_values_and_is_deterministic():
    x = torch.tensor([[1.0, -2.5, float("inf"), float("nan"), 70000.0, 1e-3]])
    out = round_stochastic(x, torch.float16, seeds=1, step=1, keys=torch.tensor([0]))
    assert out[0, :2].tolist() == [1.0, -2.5] and out[0, 2] == float("inf") and bool(out[0, 3].isnan())
    assert out[0, 4] == float("inf")  # beyond fp16's range, as round-to-nearest
    y = torch.rand(64, 8) * 3
    sl = torch.arange(64)
    a = round_stochastic(y, torch.bfloat16, seeds=5, step=9, keys=sl)
    assert torch.equal(a, round_stochastic(y, torch.bfloat16, seeds=5, step=9, keys=sl))  # pure function
    assert not torch.equal(a, round_stochastic(y, torch.bfloat16, seeds=6, step=9, keys=sl))
    assert not torch.equal(a, round_stochastic(y, torch.bfloat16, seeds=5, step=10, keys=sl))
    assert not torch.equal(a, round_stochastic(y, torch.bfloat16, seeds=5, step=9, keys=sl + 1))


def test_sub_half_ulp_updates_survive_stochastic_rounding_and_vanish_to_nearest():
    rows, steps, g = 64, 1000, 5e-4  # bf16's half-ulp just below 1.0 is 2^-9 ~ 2e-3 > lr * g
    opt = SGD(lr=1.0)
    w0 = torch.ones(rows, 1)
    near = _packed_store(opt, w0, torch.bfloat16)
    sr = _packed_store(opt, w0, torch.bfloat16, stochastic=True, seed=3)
    slots = torch.arange(rows)
    for step in range(1, steps + 1):
        for store in (near, sr):
            opt.update(store, slots, torch.full((rows, 1), g), lr=1.0, step=step)
    exact = 1.0 - steps * g  # 0.5
    assert bool((near.weights() == 1.0).all())  # every update lost
    final = sr.weights().double()
    # per row the rounding errors are independent with variance <= ulp^2 / 4, ulp <= 2^-8 on [0.5, 1]
    sd_mean = (steps**0.5) * 2**-8 / 2 / rows**0.5
    assert abs(float(final.mean()) - exact) < 5 * sd_mean
    assert bool((final < 0.75).all())


def test_stochastic_rounding_runs_through_the_collection_and_depends_on_the_table_seed():
    def run(seed):
        ec = EmbeddingCollection([TableConfig("t", 3, num_rows=4, dtype=torch.bfloat16, combiner="sum",
                                              stochastic_rounding=True, seed=seed)], optimizer=SGD(lr=1e-3))
        for _ in range(3):
            ec(SparseFeatures.from_lists({"t": [[0, 1], [2]]}))["t"].float().sum().backward()
        return ec.store("t").weights().clone()

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


# ---------------------------------------------------------------------- end to end

def _batches(n_steps, rows, B, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        bags = [torch.randint(0, rows, (int(k),), generator=g).tolist() for k in torch.randint(0, 4, (B,), generator=g)]
        coef = torch.randint(-8, 9, (B, 4), generator=g).float() / 8  # exact in fp16, as are their small sums
        out.append((bags, coef))
    return out


def test_global_adam_on_fp16_trains_end_to_end_through_the_collection():
    rows, B, n = 10, 6, 7
    opt = Adam(lr=0.05, mode="global")
    ec = EmbeddingCollection([TableConfig("t", 4, num_rows=rows, dtype=torch.float16, combiner="sum")],
                             optimizer=opt)
    store = ec.store("t")
    assert store.layout.packed and store.state().dtype == torch.float32
    w0 = store.weights().float().clone()
    # the oracle: the rule on plain float32 rows, the weights rounded to fp16 after each step,
    # with the per-row gradient summed by hand (sum pooling: d loss / d row = sum of its bags' coef)
    storage = torch.zeros(rows, 4 + opt.state_width(4))
    storage[:, :4] = w0
    opt.init_state(storage[:, 4:])
    for step, (bags, coef) in enumerate(_batches(n, rows, B, 0), start=1):
        (ec(SparseFeatures.from_lists({"t": bags}))["t"].float() * coef).sum().backward()
        grad = torch.zeros(rows, 4)
        for b, ids in enumerate(bags):
            for i in ids:
                grad[i] += coef[b]
        touched = torch.tensor(sorted({i for ids in bags for i in ids}), dtype=torch.int64)
        if touched.numel():
            with pytest.MonkeyPatch.context() as m:
                m.setattr(_native, "available", lambda: False)
                m.setattr(_adam, "negligible_fraction", lambda _dt: torch.finfo(torch.float16).eps / 16)
                opt.apply(storage, touched, grad[touched], lr=0.05, step=step)
            storage[:, :4] = storage[:, :4].half().float()
    assert ec.step == n
    assert torch.equal(store.weights(), storage[:, :4].half())
    assert torch.equal(store.state().view(torch.int32), storage[:, 4:].view(torch.int32))
    counters = store.state()[:, 8].view(torch.int32)
    assert int(counters.max()) == max(s for s, (bags, _) in enumerate(_batches(n, rows, B, 0), 1) if any(bags))
    assert bool(torch.isfinite(store.state()).all()) and not torch.equal(store.weights().float(), w0)


def test_default_fp32_path_still_runs_the_native_kernels(monkeypatch):
    if not _native.available():
        pytest.skip("native kernels not built")
    calls = {"native": 0, "torch": 0}
    native, twin = RowWiseAdagrad._apply_native, RowWiseAdagrad._apply_torch

    def spy_native(self, *a):
        calls["native"] += 1
        return native(self, *a)

    def spy_torch(self, *a):
        calls["torch"] += 1
        return twin(self, *a)

    monkeypatch.setattr(RowWiseAdagrad, "_apply_native", spy_native)
    monkeypatch.setattr(RowWiseAdagrad, "_apply_torch", spy_torch)
    batch = SparseFeatures.from_lists({"a": [[1, 2], [3]], "b": [[0], [1, 1]]})
    ec = EmbeddingCollection([TableConfig("a", 4), TableConfig("b", 4, num_rows=5)], optimizer=RowWiseAdagrad(lr=0.1))
    assert not any(s.layout.packed for _, s in ec.stores())
    out = ec(batch)
    (out["a"].sum() + out["b"].sum()).backward()
    assert calls == {"native": 2, "torch": 0}
    ec16 = EmbeddingCollection([TableConfig("a", 4, dtype=torch.float16)], optimizer=RowWiseAdagrad(lr=0.1))
    ec16(SparseFeatures.from_lists({"a": [[1, 2], [3]]}))["a"].float().sum().backward()
    assert calls == {"native": 2, "torch": 1}


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_global_adam_catch_up_through_a_packed_store_equals_the_rounded_oracle(dtype):
    opt = Adam(lr=0.05, mode="global")
    w0, steps = make_problem(8, 3, 6, seed=5, lr=0.05)
    store = _packed_store(opt, w0, dtype)
    for s in steps:
        slots, grad = s.summed()
        opt.update(store, slots, grad.float(), lr=0.05, step=s.step)
    opt.catch_up(store, torch.arange(8), step=9, lr=0.05)
    # the oracle: the same steps, then a catch-up of its own plain float32 rows, rounded
    dim = w0.shape[1]
    weights, state = _rounded_fp32_oracle(opt, w0, steps, dtype, catch_up_to=9, lr=0.05)
    assert torch.equal(store.weights(), weights)
    assert torch.equal(store.state().view(torch.int32), state.view(torch.int32))
    assert bool((store.state()[:, 2 * dim].view(torch.int32) == 9).all())
    with pytest.raises(InputError, match="dim=4, the store's rows have dimension 3"):
        opt.catch_up(store, torch.arange(2), step=9, dim=4)


def test_update_on_a_packed_store_checks_its_inputs_before_writing():
    opt = Adagrad(lr=0.1)
    store = _packed_store(opt, torch.randn(4, 3), torch.float16)
    before = store.storage().clone()
    with pytest.raises(InputError, match="Adagrad.update: the table's rows have dimension 3 .* dimension 2"):
        opt.update(store, torch.tensor([1]), torch.ones(1, 2), lr=0.1, step=1)
    with pytest.raises(IndexError, match="slot 4 at position 1 is out of range for a table of 4 rows"):
        opt.update(store, torch.tensor([0, 4]), torch.ones(2, 3), lr=0.1, step=1)
    with pytest.raises(InputError, match="Adagrad.update: step must be >= 1"):
        opt.update(store, torch.tensor([0]), torch.ones(1, 3), lr=0.1, step=0)
    assert torch.equal(store.storage(), before)
    opt.update(store, torch.tensor([], dtype=torch.int64), torch.ones(0, 3), lr=0.1, step=1)  # no-op
    assert torch.equal(store.storage(), before)
