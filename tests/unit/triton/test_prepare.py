"""The triton clean + dedup (functional/_triton_prepare.py) against prepare_torch: the same Prepared,
field by field, over drawn batches (duplicates, empty bags, default ids, every out-of-range policy,
unpooled features, dynamic tables, with and without dedup), the same errors for bad input, one read of
the device, and no dependence on the order the kernels' programs run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed.errors import InputError
from hugeembed.features import SparseFeatures
from hugeembed.functional import FeatureSpec, TableSpec
from hugeembed.functional._plan import LookupPlan
from hugeembed.functional._reference import prepare_torch
from hugeembed.functional._triton_prepare import prepare_triton

from tests.bench._load import load_bench

from ._batches import DEV

pytestmark = pytest.mark.triton

FIELDS = ("batch_size", "offsets", "inverse", "weights", "unique_keys", "unique_counts", "unique_base", "unique_count",
          "capacity", "deduplicated", "feature_starts", "unique_tables", "packed")


def assert_same(got, want) -> None:
    assert got is not None
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and torch.equal(g, w), (name, g, w)
        else:
            assert g == w, (name, g, w)


@st.composite
def cases(draw):
    """(plan, batch): 1-3 tables of 1-6 rows (or dynamic), 1-3 features with any combiner, policy and
    default id, bags of 0-4 ids from -2..7 (out of range, negative, repeated), weights or not."""
    T = draw(st.integers(1, 3))
    dynamic = draw(st.booleans())
    rows = [draw(st.integers(1, 6)) for _ in range(T)]
    tables = [TableSpec(f"t{i}", 4, num_rows=None if dynamic else r) for i, r in enumerate(rows)]
    feats = []
    for k in range(draw(st.integers(1, 3))):
        t = draw(st.integers(0, T - 1))
        policy = draw(st.sampled_from(["prune", "default"] if not dynamic else ["prune"]))
        default = draw(st.one_of(st.none(), st.integers(0, rows[t] - 1))) if policy == "prune" else 0
        feats.append(FeatureSpec(f"f{k}", f"t{t}", source=f"in{draw(st.integers(0, 1))}", default_id=default,
                                 combiner=draw(st.sampled_from(["sum", "mean", "sqrtn", "none"])),
                                 out_of_range=policy, prune_negative=draw(st.booleans()) or policy == "default"))
    B = draw(st.integers(1, 3))
    lengths = [draw(st.integers(0, 4)) for _ in range(2 * B)]
    values = torch.tensor([draw(st.integers(-2, 7)) for _ in range(sum(lengths))], dtype=torch.int64)
    w = torch.tensor([draw(st.sampled_from([0.5, 1.0, 2.0, 0.0, -1.0])) for _ in range(values.numel())])
    sf = SparseFeatures(["in0", "in1"], values, lengths=torch.tensor(lengths),
                        weights=w if draw(st.booleans()) else None, batch_size=B)
    return LookupPlan(tables, feats), sf.to(DEV)


@settings(max_examples=25)
@given(cases(), st.booleans())
def test_equals_prepare_torch(case, deduplicate):
    plan, sf = case
    try:
        want = prepare_torch(plan, sf, deduplicate)
    except InputError as e:  # (a static id out of range with no policy: never drawn; a negative id kept)
        with pytest.raises(InputError) as got:
            prepare_triton(plan, sf, deduplicate)
        assert str(got.value) == str(e)
        return
    assert_same(prepare_triton(plan, sf, deduplicate), want)


def _plan(**feature) -> LookupPlan:
    return LookupPlan([TableSpec("a", 4, num_rows=5), TableSpec("b", 4, num_rows=3)],
                      [FeatureSpec("x", "a", combiner="sum", **feature), FeatureSpec("y", "b")])


def _batch(values, lengths, weights=None, offsets=None) -> SparseFeatures:
    w = None if weights is None else torch.tensor(weights, dtype=torch.float32)
    if offsets is not None:
        return SparseFeatures(["x", "y"], torch.tensor(values), offsets=torch.tensor(offsets), weights=w,
                              batch_size=2).to(DEV)
    return SparseFeatures(["x", "y"], torch.tensor(values), lengths=torch.tensor(lengths), weights=w).to(DEV)


@pytest.fixture(params=[None, 2], ids=["bag_block", "bag_block2"])
def bag_block(request, monkeypatch):
    """The default bags per clean / scatter program, or 2: several programs, each finding its own."""
    if request.param is not None:
        from hugeembed._triton import prepare

        monkeypatch.setattr(prepare, "BAG_BLOCK", request.param)


@pytest.mark.parametrize("case", ["out_of_range", "weight_nan", "weight_inf", "offsets_decrease", "offsets_past_end",
                                  "offsets_start"])
def test_bad_input_raises_prepare_torchs_error(case, bag_block):
    plan = _plan()
    values, lengths, weights, offsets = [1, 4, 2, 9, 0, 1], [2, 1, 2, 1], None, None
    if case == "out_of_range":
        values = [1, 4, 2, 7, 0, 1]  # x's 7 (5 rows): the first out of range by (feature, position)
        values[5] = 5  # y's 5 (3 rows): a later feature
    elif case.startswith("weight"):
        values = [1, 4, 2, 1, 0, 1]
        weights = [1.0, 1.0, float("nan") if case == "weight_nan" else float("inf"), 1.0, float("nan"), 1.0]
    else:
        values = [1, 4, 2, 1, 0, 1]
        offsets = {"offsets_decrease": [0, 2, 1, 5, 6], "offsets_past_end": [0, 2, 3, 5, 9],
                   "offsets_start": [1, 2, 3, 5, 6]}[case]
    sf = _batch(values, lengths, weights, offsets)
    with pytest.raises(InputError) as want:
        prepare_torch(plan, sf)
    with pytest.raises(InputError) as got:
        prepare_triton(plan, sf)
    assert str(got.value) == str(want.value)


def test_programs_in_any_order_give_the_same_result(bag_block):
    plan = _plan(default_id=3)
    sf = _batch([1, 4, 1, 2, 0, 2, 2, 1], [3, 0, 2, 3], [1.0, 2.0, 0.5, 1.0, -1.0, 1.0, 3.0, 1.0])
    want = prepare_torch(plan, sf)
    for seed in range(3):
        assert_same(prepare_triton(plan, sf, shuffle=seed), want)


def test_programs_in_any_order_give_the_same_result_on_dynamic_tables(bag_block, monkeypatch):
    """Dynamic tables: two sorts, _run_heads gathering their order (its programs read neighbours' entries:
    blocks of 4 entries, several programs)."""
    from hugeembed.functional import _triton_prepare

    monkeypatch.setattr(_triton_prepare, "_BLOCK", 4)
    plan = LookupPlan([TableSpec("a", 4), TableSpec("b", 4)],
                      [FeatureSpec("x", "a", combiner="sum"), FeatureSpec("y", "b"), FeatureSpec("z", "a")])
    values = torch.tensor([2**40, -7, 2**40, 5, -7, 5, 0, 2**62, 5, -(2**63), 3])
    sf = SparseFeatures(["x", "y", "z"], values, lengths=torch.tensor([3, 0, 2, 1, 2, 3])).to(DEV)
    want = prepare_torch(plan, sf)
    for seed in range(3):
        assert_same(prepare_triton(plan, sf, shuffle=seed), want)


def test_one_read_of_the_device_and_a_few_launches():
    """The stage's launches, counted by bench/ops.py's CountLaunches: 4 kernels, 2 scans, 1 sort, the
    report and the counts zeroed, the report read, the unique keys' table column as the fetch's int64 (11),
    whatever the tables."""
    ops = load_bench("ops")
    for T in (1, 4):
        plan = LookupPlan([TableSpec(f"t{i}", 4, num_rows=6) for i in range(T)],
                          [FeatureSpec(f"f{i}", f"t{i}", combiner="sum") for i in range(T)])
        sf = SparseFeatures([f"f{i}" for i in range(T)], torch.arange(2 * T) % 6,
                            lengths=torch.ones(2 * T, dtype=torch.int64)).to(DEV)
        plan.arrays(DEV), plan.source_indices(sf.keys(), DEV)  # (the plan's constants: made once, not per batch)
        with ops.CountLaunches() as counter:
            prepare_triton(plan, sf)
        assert counter.syncs() == 1 and counter.launches() == 11, (dict(counter.ops), dict(counter.kernels))


def test_what_the_kernels_do_not_take_returns_none():
    plan = _plan()
    sf = _batch([1, 4, 2, 1, 0, 1], [2, 1, 2, 1], [1.0] * 6)
    w = sf.weights().to(torch.float64)
    assert prepare_triton(plan, SparseFeatures(["x", "y"], sf.values(), lengths=sf.lengths(), weights=w)) is None
    grad = sf.weights().clone().requires_grad_()
    assert prepare_triton(plan, SparseFeatures(["x", "y"], sf.values(), lengths=sf.lengths(), weights=grad)) is None
