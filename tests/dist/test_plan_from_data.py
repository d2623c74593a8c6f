"""The trainer's plan with the data's distinct ids (expected_rows): small dynamic tables of synthetic data or of
converted shards are replicated; text files give no hint.  No processes: the plan a 2-rank run would build."""

from __future__ import annotations

import pytest
import torch

from hugeembed.data import CRITEO_KAGGLE_CARDINALITIES, convert, load_schema
from hugeembed.nn import EmbeddingCollection
from hugeembed.training import TrainConfig
from hugeembed.training._build import build_model
from hugeembed.training._distributed import expected_rows, run_plan
from hugeembed.training._sources import run_schema
from hugeembed.types import ShardKind


def _plan(cfg: TrainConfig):
    """The plan and the tables of a 2-rank run of `cfg`, as the trainer builds them."""
    got = {}

    def planned(tables, *, optimizer, **kw):
        got["plan"], got["tables"] = run_plan(cfg, 2, tables, optimizer), tables
        return EmbeddingCollection(tables, optimizer=optimizer, **kw)

    build_model(cfg, torch.device("meta"), 1, run_schema(cfg), collection_factory=planned)
    return got["plan"], got["tables"]


def _replicated(plan) -> set[str]:
    return {name for name, p in plan.placements.items() if p.kind is ShardKind.DATA_PARALLEL}


def test_synthetic_data_replicates_its_small_features():
    cfg = TrainConfig(synthetic_max_cardinality=1_000_000)
    plan, tables = _plan(cfg)
    cards = {f"C{j + 1}": min(c, 1_000_000) for j, c in enumerate(CRITEO_KAGGLE_CARDINALITIES)}
    assert expected_rows(cfg, tables) == {name: c + 1 for name, c in cards.items()}  # + the missing id
    tiny = {name for name, c in cards.items() if c <= 30}  # a few KiB each
    assert tiny == {"C6", "C9", "C14", "C17", "C20", "C22", "C23"} and tiny <= _replicated(plan)
    assert _replicated(plan) <= {name for name, c in cards.items() if c <= 10_000}  # 2 MiB: < 10k rows of dim 16 with Adam
    assert _replicated(_plan(cfg.replace(size_from_data=False))[0]) == set()  # --no-size-from-data: as before
    # the others row-wise as without sizes (sized, the planner would put mid-size ones table-wise)
    assert {p.kind for name, p in plan.placements.items() if name not in _replicated(plan)} == {ShardKind.ROW_WISE}


def _csv(tmp_path, rows: int = 4000):
    (tmp_path / "s.toml").write_text('format = "csv"\nheader = true\n[label]\ncolumn = "y"\n[sparse.user]\n'
                                     '[sparse.country]\n')
    lines = ["y,user,country"] + [f"{i % 2},{i},{i % 5}" for i in range(rows)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    return load_schema(tmp_path / "s.toml")


@pytest.mark.parametrize("capacity", [None, 3])
def test_converted_shards_replicate_their_small_features_text_gives_no_hint(tmp_path, capacity):
    schema = _csv(tmp_path)
    convert(tmp_path / "d.csv", tmp_path / "shards", schema=schema)
    common = dict(schema=str(tmp_path / "s.toml"), embedding_dim=64, batch_size=32, capacity=capacity)
    plan, tables = _plan(TrainConfig(data=str(tmp_path / "shards"), **common))
    hint = expected_rows(TrainConfig(data=str(tmp_path / "shards"), **common), tables)
    if capacity is None:  # 4000 users (~1.2 MiB at dim 64 with Adam's state) stay sharded, 5 countries replicated
        assert abs(hint["user"] - 4000) <= 200 and hint["country"] == 5 and _replicated(plan) == {"country"}
        assert plan["user"].kind is ShardKind.ROW_WISE
    else:  # at most the capacity's rows: both small
        assert hint == {"user": 3, "country": 3} and _replicated(plan) == {"user", "country"}
    text_plan, _ = _plan(TrainConfig(data=str(tmp_path / "d.csv"), **common))
    # the text's distinct ids are unknown before reading it all: only a capacity bounds its tables
    assert _replicated(text_plan) == (set() if capacity is None else {"user", "country"})
