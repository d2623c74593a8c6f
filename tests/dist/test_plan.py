"""Sharding plans and the planner, without processes: plain data in, plain data out."""

from __future__ import annotations

import math

import pytest
import torch

from hugeembed import ConfigError, ShardingError
from hugeembed.distributed import (AbsentShard, ShardArrayStore, ShardingPlan, TablePlacement, estimate_table,
                                   propose_plan)
from hugeembed.nn import TableConfig
from hugeembed.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from hugeembed.store import ArrayStore
from hugeembed.types import ShardKind

MiB = 1 << 20


def static(name: str, rows: int, dim: int = 16, **kw) -> TableConfig:
    return TableConfig(name, dim, num_rows=rows, **kw)


def test_placement_parsing_and_errors():
    plan = ShardingPlan(4, {"a": "row_wise", "b": "table_wise@3", "c": "data_parallel", "d": "row_wise@0,2",
                            "e": TablePlacement(ShardKind.TABLE_WISE, (1,)), "f": {"kind": "row_wise", "ranks": [1]}})
    assert plan["a"] == TablePlacement("row_wise", (0, 1, 2, 3))
    assert plan["b"].kind is ShardKind.TABLE_WISE and plan["b"].owner == 3
    assert plan["c"].ranks == (0, 1, 2, 3)
    assert plan["d"].ranks == (0, 2)
    assert plan["f"] == TablePlacement("row_wise", (1,))
    with pytest.raises(ConfigError, match="table_wise needs its rank"):
        ShardingPlan(2, {"a": "table_wise"})
    with pytest.raises(ConfigError, match="rank 2 .* outside the world of 2"):
        ShardingPlan(2, {"a": "table_wise@2"})
    with pytest.raises(ConfigError, match="replicated on every rank"):
        ShardingPlan(2, {"a": TablePlacement("data_parallel", (0,))})
    with pytest.raises(ConfigError, match="exactly one rank"):
        TablePlacement("table_wise", (0, 1))
    with pytest.raises(ConfigError, match="unknown ShardKind 'sideways'"):
        ShardingPlan(2, {"a": "sideways"})
    with pytest.raises(ConfigError, match="repeat a rank"):
        TablePlacement("row_wise", (1, 1))
    with pytest.raises(KeyError, match="places no table 'zz'"):
        plan["zz"]


def test_round_trip_override_and_validate():
    tables = [static("a", 10), static("b", 20), TableConfig("c", 8)]
    plan = ShardingPlan(2, {"a": "data_parallel", "b": "table_wise@1", "c": "row_wise"})
    again = ShardingPlan.from_dict(plan.to_dict())
    assert again == plan and again.to_dict() == plan.to_dict()
    assert plan.to_dict() == {"world_size": 2, "tables": {"a": {"kind": "data_parallel", "ranks": [0, 1]},
                                                          "b": {"kind": "table_wise", "ranks": [1]},
                                                          "c": {"kind": "row_wise", "ranks": [0, 1]}}}
    moved = plan.with_placement("b", "row_wise")
    assert moved["b"].kind is ShardKind.ROW_WISE and plan["b"].kind is ShardKind.TABLE_WISE  # immutable
    plan.validate(tables)
    with pytest.raises(ShardingError, match=r"places no table \['d'\]"):
        plan.validate(tables + [TableConfig("d", 4)])
    with pytest.raises(ShardingError, match=r"tables \['c'\] that the collection does not have"):
        plan.validate(tables[:2])
    with pytest.raises(ConfigError, match="exactly 'world_size' and 'tables'"):
        ShardingPlan.from_dict({"tables": {}})
    uni = ShardingPlan.uniform(tables, 2, "table_wise")
    assert [uni[t.name].owner for t in tables] == [0, 1, 0]


def test_printing_names_every_table_kind_rank_and_bytes():
    tables = [static("small", 10, 4), static("big", 1000, 8), TableConfig("dyn", 8)]
    plan = ShardingPlan(2, {"small": "data_parallel", "big": "table_wise@1", "dyn": "row_wise"})
    text = str(plan)
    assert text.splitlines()[0] == "ShardingPlan(world_size=2)"
    assert "small  data_parallel  0,1" in text and "big    table_wise     1" in text and "row_wise" in text
    full = plan.describe(tables, optimizer=SGD(lr=0.1), batch_size=100)
    big_bytes = 1000 * 8 * 4 + 1000 * 16  # rows x D x float32 + per-row count and last step
    assert f"{big_bytes / 1024:.2f} KiB" in full
    assert "unbounded" in full  # a dynamic table with no capacity or hint
    assert full.splitlines()[-1].startswith("bytes per rank: 0: ")


def test_estimate_matches_an_independent_formula():
    e = estimate_table(static("t", 1000, 16), Adam(lr=0.01), batch_size=64, world_size=2)
    assert e.bytes == 1000 * (16 + 32) * 4 + 1000 * 16  # Adam keeps m and v per row
    assert e.ids_per_step == 64 * 2 and e.cost == 64 * 2 * 16
    d = estimate_table(TableConfig("u", 8, capacity=500, dtype=torch.float16), RowWiseAdagrad(lr=0.1))
    # fp16 weights packed into 4 float32 columns + 1 float32 accumulator; 32-byte bucket at load 0.6
    assert d.bounded and d.bytes == pytest.approx(500 * ((4 + 1) * 4 + 32 / 0.6))
    d16 = estimate_table(TableConfig("u", 8, capacity=500, dtype=torch.float16, state_dtype=torch.float16),
                         RowWiseAdagrad(lr=0.1))
    assert d16.bytes == pytest.approx(500 * ((8 + 1) * 2 + 32 / 0.6))
    hint = estimate_table(TableConfig("u", 8), SGD(lr=0.1), expected_rows={"u": 70})
    assert hint.rows == 70 and hint.bounded
    assert not estimate_table(TableConfig("u", 8), SGD(lr=0.1)).bounded


