"""Segment reduce + fused optimizer (hugeembed._triton.segment_optim) against the torch reference:
prepare_torch + backward_torch (the gradient rows) + the rule's torch twin (SparseOptimizer.update)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hugeembed._hashing import _ROUNDING_SALT, _MASK64, mix64_int
from hugeembed._triton._grid import shuffled_programs
from hugeembed._triton.dedup import dedup
from hugeembed._triton.segment_optim import PooledGrads, bag_terms, segment_update
from hugeembed.errors import InputError
from hugeembed.features import SparseFeatures
from hugeembed.functional import FeatureSpec, TableSpec
from hugeembed.functional._plan import LookupPlan
from hugeembed.functional._reference import backward_torch
from hugeembed.optim import FTRL, SGD, Adagrad, Adam, MomentumSGD, RowWiseAdagrad
from hugeembed.optim._kernel_params import kernel_params
from hugeembed.store import RowLayout

from ._batches import DEV, batches, entries, group_base, prepared

pytestmark = pytest.mark.triton

RULES = {
    "sgd": SGD(lr=0.1),
    "sgd_wd": SGD(lr=0.1, weight_decay=0.01),
    "momentum": MomentumSGD(lr=0.1, momentum=0.9),
    "nesterov_wd": MomentumSGD(lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.02),
    "adagrad": Adagrad(lr=0.1, initial_accumulator_value=0.1, lr_decay=0.01, weight_decay=0.01),
    "rowwise_adagrad": RowWiseAdagrad(lr=0.1, weight_decay=0.01),
    "adam_lazy": Adam(lr=0.01),
    "adam_lazy_tf_l2": Adam(lr=0.01, epsilon="tf", weight_decay=0.01),
    "adam_per_row": Adam(lr=0.01, bias_correction="per_row"),
    "adam_global": Adam(lr=0.01, mode="global"),
    "adam_global_tf_adamw": Adam(lr=0.01, mode="global", epsilon="tf", weight_decay=0.1,
                                 decoupled_weight_decay=True),
    "ftrl": FTRL(lr=0.1),
    "ftrl_power": FTRL(lr=0.1, lr_power=-0.3, l1=0.01, l2=0.01, l2_shrinkage=0.01, beta=0.1),
}
# (weight dtype, stochastic rounding)
DTYPES = {"f32": (torch.float32, False), "bf16": (torch.bfloat16, False), "f16_sr": (torch.float16, True),
          "f16": (torch.float16, False), "bf16_sr": (torch.bfloat16, True)}
SEEDS = (11, 22, 33)  # per table


class _Group:
    """A row group as SparseOptimizer.update reads it: a layout and one storage tensor."""

    def __init__(self, layout: RowLayout, storage: torch.Tensor) -> None:
        self.layout, self._storage = layout, storage

    def storage(self) -> torch.Tensor:
        return self._storage


def _group(rule, plan, dtype, sr, seed=0):
    D = plan.tables[0].dim
    lay = RowLayout(dim=D, dtype=dtype, state_width=rule.state_width(D), stochastic_rounding=sr)
    R = sum(t.num_rows for t in plan.tables)
    storage = lay.empty(R, DEV).zero_()  # (a packed row's padding too: rows compare whole)
    g = torch.Generator().manual_seed(seed)
    lay.weights(storage).copy_(torch.randn(R, D, generator=g).to(DEV))
    rule.init_state(lay.state(storage)) if lay.state_width else None
    return _Group(lay, storage)


def _reference_step(rule, plan, prep, group, grads, lr, step, base):
    """backward_torch's gradient rows, then the rule's torch twin on the group's rows."""
    T = plan.num_tables
    slots = prep.unique_keys  # static tables: a key is its row
    rows = backward_torch(plan, prep, [None] * T, slots, grads, [None] * len(plan.groups))
    ts = torch.cat([torch.full((prep.unique_count[t],), t, device=DEV) for t in range(T)])
    keys = prep.unique_keys
    if keys.numel() == 0:
        return
    seeds = torch.tensor(SEEDS[:T], device=DEV)[ts]
    rule.update(group, base[ts] + keys, torch.cat(rows), lr=lr, step=step, keys=keys, seeds=seeds)


def _triton_step(rule, plan, prep, group, grads, lr, step, base, chunk=64):
    lay = group.layout
    ids, table, _ = entries(plan, prep)
    _, rows_of, R = group_base(plan)
    dd = dedup(ids, table, base, rows_of, R)
    B, F = prep.batch_size, plan.num_features
    bag_of, denom = bag_terms(prep.offsets, prep.weights, plan.arrays()["combiner"], B, ids.numel())
    D = lay.dim
    src = PooledGrads(grads[0].reshape(-1, D), torch.arange(F, dtype=torch.int32, device=DEV), bag_of, denom, prep.weights, B, F)
    storage = group.storage()
    sr = lay.stochastic_rounding
    segment_update(dd, src, lay.weights(storage), lay.state(storage), kernel_params(rule, lr, step, lay.dtype),
                   step=step, chunk=chunk, keys=ids, table_seed=torch.tensor(SEEDS[: plan.num_tables], device=DEV) if sr
                   else None, rounding_mix=mix64_int((step ^ _ROUNDING_SALT) & _MASK64))


def _assert_rows_equal(got: _Group, want: _Group):
    lay = got.layout
    gw, ww = lay.weights(got.storage()), lay.weights(want.storage())
    if lay.dtype == torch.float32:
        torch.testing.assert_close(gw, ww, rtol=2e-6, atol=1e-7)
    else:  # 16-bit: within one unit in the last place (a float32 ulp apart may round across)
        ulp = torch.finfo(lay.dtype).eps * ww.float().abs().clamp(min=torch.finfo(lay.dtype).tiny)
        assert ((gw.float() - ww.float()).abs() <= ulp * 1.01).all(), (gw, ww)
        assert (gw == ww).float().mean() >= 0.9
    gs, ws = lay.state(got.storage()), lay.state(want.storage())
    if lay.state_width:
        torch.testing.assert_close(gs, ws, rtol=2e-6, atol=1e-7)


