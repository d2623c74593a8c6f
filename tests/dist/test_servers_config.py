"""--servers M without processes: the planner puts every shard on the servers, and bad values stop the launch with
one line (exit 2) before any process starts."""

from __future__ import annotations

import pytest

from hugeembed.cli import main
from hugeembed.distributed import propose_plan
from hugeembed.errors import ConfigError, ShardingError
from hugeembed.nn import TableConfig
from hugeembed.training import TrainConfig, Trainer
from hugeembed.types import ShardKind

TABLES = [TableConfig("big", 8, num_rows=400_000), TableConfig("mid1", 8, num_rows=60_000),
          TableConfig("mid2", 8, num_rows=50_000), TableConfig("mid3", 8, num_rows=40_000),
          TableConfig("tiny", 8, num_rows=100), TableConfig("dyn", 8)]


@pytest.mark.parametrize("servers", [1, 2])
def test_the_planner_puts_every_shard_on_the_servers(servers):
    plan = propose_plan(TABLES, 5, servers=servers)
    held = {r for n in plan.tables() if plan.kind(n) is not ShardKind.DATA_PARALLEL for r in plan[n].ranks}
    assert held == set(range(5 - servers, 5))  # the servers, all of them
    assert plan["tiny"].kind is ShardKind.DATA_PARALLEL and plan["tiny"].ranks == (0, 1, 2, 3, 4)
    assert plan["dyn"].kind is ShardKind.ROW_WISE and plan["dyn"].ranks == tuple(range(5 - servers, 5))
    # without servers: the same rules over every rank
    assert {r for n in ("big", "dyn") for r in propose_plan(TABLES, 5)[n].ranks} == set(range(5))


def test_an_override_may_place_a_shard_on_a_worker():
    plan = propose_plan(TABLES, 3, servers=1, overrides={"mid1": "table_wise@0"})
    assert plan["mid1"].ranks == (0,) and plan["big"].ranks == (2,)


def test_a_server_only_plan_that_cannot_hold_a_table_names_the_servers():
    budget = 10 << 20  # 26.4 MB of tables (the 400 k-row one 19.2 MB): over 2 servers they do not fit, over 3 they do
    with pytest.raises(ShardingError, match=r"no plan fits: rank [34] .*server ranks 3, 4 only: add servers"):
        propose_plan(TABLES[:-1], 5, budget, servers=2)
    plan = propose_plan(TABLES[:-1], 5, budget, servers=3)
    assert plan["big"].kind is ShardKind.ROW_WISE and plan["big"].ranks == (2, 3, 4)
    for bad in (-1, 5, True, 1.5):
        with pytest.raises(ConfigError, match="servers must be an int in"):
            propose_plan(TABLES, 5, servers=bad)


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "2", "--servers", "2"], "--servers 2 leaves no process to read the data: a run of 2 processes takes "
                                         "--servers 0..1"),
    (["--nproc", "2", "--servers", "-1"], "servers must be a non-negative integer, got -1"),
    (["--servers", "1"], "--servers are about several processes"),
    (["--nproc", "3", "--servers", "1", "--memory-per-rank", "100KB", "--capacity", "10000"],
     "no plan fits: rank 2 needs"),
])
def test_bad_server_counts_and_plans_stop_the_launch_with_one_line(flags, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *flags, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_the_python_api_refuses_servers_that_leave_no_worker():
    with pytest.raises(ConfigError, match="--servers 1 is about several processes"):
        Trainer(TrainConfig(servers=1, steps=1))
    with pytest.raises(ConfigError, match="servers must be a non-negative integer"):
        TrainConfig(servers=-2)


def test_column_wise_tables_spread_over_the_servers():
    from hugeembed.optim import SGD

    wide = TableConfig("wide", 64, num_rows=100_000, features=("f",))
    plan = propose_plan([wide], 6, 16 << 20, optimizer=SGD(lr=0.1), batch_size=100, ids_per_step={"wide": 400 * 20},
                        servers=4)
    assert plan["wide"].kind is ShardKind.COLUMN_WISE and plan["wide"].ranks == (2, 3, 4, 5)
