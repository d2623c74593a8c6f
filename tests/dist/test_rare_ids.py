"""Rare ids in sharded tables: the shared row and lr_count_scale on 2 and 4 gloo ranks against one process.

The CLI's default tables give ids seen fewer than k times one shared row per table
(TableConfig.shared_row) and may scale each row's step by its hit count (lr_count_scale).
N ranks fed the slices of the same global batches must train the tables one process trains:
the equalities of docs/distributed.md (forward outputs bit-identical; keys, hit counts, last
steps and pending keys equal, the shared row's included; rows allclose, table-wise ones bit
for bit) for every sharding kind, and a snapshot with a shared row reshards like any key.
"""

from __future__ import annotations

import pytest
import torch

from hugeembed import checkpoint as ckpt
from hugeembed.nn import EmbeddingCollection
from hugeembed.nn._rare import SHARED_ROW_KEY

from ._harness import run_ranks
from .common import GLOBAL_BATCH, assert_tables, export_all, local_batch, merge_shards, rare_tables, train
from .test_sharded import POOLED, plans, replicated
from .workers import EVAL_STEP

pytestmark = pytest.mark.dist

STEPS = 4
SHARED = ("user", "item", "page", "hist")  # the tables with a shared row


def cases(world: int) -> list[dict]:
    kinds = ("row_wise", "table_wise", "data_parallel", "mixed") if world == 2 else ("row_wise", "mixed")
    out = [{"name": f"adagrad/{k}", "opt": "adagrad", "plan": plans(world)[k], "steps": STEPS, "rare": True}
           for k in kinds]
    if world == 2:  # per-row state (one accumulator per row) and lazy Adam, row-wise
        out += [{"name": f"{o}/row_wise", "opt": o, "plan": plans(world)["row_wise"], "steps": STEPS, "rare": True}
                for o in ("rowwise_adagrad", "adam_lazy")]
    if world == 2:  # the CLI's default optimizer (Adam, per-row bias correction, no first moment), every kind
        out += [{"name": f"adam_per_row/{k}", "opt": "adam_per_row", "plan": plans(world)[k], "steps": STEPS,
                 "rare": True} for k in ("row_wise", "table_wise", "data_parallel")]
    # wide batches: most ids come once or twice, many stay pending and read the shared row to the end
    out += [{"name": f"wide/{k}", "opt": "adagrad", "plan": plans(world)[k], "steps": STEPS, "rare": True,
             "wide": True} for k in (("row_wise", "data_parallel") if world == 2 else ("mixed",))]
    return out


_REFS: dict = {}


def reference(opt: str, steps, wide: bool = False) -> dict:
    key = (opt, tuple(steps), wide)
    if key not in _REFS:
        ec = EmbeddingCollection(rare_tables(opt))
        first = train(ec, steps, wide=wide)
        ec.eval()
        with torch.no_grad():
            out = ec(local_batch(EVAL_STEP, 0, 1, wide))
            scored = torch.cat([out.concat().flatten(), out.unpooled["hist"].values.flatten()])
        _REFS[key] = {"tables": export_all(ec), "first": first, "eval": scored}
    return _REFS[key]


def check(results: list, world: int) -> int:
    B, width, checked = GLOBAL_BATCH // world, 4 * len(POOLED), 0
    for case in cases(world):
        what = f"{world} ranks, rare ids, {case['name']}"
        got = [r["cases"][case["name"]] for r in results]
        wide = case.get("wide", False)
        ref = reference(case["opt"], range(case["steps"]), wide)
        seq = ref["first"][GLOBAL_BATCH * width:].view(-1, 4)
        offs = local_batch(0, 0, 1, wide).feature("hist").offsets
        for rank, g in enumerate(got):  # forward outputs: bit-identical (rare ids read the same shared row)
            pooled = ref["first"][: GLOBAL_BATCH * width].view(GLOBAL_BATCH, width)[rank * B:(rank + 1) * B]
            rows = seq[int(offs[rank * B]):int(offs[(rank + 1) * B])]
            assert torch.equal(g["first"], torch.cat([pooled.flatten(), rows.flatten()])), f"{what}: rank {rank}"
        merged = merge_shards([g["tables"] for g in got], replicated(case["plan"]))
        assert_tables(merged, ref["tables"], set(), what)
        for name in POOLED:  # table-wise: bit for bit, but for the shared row (its ids' gradients add up in
            if case["plan"][name].startswith("table_wise"):  # another order than one process's)
                own = merged[name]["keys"] != SHARED_ROW_KEY
                assert torch.equal(merged[name]["rows"][own], ref["tables"][name]["rows"][own]), (what, name)
        for name in SHARED:  # the shared row is one row, held by one rank (every replica for data-parallel)
            assert int(merged[name]["keys"][0]) == SHARED_ROW_KEY, (what, name)
            holders = [r for r, g in enumerate(got) if SHARED_ROW_KEY in g["tables"][name]["keys"].tolist()]
            assert len(holders) == (world if case["plan"][name] == "data_parallel" else 1), (what, name, holders)
        scored = torch.cat([g["eval"][: B * width] for g in got] + [g["eval"][B * width:] for g in got])
        torch.testing.assert_close(scored, ref["eval"], rtol=1e-5, atol=1e-6)
        checked += 1
    return checked


def test_rare_ids_make_the_oracle_diverge():
    """The oracle is not blind: shared rows and scaled steps change what one process trains."""
    from hugeembed.nn import TableConfig

    plain = EmbeddingCollection([TableConfig(t.name, t.dim, num_rows=t.num_rows, combiner=t.combiner, ttl=t.ttl,
                                             max_norm=t.max_norm, default_id=t.default_id, optimizer=t.optimizer)
                                 for t in rare_tables()])
    train(plain, range(STEPS), wide=True)
    ref = reference("adagrad", range(STEPS), wide=True)["tables"]
    for name in SHARED:
        assert int(ref[name]["keys"][0]) == SHARED_ROW_KEY and ref[name]["pending_keys"].numel() > 0, name
        assert ref[name]["keys"].numel() < export_all(plain)[name]["keys"].numel(), name
    assert not torch.equal(export_all(plain)["country"]["rows"], ref["country"]["rows"])  # lr_count_scale acts


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """One process trains 3 steps and saves (its shared rows under key -1)."""
    root = tmp_path_factory.mktemp("rare")
    ec = EmbeddingCollection(rare_tables())
    train(ec, range(3))
    ckpt.save(root / "one", ec)
    return root


@pytest.mark.slow
def test_two_ranks_train_rare_ids_like_one_process_and_reshard_the_shared_row(snapshot):
    # one process's snapshot -> 2 ranks (row-wise: each shared row goes to the owner of key -1), 3 steps, save
    link = {"plan": plans(2)["row_wise"], "opt": "adagrad", "rare": True, "load": str(snapshot / "one"),
            "train": (3, 6), "save": str(snapshot / "two")}
    two = run_ranks(2, "tests.dist.workers:main", {"cases": cases(2), "chain": [link]})
    assert check(two, 2) == 11
    ec = EmbeddingCollection(rare_tables())  # 2 ranks' snapshot -> one process: as if never split
    ckpt.load(snapshot / "two", ec, restore_rng=False)
    assert ec.step == 6
    assert_tables(export_all(ec), reference("adagrad", range(6))["tables"], set(), "1 -> 2 -> 1 process, rare ids")


@pytest.mark.slow
def test_four_ranks_train_rare_ids_like_one_process():
    four = run_ranks(4, "tests.dist.workers:main", {"cases": cases(4)})
    assert check(four, 4) == 3
