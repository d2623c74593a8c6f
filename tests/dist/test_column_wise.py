"""Column-wise tables (each rank of the placement holds a block of every row's columns) on 2 and 3 gloo
ranks against one process on the same global batches.

Oracle: one EmbeddingCollection trained on the global batches (tests/dist/workers_colwise.py's
tables and loss, linear in the pooled vectors).  Every block owner runs the lookup backward over
the whole global batch, as a table-wise owner does, and the supported rules update each column on
its own, so rows train bit for bit — but for a table's shared row of rare ids, whose ids'
gradients add up in another order (float rounding; as for table-wise tables, docs/distributed.md).
Forward outputs: the first step bit for bit, later ones to float rounding (they read the shared row).
"""

from __future__ import annotations

import pytest
import torch

from hugeembed import checkpoint as ckpt
from hugeembed.nn import EmbeddingCollection
from hugeembed.nn._rare import SHARED_ROW_KEY

from ._harness import run_ranks
from .common import GLOBAL_BATCH
from .workers_colwise import colwise_tables, scored, train

pytestmark = pytest.mark.dist

TABLES = ("user", "item", "country", "page")
COLWISE = {t: "column_wise" for t in TABLES}


def reference(opt: str, steps, load=None):
    ec = EmbeddingCollection(colwise_tables(opt))
    if load is not None:
        ckpt.load(load, ec, restore_rng=False)
    outs = train(ec, steps)
    return ec, outs, scored(ec)


