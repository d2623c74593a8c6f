"""Splitting --memory-budget between tiered tables by traffic, in one process and per rank under a plan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed.distributed import ShardingPlan
from hugeembed.errors import ConfigError
from hugeembed.nn import TableConfig
from hugeembed.store import SLOT_METADATA_BYTES
from hugeembed.training._tiers import split_memory_budget, split_memory_budget_per_rank

ROW = 32  # dim 4 fp32 + Adagrad state
SLOT = ROW + SLOT_METADATA_BYTES


def floor_rows(traffic: float) -> int:
    return int(2 * max(1.0, traffic) + 1)


table_specs = st.lists(st.tuples(st.one_of(st.none(), st.integers(1, 5000)), st.floats(1.0, 500.0)),
                       min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(specs=table_specs, extra=st.integers(0, 2_000_000))
def test_one_process_shares_respect_floor_cap_and_budget(specs, extra):
    tables = [TableConfig(f"t{i}", 4, num_rows=n) for i, (n, _) in enumerate(specs)]
    traffic = {f"t{i}": tr for i, (_, tr) in enumerate(specs)}
    cap = {t.name: None if t.num_rows is None else t.num_rows * SLOT for t in tables}
    floor = {t.name: min(floor_rows(traffic[t.name]) * SLOT, cap[t.name] or 1 << 62) for t in tables}
    budget = sum(floor.values()) + extra
    share = split_memory_budget(tables, budget, traffic, {t.name: ROW for t in tables})
    assert sum(share.values()) <= budget
    for name, b in share.items():
        assert b >= floor[name]
        assert cap[name] is None or b <= cap[name]
    if any(c is None for c in cap.values()):  # an uncapped table takes what is left (to rounding)
        assert budget - sum(share.values()) < 4 * len(tables) + 1
    open_ = [t.name for t in tables if cap[t.name] is None]
    for a in open_:  # more traffic never means a smaller share among uncapped tables
        for b in open_:
            if traffic[a] > traffic[b]:
                assert share[a] >= share[b]


def test_one_process_budget_too_small_names_every_table():
    tables = [TableConfig("a", 4), TableConfig("b", 4, num_rows=3)]
    with pytest.raises(ConfigError, match=r"memory-budget 100 B .* a 2415 B, b 207 B"):
        split_memory_budget(tables, 100, {"a": 17.0, "b": 9.0}, {"a": ROW, "b": ROW})


def test_per_rank_shares_fit_every_rank_budget_and_agree():
    tables = [TableConfig("rw", 4), TableConfig("st", 4, num_rows=1000), TableConfig("tw", 4),
              TableConfig("dp", 4, num_rows=50)]
    plan = ShardingPlan(2, {"rw": "row_wise", "st": "row_wise", "tw": "table_wise@1", "dp": "data_parallel"})
    traffic = {"rw": 400.0, "st": 300.0, "tw": 200.0, "dp": 40.0}
    budget = 200_000
    share = split_memory_budget_per_rank(tables, plan, budget, traffic, {t.name: ROW for t in tables})
    held = {0: ["rw", "st", "dp"], 1: ["rw", "st", "tw", "dp"]}
    for r, names in held.items():
        assert sum(share[n] for n in names) <= budget, r
    # a row-wise shard holds half the static rows: its cache never exceeds them
    assert share["st"] <= 500 * SLOT
    # the data-parallel replica is capped at its whole table, on every rank
    assert share["dp"] == 50 * SLOT
    # a row-wise shard's floor is two batches of its half of the traffic; rank 0 alone would give
    # the row-wise tables more (it holds no tw): the shared tables take rank 1's smaller share
    alone = split_memory_budget([tables[0], tables[1], tables[3]], budget, {"rw": 200.0, "st": 150.0, "dp": 40.0},
                                {t.name: ROW for t in tables}, {"rw": None, "st": 500, "dp": 50})
    assert share["rw"] < alone["rw"]
    assert share["rw"] >= floor_rows(200.0) * SLOT


def test_per_rank_budget_too_small_names_the_rank():
    tables = [TableConfig("a", 4), TableConfig("b", 4)]
    plan = ShardingPlan(2, {"a": "table_wise@0", "b": "table_wise@1"})
    rows = {"a": ROW, "b": ROW}
    with pytest.raises(ConfigError, match="rank 1: memory-budget"):
        split_memory_budget_per_rank(tables, plan, 10 * SLOT, {"a": 1.0, "b": 50.0}, rows)
