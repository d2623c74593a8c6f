"""Column-wise placements and the planner's choice of them, without processes (plain data)."""

from __future__ import annotations

import json

import pytest

from hugeembed import ConfigError
from hugeembed.distributed import ShardingPlan, TablePlacement, estimate_table, propose_plan
from hugeembed.nn import TableConfig
from hugeembed.optim import SGD, RowWiseAdagrad
from hugeembed.types import ShardKind

MiB = 1 << 20


def wide(dim: int = 64, rows: int = 100_000, **kw) -> TableConfig:
    return TableConfig("wide", dim, num_rows=rows, features=("f",), **kw)


def test_column_wise_placements_parse_print_and_round_trip():
    plan = ShardingPlan(3, {"a": "column_wise", "b": "column_wise@0,2"})
    assert plan["a"] == TablePlacement("column_wise", (0, 1, 2)) and plan["b"].ranks == (0, 2)
    assert ShardingPlan.from_dict(plan.to_dict()) == plan
    assert "column_wise  0,2" in str(plan)
    plan.validate([TableConfig("a", 6), TableConfig("b", 4)])
    with pytest.raises(ConfigError) as e:
        plan.validate([TableConfig("a", 8), TableConfig("b", 4)])
    assert str(e.value).startswith("table 'a': column_wise over ranks [0, 1, 2]: dim 8 is not divisible by 3 ranks")
    assert "\n" not in str(e.value)


def test_estimate_of_a_column_wise_share_and_the_exchanges():
    e = estimate_table(wide(), SGD(lr=0.1), batch_size=100, world_size=4, ids_per_step={"wide": 2000})
    rows_bytes, index = 100_000 * 64 * 4, 100_000 * 16  # SGD keeps no state; a static table's counts + steps
    share = e.share(TablePlacement("column_wise", (0, 1, 2, 3)), 4)
    assert share.rows == 100_000 and share.bytes == rows_bytes / 4 + index and share.ids == 2000
    bags = 100 * 4  # global batch x one feature
    remote = 3 / 4  # of 4 ranks' shares, 3 are another rank's
    assert e.exchange_bytes(ShardKind.ROW_WISE, 4) == 2000 * (12 + 8 * 64) * remote
    assert e.exchange_bytes(ShardKind.COLUMN_WISE, 4) == (4 * (16 * 2000 + 4 * bags) + 8 * 64 * bags) * remote


def test_planner_picks_column_wise_for_a_table_over_the_budget_with_big_bags():
    opt = SGD(lr=0.1)
    big_bags = {"wide": 400 * 20}  # 20 ids per bag: pooled vectors travel instead of rows
    plan = propose_plan([wide()], 4, 16 * MiB, optimizer=opt, batch_size=100, ids_per_step=big_bags)
    assert estimate_table(wide(), opt).bytes > 16 * MiB  # no rank holds it whole
    assert plan["wide"] == TablePlacement("column_wise", (0, 1, 2, 3))
    assert "column_wise" in plan.describe([wide()], optimizer=opt, ids_per_step=big_bags, batch_size=100)
    # row-wise stays where it exchanges less (one id per bag) or where column-wise cannot hold the table
    for tables, ids, rule in (([wide()], None, opt), ([wide(dim=66)], big_bags, opt),
                              ([wide()], big_bags, RowWiseAdagrad(lr=0.1)), ([wide(max_norm=1.0)], big_bags, opt)):
        plan = propose_plan(tables, 4, 16 * MiB, optimizer=rule, batch_size=100, ids_per_step=ids)
        assert plan["wide"].kind is ShardKind.ROW_WISE, (tables, ids, rule)
    # a table that fits one rank stays table-wise, however big its bags
    small = wide(rows=1000)
    plan = propose_plan([small], 4, 16 * MiB, optimizer=opt, batch_size=100, ids_per_step=big_bags,
                        data_parallel_below=0, row_wise_above=16 * MiB)
    assert plan["wide"].kind is ShardKind.TABLE_WISE


