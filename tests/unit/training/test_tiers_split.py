"""Splitting --memory-budget between tiered tables by traffic, in one process and per rank under a plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed.distributed import ShardingPlan
from hugeembed.errors import ConfigError
from hugeembed.nn import TableConfig
from hugeembed.store import SLOT_METADATA_BYTES
from hugeembed.training._tiers import shard_traffic, split_memory_budget, split_memory_budget_per_rank

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
    # ids per step each rank's shard holds: st skewed towards rank 0 (its ids mostly even)
    traffic = {0: {"rw": 200.0, "st": 120.0, "dp": 40.0}, 1: {"rw": 200.0, "st": 30.0, "tw": 200.0, "dp": 40.0}}
    budget = 200_000
    rows = {t.name: ROW for t in tables}
    share = split_memory_budget_per_rank(tables, plan, budget, traffic, rows)
    held = {0: ["rw", "st", "dp"], 1: ["rw", "st", "tw", "dp"]}
    for r, names in held.items():
        assert sum(share[n] for n in names) <= budget, r
    assert share["st"] <= 500 * SLOT  # a row-wise shard holds half the static rows
    assert share["dp"] == 50 * SLOT  # a replica holds the whole (small) table, on every rank
    # every shard of st gets two batches of its busiest shard's ids, rank 1's too
    assert share["st"] >= floor_rows(120.0) * SLOT
    # rank 0 alone would give rw more (it holds no tw): shared tables take the smaller share
    alone = split_memory_budget([tables[0], tables[1], tables[3]], budget, traffic[0], rows,
                                {"rw": None, "st": 500, "dp": 50})
    assert share["rw"] < alone["rw"]
    assert share["rw"] >= floor_rows(200.0) * SLOT


def test_per_rank_budget_too_small_names_the_rank():
    tables = [TableConfig("a", 4), TableConfig("b", 4)]
    plan = ShardingPlan(2, {"a": "table_wise@0", "b": "table_wise@1"})
    rows = {"a": ROW, "b": ROW}
    with pytest.raises(ConfigError, match="rank 1: memory-budget"):
        split_memory_budget_per_rank(tables, plan, 10 * SLOT, {0: {"a": 1.0}, 1: {"b": 50.0}}, rows)


def test_shard_traffic_counts_the_ids_each_rank_holds():
    """Oracle: distinct ids of the global batch, owned by key mod n (static), by the mixed hash
    (dynamic), all of them for a table-wise owner and for every replica."""
    from hugeembed._hashing import mix64_int
    from hugeembed.data import Batch
    from hugeembed.features import SparseFeatures

    tables = [TableConfig("st", 4, num_rows=100), TableConfig("dyn", 4), TableConfig("tw", 4),
              TableConfig("dp", 4)]
    plan = ShardingPlan(2, {"st": "row_wise", "dyn": "row_wise", "tw": "table_wise@1", "dp": "data_parallel"})
    ids = [{"st": [[0, 2, 4], [4, 6], [1]], "dyn": [[11, 12], [13, 11], [99]], "tw": [[1], [1], [2]],
            "dp": [[5], [], [6, 7]]},
           {"st": [[3], [5], [7, 8]], "dyn": [[1000], [1001], [1002]], "tw": [[3], [4], [5]], "dp": [[5], [5], [5]]}]
    batches = [Batch(torch.zeros(3, 1), SparseFeatures.from_lists(b), torch.zeros(3)) for b in ids]
    got = shard_traffic(tables, batches, plan)
    want = {0: {}, 1: {}}
    for b in ids:
        for name, bags in b.items():
            uniq = {k for bag in bags for k in bag}
            for r in (0, 1):
                if name == "st":
                    n = sum(1 for k in uniq if k % 2 == r)
                elif name == "dyn":
                    n = sum(1 for k in uniq if (mix64_int(k) & 0xFFFFFFFF) % 2 == r)
                elif name == "tw":
                    n = len(uniq) if r == 1 else None
                else:
                    n = len(uniq)
                if n is not None:
                    want[r].setdefault(name, []).append(n)
    want = {r: {k: sum(v) / len(v) for k, v in per.items()} for r, per in want.items()}
    assert got == want
    assert got[0]["st"] == 2.5 and got[1]["st"] == 2.0  # (4 + 1) / 2 and (1 + 3) / 2: not an even split


def test_auto_device_keeps_a_tiered_run_on_the_cpu(monkeypatch):
    """--device auto picks CUDA when present, but a run with disk-tiered tables (rows in host memory
    and files, CPU only) runs on the CPU instead of being refused."""
    from hugeembed.training import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("auto", tiered=True) == torch.device("cpu")
    assert resolve_device("cpu", tiered=True) == torch.device("cpu")