def test_planner_small_replicated_big_row_wise_rest_balanced():
    opt = Adagrad(lr=0.1)
    tables = [static("tiny", 50, 4)] + [static(f"m{i}", 10_000 * (i + 1), 16) for i in range(6)] + \
             [static("huge", 200_000, 16), TableConfig("open", 16)]
    plan = propose_plan(tables, 4, 64 * MiB, optimizer=opt, data_parallel_below=MiB)  # (m0: 1.3 MiB)
    assert plan["tiny"].kind is ShardKind.DATA_PARALLEL
    assert plan["huge"].kind is ShardKind.ROW_WISE and plan["huge"].ranks == (0, 1, 2, 3)
    assert plan["open"].kind is ShardKind.ROW_WISE  # dynamic, size unknown: spread it
    tw = [f"m{i}" for i in range(6)]
    assert all(plan[n].kind is ShardKind.TABLE_WISE for n in tw)
    # greedy balancing: no rank holds more than the largest table above the fair share
    per_rank = [0.0] * 4
    for n in tw:
        per_rank[plan[n].owner] += estimate_table(next(t for t in tables if t.name == n), opt).bytes
    sizes = [estimate_table(next(t for t in tables if t.name == n), opt).bytes for n in tw]
    assert max(per_rank) <= sum(sizes) / 4 + max(sizes)
    assert len({plan[n].owner for n in tw}) == 4


def test_planner_balances_lookup_cost_when_memory_is_equal():
    tables = [static(f"t{i}", 20_000, 16) for i in range(4)]
    ids = {"t0": 100_000, "t1": 100_000, "t2": 10, "t3": 10}
    plan = propose_plan(tables, 2, 64 * MiB, optimizer=SGD(lr=0.1), ids_per_step=ids, data_parallel_below=0)
    assert plan["t0"].owner != plan["t1"].owner  # the two hot tables on different ranks


def test_planner_refuses_a_plan_that_does_not_fit_naming_rank_and_excess():
    opt = SGD(lr=0.1)
    tables = [static("a", 100_000, 32), static("b", 100_000, 32)]
    one = estimate_table(tables[0], opt).bytes
    budget = int(one * 0.75)
    with pytest.raises(ShardingError) as e:
        propose_plan(tables, 2, budget, optimizer=opt, data_parallel_below=0)
    # both go row-wise (neither fits a rank whole): each rank needs one table's bytes
    over = math.ceil(one - budget)
    assert "rank 0 needs" in str(e.value) and f"over by {over} bytes" in str(e.value)
    fits = propose_plan(tables, 2, int(one * 1.01), optimizer=opt, data_parallel_below=0, row_wise_above=int(one * 2))
    assert {fits["a"].owner, fits["b"].owner} == {0, 1}


def test_planner_overrides_and_argument_errors():
    tables = [static("a", 100, 4), static("b", 100, 4)]
    plan = propose_plan(tables, 2, overrides={"a": "table_wise@1"})
    assert plan["a"] == TablePlacement("table_wise", (1,)) and plan["b"].kind is ShardKind.DATA_PARALLEL
    with pytest.raises(ConfigError, match="unknown tables"):
        propose_plan(tables, 2, overrides={"zz": "row_wise"})
    with pytest.raises(ConfigError, match="world_size"):
        propose_plan(tables, 0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_shard_array_store_rows_equal_the_unsharded_table(n):
    whole = ArrayStore("t", 10, 4, 1, seed=5)
    shards = [ShardArrayStore("t", 10, 4, 1, shard=i, num_shards=n, seed=5) for i in range(n)]
    assert sum(len(s) for s in shards) == 10
    for i, s in enumerate(shards):
        keys = s.keys()
        assert torch.equal(keys, torch.arange(i, 10, n))
        assert torch.equal(s.storage(), whole.storage()[keys])
        slots = s.find_or_insert(keys[:2], step=3, counts=torch.tensor([2, 1]))
        assert torch.equal(slots, torch.arange(min(2, len(keys))))
        ex = s.export()
        assert ex.counts[: len(slots)].tolist() == [2, 1][: len(slots)] and int(ex.last_step[0]) == 3
        fresh = ShardArrayStore("t", 10, 4, 1, shard=i, num_shards=n, seed=5)
        fresh.import_(ex)
        assert torch.equal(fresh.export().counts, ex.counts)
    if n > 1:
        with pytest.raises(ShardingError, match="does not belong to shard 0"):
            shards[0].find(torch.tensor([1]))
    absent = AbsentShard("t", 4, 1, torch.float32, "cpu", 5, None, (1,))
    assert len(absent) == 0 and absent.export().keys.numel() == 0
    with pytest.raises(ShardingError, match="lives on rank"):
        absent.find(torch.tensor([0]))