def test_planner_keeps_row_wise_when_the_column_blocks_do_not_fit():
    # dynamic rows keep a 53-byte hash bucket each in every block: 4 blocks of a narrow table don't fit
    t = TableConfig("wide", 8, capacity=400_000, features=("f",))
    opt = SGD(lr=0.1)
    e = estimate_table(t, opt)
    budget = int(e.bytes / 4 * 1.5)  # row-wise fits (a quarter each), column-wise (whole index each) not
    col = e.share(TablePlacement("column_wise", (0, 1, 2, 3)), 4).bytes
    assert col > budget
    plan = propose_plan([t], 4, budget, optimizer=opt, batch_size=100, ids_per_step={"wide": 400 * 50})
    assert plan["wide"].kind is ShardKind.ROW_WISE


def test_a_run_on_converted_shards_plans_with_their_ids_per_bag(tmp_path):
    """The CLI's planner input: converted shards' mean ids per bag (the whole data, from the manifest)."""
    import torch

    from hugeembed.data import convert, load_schema
    from hugeembed.nn import EmbeddingCollection
    from hugeembed.training import TrainConfig
    from hugeembed.training._build import build_model
    from hugeembed.training._distributed import run_plan
    from hugeembed.training._sources import run_schema

    (tmp_path / "s.toml").write_text('format = "csv"\nheader = true\n[label]\ncolumn = "y"\n[sparse.user]\n'
                                     '[sparse.tags]\nseparator = "|"\n')
    lines = ["y,user,tags"] + [f"{i % 2},{i},{'|'.join(str(i * 7 + j) for j in range(i % 9))}" for i in range(90)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    convert(tmp_path / "d.csv", tmp_path / "shards", schema=load_schema(tmp_path / "s.toml"))
    # a manifest from before distinct_ids (its 91 users would be replicated): plans by ids per bag as before
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert set(manifest.pop("distinct_ids")) == {"user", "tags"}
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps(manifest))
    tags = sum(max(i % 9, 1) for i in range(90)) / 90  # the oracle: ids over rows (an empty cell: its missing id)
    from hugeembed.data import ShardSet
    assert ShardSet(tmp_path / "shards").ids_per_bag() == {"user": 1.0, "tags": pytest.approx(tags)}
    plans = {}
    for data in (str(tmp_path / "shards"), None):
        cfg = TrainConfig(data=data, embedding_dim=64, capacity=4096, batch_size=32) if data else \
            TrainConfig(embedding_dim=64, capacity=4096, batch_size=32)

        def planned(tables, *, optimizer, **kw):
            plans[data] = run_plan(cfg, 2, tables, optimizer)
            return EmbeddingCollection(tables, optimizer=optimizer, **kw)

        build_model(cfg, torch.device("meta"), 1, run_schema(cfg), collection_factory=planned)
    assert plans[str(tmp_path / "shards")]["tags"].kind is ShardKind.COLUMN_WISE  # 4 ids a bag
    assert plans[str(tmp_path / "shards")]["user"].kind is ShardKind.ROW_WISE  # 1 id a bag
    assert all(p.kind is not ShardKind.COLUMN_WISE for p in plans[None].placements.values())  # synthetic: 1 a bag


def test_cli_refuses_a_column_wise_dim_the_ranks_do_not_divide_before_launching(tmp_path, capsys):
    """A resume (or a run) onto 3 processes of a table of dim 64: one line naming the table, no process started."""
    from hugeembed.cli import main

    code = main(["train", "--nproc", "3", "--embedding-dim", "64", "--steps", "1", "--shard", "C1=column_wise",
                 "--checkpoint-dir", str(tmp_path / "ck"), "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == ("hugeembed train: error: table 'C1': column_wise over ranks [0, 1, 2]: dim 64 is not divisible by "
                   "3 ranks; use a dim divisible by the number of ranks, or list fewer ranks (e.g. 'column_wise@0,1')")