FIELDS = ("keys", "rows", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step")


def table_of(states: list[dict], t: str) -> dict:
    """Table `t`'s fields from state_dicts (one whole table, or the shards of several ranks), keys ascending
    (a sharded gather sorts them; one process keeps slot order)."""
    k = f"tables.{t}."
    cat = {f: torch.cat([s[k + f] for s in states]) for f in FIELDS}
    order, porder = cat["keys"].argsort(), cat["pending_keys"].argsort()
    return {f: v[porder if f.startswith("pending") else order] for f, v in cat.items()}


def assert_same_table(got: dict, want: dict, what: str, exact: bool = True) -> None:
    """Bit for bit, but for the shared row's values (float rounding); `exact` False: rows to float rounding
    (a row-wise table's gradients are summed per rank first)."""
    for f in FIELDS:
        g, w = got[f], want[f]
        assert g.shape == w.shape, (what, f, g.shape, w.shape)
        if f == "rows":
            own = (want["keys"] != SHARED_ROW_KEY) & exact
            assert torch.equal(g[own], w[own]), (what, f, (g[own] - w[own]).abs().max())
            torch.testing.assert_close(g[~own], w[~own], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(g, w), (what, f)


def assert_same_tables(got: dict, want: dict, what: str, exact: bool = True) -> None:
    assert int(got["step"]) == int(want["step"]), what
    for t in TABLES:
        assert_same_table(table_of([got], t), table_of([want], t), f"{what}, table {t}", exact)


def check_case(results: list, world: int, name: str, ref) -> None:
    ec, outs, ev = ref
    B = GLOBAL_BATCH // world
    want = ec.state_dict()
    for rank, res in enumerate(results):
        got = res["cases"][name]
        what = f"{world} ranks, {name}, rank {rank}"
        sl = slice(rank * B, (rank + 1) * B)
        assert torch.equal(got["outputs"][0], outs[0][sl]), what
        for o, w in zip(got["outputs"], outs):
            torch.testing.assert_close(o, w[sl], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["eval"], ev[sl], rtol=1e-5, atol=1e-6)
        assert_same_tables(got["state"], want, what)


def test_column_blocks_are_the_columns_of_the_whole_rows():
    """The oracle is not blind: a block's rows are its columns (and their state) of one process's rows."""
    from hugeembed.distributed._column_wise import join_blocks, slice_block
    from hugeembed.optim import Adam

    rule = Adam(lr=0.1, mode="global")  # 2 per-element parts + a per-row counter
    rows = torch.arange(4 * (6 + rule.state_width(6)), dtype=torch.float32).view(4, -1)
    blocks = [slice_block(rows, rule, 6, lo, lo + 2) for lo in (0, 2, 4)]
    assert blocks[1][0].tolist() == [2, 3, 8, 9, 14, 15, 18]  # weights, m, v of columns 2-3, the counter
    assert torch.equal(join_blocks(blocks, rule, 6), rows)


def pad8(n: int) -> int:
    return n + (-n) % 8


def expected_bytes(step: int, rank: int, world: int) -> dict[str, list[int]]:
    """Oracle: what `rank` sends each block owner in one step when every table is column-wise over all
    ranks: per table, to every owner, its unique keys (8 B) + hit counts (4 B), each bag's length
    (4 B), each id's index into the keys (4 B) and weight (4 B, odd steps); each owner's block of the
    pooled vectors (4 D/n per bag) back, and their gradients (the same) to the owner.  Table "country"
    gives its empty bags the default id 3."""
    from .workers_colwise import local

    sf = local(step, rank, world)
    B, d = GLOBAL_BATCH // world, 6 // world
    ids_out = 0
    for t in TABLES:
        f = sf.feature(t)
        v = f.values
        if t == "country":  # its empty bags read the default id 3
            empty = int(((f.offsets[1:] - f.offsets[:-1]) == 0).sum())
            v = torch.cat([v, torch.full((empty,), 3, dtype=v.dtype)])
        n, i = v.unique().numel(), v.numel()
        ids_out += pad8(8 * n) + pad8(4 * n) + pad8(4 * B) + pad8(4 * i) + (pad8(4 * i) if step % 2 else 0)
    block = pad8(4 * B * d) * len(TABLES)
    return {"input_dist": [ids_out] * world, "output_dist": [block] * world, "grad_dist": [block] * world}


@pytest.mark.slow
def test_two_ranks_train_column_wise_tables_like_one_process(tmp_path):
    opts = ("sgd", "adagrad", "adam_lazy", "adam_global", "ftrl")
    cases = [{"name": o, "opt": o, "plan": COLWISE, "steps": (0, 4)} for o in opts]
    # one process's full snapshot + a delta on it: the column-wise ranks load the chain, each keeping its block
    one = EmbeddingCollection(colwise_tables("adagrad"))
    train(one, range(2))
    ckpt.save(tmp_path / "chain", one)
    train(one, range(2, 3))
    delta = ckpt.save(tmp_path / "chain", one, delta=True)
    cases.append({"name": "delta", "opt": "adagrad", "plan": COLWISE, "steps": (3, 5), "load": str(delta)})
    cases.append({"name": "save", "opt": "adagrad", "plan": COLWISE, "steps": (0, 3), "save": str(tmp_path / "two")})
    # bounded staleness: K = 0 is the synchronous run; K = 2 reads rows 2 steps late exactly as table-wise does
    tablewise = {t: f"table_wise@{i % 2}" for i, t in enumerate(TABLES)}
    cases += [{"name": "k0", "opt": "adam_lazy", "plan": COLWISE, "steps": (0, 4), "staleness": 0},
              {"name": "k2", "opt": "adagrad", "plan": COLWISE, "steps": (0, 5), "staleness": 2},
              {"name": "k2_tw", "opt": "adagrad", "plan": tablewise, "steps": (0, 5), "staleness": 2}]
    res = run_ranks(2, "tests.dist.workers_colwise:main", {"cases": cases})
    for o in opts:
        check_case(res, 2, o, reference(o, range(4)))
    check_case(res, 2, "k0", reference("adam_lazy", range(4)))
    check_case(res, 2, "delta", reference("adagrad", range(3, 5), load=delta))
    k2 = [table_of([r["cases"]["k2"]["state"]], t) for r in res for t in TABLES]  # both ranks hold every table
    tw = {t: table_of([r["cases"]["k2_tw"]["state"] for r in res], t) for t in TABLES}
    for i, got in enumerate(k2):
        assert_same_table(got, tw[TABLES[i % len(TABLES)]], f"staleness 2, rank {i // len(TABLES)}")
    sync = reference("adagrad", range(5))[1]
    for rank, r in enumerate(res):  # rows read 2 steps late: the outputs of table-wise's, not the synchronous ones
        for step, (o, w) in enumerate(zip(r["cases"]["k2"]["outputs"], r["cases"]["k2_tw"]["outputs"])):
            torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-6)
            assert (step == 0) == torch.equal(o, sync[step][rank * 6:(rank + 1) * 6]), (rank, step)
    for rank, r in enumerate(res):  # the exchange is per column block: bytes as the oracle counts them
        for step, got in enumerate(r["cases"]["sgd"]["bytes"]):
            for stage, want in expected_bytes(step, rank, 2).items():
                assert got[stage] == want, (rank, step, stage, got[stage], want)
    # the snapshot holds each rank's block (joined when read): one process loads it and trains on
    snap = res[0]["cases"]["save"]["saved"]
    assert res[1]["cases"]["save"]["saved"] == snap
    one = EmbeddingCollection(colwise_tables("adagrad"))
    ckpt.load(snap, one, restore_rng=False)
    assert_same_tables(one.state_dict(), reference("adagrad", range(3))[0].state_dict(), "2 ranks -> 1 process")


@pytest.mark.slow
def test_three_ranks_mixed_plans_and_resume_across_layouts(tmp_path):
    # one process saves after 2 steps; 3 ranks (column-wise beside the other kinds) resume it, train
    # 2 more and save; 2 ranks, all column-wise, resume that and train 2 more: all like one process
    ref0 = EmbeddingCollection(colwise_tables("adagrad"))
    train(ref0, range(2))
    ckpt.save(tmp_path / "one", ref0)
    mixed = {"user": "column_wise@0,2", "item": "column_wise", "country": "row_wise", "page": "table_wise@1"}
    refusals = {"dim": ("sgd", COLWISE, 4, {}), "rowwise_adagrad": ("rowwise_adagrad", COLWISE, 6, {}),
                "max_norm": ("sgd", COLWISE, 6, {"max_norm": 0.5}), "sequence": ("sgd", COLWISE, 6, {"combiner": "none"}),
                "norm_eviction": ("sgd", COLWISE, 6, {"evict_norm_below": 0.01}),
                "rounding": ("sgd", COLWISE, 6, {"dtype": torch.float16, "stochastic_rounding": True})}
    three = run_ranks(3, "tests.dist.workers_colwise:main", {"cases": [
        {"name": "mixed", "opt": "adagrad", "plan": mixed, "steps": (2, 4), "load": str(tmp_path / "one"),
         "save": str(tmp_path / "three")},
        *({"name": o, "opt": o, "plan": COLWISE, "steps": (0, 3)} for o in ("ftrl", "momentum", "adam_per_row"))],
        "refusals": refusals})
    ec, outs, ev = reference("adagrad", range(2, 4), load=tmp_path / "one")
    B = GLOBAL_BATCH // 3
    want = ec.state_dict()
    states = [r["cases"]["mixed"]["state"] for r in three]
    for rank, r in enumerate(three):
        for o, w in zip(r["cases"]["mixed"]["outputs"], outs):
            torch.testing.assert_close(o, w[rank * B:(rank + 1) * B], rtol=1e-5, atol=1e-6)
    holders = {"user": [0, 2], "item": [0, 1, 2], "page": [1]}  # each holds the whole table in its state_dict
    for t, ranks in holders.items():
        for rank in ranks:
            assert_same_table(table_of([states[rank]], t), table_of([want], t), f"3 ranks mixed, {t} on {rank}")
    assert table_of([states[1]], "user")["keys"].numel() == 0  # rank 1 holds no block of user
    assert_same_table(table_of(states, "country"), table_of([want], "country"), "3 ranks mixed, country",
                      exact=False)
    lines = {k: v for k, v in three[0]["refusals"].items()}
    assert lines["dim"].startswith("ConfigError: table 'user': column_wise over ranks [0, 1, 2]: dim 4 is not "
                                   "divisible by 3 ranks"), lines["dim"]
    assert "RowWiseAdagrad keeps state per row" in lines["rowwise_adagrad"], lines
    assert "max_norm clips by the whole row's norm" in lines["max_norm"], lines
    assert "combiner 'none'" in lines["sequence"], lines
    assert "evict_norm_below" in lines["norm_eviction"], lines
    assert "stochastic rounding" in lines["rounding"], lines
    assert all(v.startswith("ConfigError: table 'user'") and "\n" not in v for v in lines.values()), lines
    for o in ("ftrl", "momentum", "adam_per_row"):
        check_case(three, 3, o, reference(o, range(3)))
    two = run_ranks(2, "tests.dist.workers_colwise:main", {"cases": [
        {"name": "on", "opt": "adagrad", "plan": COLWISE, "steps": (4, 6), "load": three[0]["cases"]["mixed"]["saved"]}]})
    check_case(two, 2, "on", reference("adagrad", range(4, 6), load=three[0]["cases"]["mixed"]["saved"]))
    final = EmbeddingCollection(colwise_tables("adagrad"))
    train(final, range(2))
    train(final, range(2, 4))
    train(final, range(4, 6))
    assert_same_tables(two[0]["cases"]["on"]["state"], final.state_dict(), "1 -> 3 -> 2 ranks vs one process",
                       exact=False)  # the row-wise leg of country rounds