def _run_both(rule, plan, sf, dtype, sr, steps=(1, 4), chunk=64):
    prep = prepared(plan, sf)
    base, _, _ = group_base(plan)
    ref, tri = _group(rule, plan, dtype, sr), _group(rule, plan, dtype, sr)
    g = torch.Generator().manual_seed(5)
    for step in steps:
        B, D = prep.batch_size, plan.tables[0].dim
        grads = [torch.randn(B, plan.num_features, D, generator=g).to(DEV)]
        _reference_step(rule, plan, prep, ref, grads, 0.05, step, base)
        _triton_step(rule, plan, prep, tri, grads, 0.05, step, base, chunk)
    _assert_rows_equal(tri, ref)
    return tri


def _fixed_batch(dim=3):
    """Two tables, three features (two share t0), weights, a hot id (5 in t0) and an empty bag."""
    plan = LookupPlan([TableSpec("t0", dim, num_rows=7), TableSpec("t1", dim, num_rows=4)],
                      [FeatureSpec("a", "t0", combiner="sum"), FeatureSpec("b", "t1", combiner="mean"),
                       FeatureSpec("c", "t0", combiner="sqrtn")])
    lengths = [3, 0, 4, 2, 1, 2, 5, 1, 2]  # B = 3
    values = [5, 1, 5, 5, 5, 2, 5, 0, 3, 3, 3, 1, 5, 5, 5, 6, 5, 5, 0, 2]
    weights = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.25, 1.0, 3.0, 1.0, 2.0, 0.5, 1.0, 1.0, 0.75, 1.0, 2.0, 1.0, 0.5,
                            1.0, 1.0, 1.5])
    return plan, SparseFeatures(["a", "b", "c"], torch.tensor(values), lengths=torch.tensor(lengths),
                                weights=weights).to(DEV)


# every rule in float32 and in one 16-bit case (the 16-bit cases rotate over the rules); the rest of
# the rule x dtype product runs slow-marked
_LOW = [d for d in DTYPES if d != "f32"]
_FAST = [(r, "f32") for r in RULES] + [(r, _LOW[i % len(_LOW)]) for i, r in enumerate(RULES)]
_SLOW = [(r, d) for r in RULES for d in _LOW if (r, d) not in _FAST]


def _every(name, dt):
    """Two steps (the second three steps later: global Adam replays the gap) on a batch with a hot row."""
    plan, sf = _fixed_batch()
    _run_both(RULES[name], plan, sf, *DTYPES[dt])


@pytest.mark.parametrize("name,dt", _FAST)
@pytest.mark.slow
def test_every_rule_equals_reference(name, dt):
    _every(name, dt)


@pytest.mark.slow
@pytest.mark.parametrize("name,dt", _SLOW)
def test_every_rule_and_dtype_equals_reference(name, dt):
    _every(name, dt)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam_global", "ftrl"])
def test_hot_rows_split_across_programs(name):
    """chunk=2: id 5 of t0 (11 entries) is summed by six programs and combined in order."""
    plan, sf = _fixed_batch()
    _run_both(RULES[name], plan, sf, torch.float32, False, chunk=2)


@settings(max_examples=12)
@given(case=batches(), name=st.sampled_from(sorted(RULES)), dt=st.sampled_from(sorted(DTYPES)),
       chunk=st.sampled_from([1, 3, 64]))
def test_random_batches_equal_reference(case, name, dt, chunk):
    plan, sf = case
    _run_both(RULES[name], plan, sf, *DTYPES[dt], steps=(2,), chunk=chunk)


def test_empty_batch_changes_nothing():
    plan = LookupPlan([TableSpec("t0", 3, num_rows=5)], [FeatureSpec("a", "t0", combiner="sum")])
    for sf in (SparseFeatures(["a"], torch.tensor([-1, -1]), lengths=torch.tensor([2, 0])),
               SparseFeatures(["a"], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64))):
        rule = RULES["adam_global"]
        before = _group(rule, plan, torch.float32, False).storage().clone()
        tri = _run_both(rule, plan, sf.to(DEV), torch.float32, False)
        assert torch.equal(tri.storage(), before)


def test_shuffled_program_order_gives_identical_rows():
    plan, sf = _fixed_batch()
    with shuffled_programs(7):
        shuffled = _run_both(RULES["adam_global"], plan, sf, torch.bfloat16, True, chunk=2)
    plain = _run_both(RULES["adam_global"], plan, sf, torch.bfloat16, True, chunk=2)
    lay = plain.layout
    assert torch.equal(lay.weights(shuffled.storage()), lay.weights(plain.storage()))
    assert torch.equal(lay.state(shuffled.storage()), lay.state(plain.storage()))


def test_bad_arguments_raise_and_change_nothing():
    plan, sf = _fixed_batch()
    prep = prepared(plan, sf)
    rule = RULES["sgd"]
    grp = _group(rule, plan, torch.float32, False)
    before = grp.storage().clone()
    with pytest.raises(InputError, match="gradient float32"):
        _triton_step(rule, plan, prep, grp, [torch.zeros(3, 3, 3, dtype=torch.float64, device=DEV)], 0.1, 1,
                     group_base(plan)[0])
    with pytest.raises(InputError, match="step must be"):
        _triton_step(rule, plan, prep, grp, [torch.zeros(3, 3, 3, device=DEV)], 0.1, 0, group_base(plan)[0])
    assert torch.equal(grp.storage(), before)
