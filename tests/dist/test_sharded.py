"""Sharded tables on 2 and 4 gloo ranks against one process on the same global batches.

Few process groups, many checks each: the 2-rank and 4-rank groups train every sharding
kind with several optimizers (and a DDP dense model), measure the bytes they exchange,
and pass snapshots along a chain 1 -> 2 -> 4 -> 2 ranks (plans changing on the way);
the test process compares everything with its own single-process runs.

Exactness (see docs/distributed.md): forward outputs are bit-identical for every kind;
table-wise tables train bit-identically (the owner runs the lookup backward over the
whole global batch, as one process does); row-wise and data-parallel rows are summed
per rank first, then over ranks, so they agree to float rounding (allclose); keys, hit
counts, last steps and pending (not yet admitted) keys are always equal.
"""

from __future__ import annotations

import pytest
import torch

from hugeembed import checkpoint as ckpt
from hugeembed._hashing import mix64_int
from hugeembed.nn import EmbeddingCollection

from ._harness import run_ranks
from .common import (GLOBAL_BATCH, OPTIMIZERS, assert_tables, dense_model, export_all, local_batch, merge_shards,
                     tables, train, typed_rows)
from .workers import EVAL_STEP

pytestmark = pytest.mark.dist

ALL = ("user", "item", "country", "page", "hist")
POOLED = ALL[:4]
STEPS = 3


def plans(world: int) -> dict[str, dict[str, str]]:
    return {
        "row_wise": {t: "row_wise" for t in ALL},
        "table_wise": {t: f"table_wise@{i % world}" for i, t in enumerate(ALL)},
        "data_parallel": {t: "data_parallel" for t in ALL},
        "mixed": {"user": f"table_wise@{world - 1}", "item": "row_wise", "country": "data_parallel",
                  "page": "row_wise@0" if world > 2 else "table_wise@0", "hist": "row_wise"},
    }


def cases(world: int, opts, dense_kinds=("row_wise", "table_wise", "data_parallel", "mixed")) -> list[dict]:
    out = [{"name": f"{opt}/{kind}", "opt": opt, "plan": plan, "steps": STEPS}
           for opt in opts for kind, plan in plans(world).items() if kind != "mixed"]
    out += [{"name": f"{opt}/mixed", "opt": opt, "plan": plans(world)["mixed"], "steps": STEPS} for opt in opts[:2]]
    out += [{"name": f"dense/{kind}", "opt": "adagrad", "plan": plans(world)[kind], "steps": STEPS, "dense": True}
            for kind in dense_kinds]
    out.append({"name": "bytes", "opt": "sgd", "plan": plans(world)["row_wise"], "steps": 2})
    # 16-bit weights with float32 state packed into one record: rows move whole between ranks
    out += [{"name": f"{dt}/{opt}/{kind}", "opt": opt, "plan": plans(world)[kind], "steps": STEPS, "dtype": dt}
            for dt, opt, kind in (("float16", "adam_global", "row_wise"), ("bfloat16", "adagrad", "table_wise"))]
    return out


def held_per_step(plan: dict[str, str], world: int, steps, wide: bool) -> dict[str, int]:
    """Oracle: the most rows of each table any rank's shard reads in one step (the global batch's
    distinct ids that the rank holds under `plan`; an empty country bag reads its default id 3)."""
    most = {name: 1 for name in ALL}
    for step in steps:
        sf = local_batch(step, 0, 1, wide)
        for name in ALL:
            ids = set(sf.feature(name).values.tolist())
            if name == "country" and bool((sf.feature(name).lengths() == 0).any()):
                ids.add(3)
            kind = plan[name]
            for rank in range(world):
                if kind.startswith("row_wise"):
                    n = sum(1 for k in ids if owner(k, world, name == "country") == rank)
                else:
                    n = len(ids) if kind == "data_parallel" or kind == f"table_wise@{rank}" else 0
                most[name] = max(most[name], n)
    return most


def tiered_cases(world: int, root) -> list[dict]:
    """Pairs of cases on wide batches (ids rarely repeat across steps): in memory ("wide/...") and
    with every table on disk ("tiered/...", each case its own directory, each rank a
    subdirectory), each shard's cache holding just one step's rows: every table misses."""
    out = []
    for c in cases(world, ["adagrad", "adam_global"]):
        if c.get("dense") or c["name"] == "bytes":
            continue
        rows = held_per_step(c["plan"], world, [*range(c["steps"]), EVAL_STEP], wide=True)
        tier = {"dir": str(root / "tiers" / c["name"].replace("/", "-")) if root else None, "cache_rows": rows}
        out += [{**c, "name": "wide/" + c["name"], "wide": True},
                {**c, "name": "tiered/" + c["name"], "wide": True, "tiered": tier}]
    return out


# -- single-process references ------------------------------------------------------------------------------------


_REFS: dict = {}


def reference(opt: str, steps: int, dense: bool, dtype: str = "float32"):
    key = (opt, steps, dense, dtype)
    if key not in _REFS:
        ec = EmbeddingCollection(tables(opt, dtype=dtype))
        model = dense_model(16) if dense else None
        dopt = torch.optim.Adam(model.parameters(), lr=0.01) if dense else None
        first = train(ec, range(steps), dense=model, dense_opt=dopt)
        ec.eval()
        with torch.no_grad():
            out = ec(local_batch(EVAL_STEP, 0, 1))
            scored = torch.cat([out.concat().flatten(), out.unpooled["hist"].values.flatten()])
        _REFS[key] = {"tables": export_all(ec), "first": first, "eval": scored,
                      "dense": None if model is None else model.state_dict()}
    return _REFS[key]


CHAIN_OPT = "adam_global"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """The unsharded run the snapshot chain must reproduce: tables after steps 3, 6, 8 and 10."""
    root = tmp_path_factory.mktemp("chain")
    ec = EmbeddingCollection(tables(CHAIN_OPT))
    train(ec, range(0, 3))
    ckpt.save(root / "s1", ec)
    at = {3: export_all(ec)}
    for a, b in ((3, 6), (6, 8), (8, 10)):
        train(ec, range(a, b))
        at[b] = export_all(ec)
    return {"root": root, "at": at}


EVAL_BATCHES = [3, 1]  # rank 0 scores 3 held-out batches, rank 1 one: it looks up empty ones meanwhile


@pytest.fixture(scope="module")
def two(chain):
    root = chain["root"]
    link = {"plan": plans(2)["row_wise"], "opt": CHAIN_OPT, "load": str(root / "s1"), "train": (3, 6),
            "save": str(root / "s2")}
    # a full snapshot at step 5, then a delta at 7 (rows seen since, keys evicted since)
    delta = {"plan": plans(2)["mixed"], "opt": CHAIN_OPT, "load": str(root / "s1"), "train": (3, 5),
             "save": str(root / "d2"), "evict_to": 3, "then_delta": (5, 7)}
    # the 1 -> 2 link again with every table on disk: a one-process snapshot into tiered shards, a save of them
    tiered = {**link, "save": str(root / "t2"), "tiered": {
        "dir": str(root / "tiers" / "chain"), "cache_rows": held_per_step(link["plan"], 2, range(3, 6), wide=False)}}
    return run_ranks(2, "tests.dist.workers:main", {
        "cases": cases(2, list(OPTIMIZERS)) + tiered_cases(2, root), "chain": [link, delta, tiered],
        "probe_weights_grad": True,
        "accumulation": [{"name": "table_wise", "plan": {"u": "table_wise@1"}, "capacity": 6},
                         {"name": "data_parallel", "plan": {"u": "data_parallel"}, "capacity": 6}],
        "metrics": {"plan": {t: "row_wise" for t in POOLED}, "batches_per_rank": EVAL_BATCHES}})


@pytest.mark.slow
def test_held_out_metrics_merge_every_rank_predictions_exactly(two):
    from hugeembed.training import evaluate

    from .common import metrics_batch, metrics_model

    want = evaluate(metrics_model(), [metrics_batch(i) for i in range(sum(EVAL_BATCHES))], torch.device("cpu"))
    for r in two:  # every rank gets the metrics of all predictions, equal to one process's
        assert r["metrics"]["count"] == want["count"] == sum(5 + i for i in range(sum(EVAL_BATCHES)))
        for k in ("auc", "logloss", "ctr", "pctr", "copc"):
            assert r["metrics"][k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k


def test_weights_that_require_grad_are_refused_on_every_rank(two):
    for r in two:
        assert "per-id weights are not implemented for the sharded collection" in r["weights_grad"]


@pytest.fixture(scope="module")
def four(chain, two):
    root = chain["root"]
    links = [{"plan": plans(4)["mixed"], "opt": CHAIN_OPT, "load": str(root / "s1")},
             {"plan": plans(4)["table_wise"], "opt": CHAIN_OPT, "load": str(root / "s2"), "train": (6, 8),
              "save": str(root / "s4")},
             # the 2-rank delta resharded into 4 ranks, trained on, and a delta of their own on top of it
             {"plan": plans(4)["row_wise"], "opt": CHAIN_OPT, "load": str(root / "d2"), "train": (7, 8),
              "save": str(root / "d2"), "delta": True}]
    return run_ranks(4, "tests.dist.workers:main",
                     {"cases": cases(4, ["adagrad", "adam_global", "ftrl"], ("row_wise", "mixed")), "chain": links})


def replicated(plan: dict) -> set[str]:
    return {t for t, k in plan.items() if k == "data_parallel"}


def check_cases(results: list, world: int) -> int:
    checked = 0
    B = GLOBAL_BATCH // world
    for case in cases(world, list(OPTIMIZERS) if world == 2 else ["adagrad", "adam_global", "ftrl"],
                      ("row_wise", "table_wise", "data_parallel", "mixed") if world == 2 else ("row_wise", "mixed")):
        name = case["name"]
        got = [r["cases"][name] for r in results]
        dtype = case.get("dtype", "float32")
        ref = reference(case["opt"], case["steps"], bool(case.get("dense")), dtype)
        # 16-bit weights: a gradient summed in another order may round the weight one ulp apart
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
        what = f"{world} ranks, {name}"
        width = 4 * len(POOLED)
        seq = ref["first"][GLOBAL_BATCH * width:].view(-1, 4)
        for rank, g in enumerate(got):  # forward outputs, pooled and sequence: bit-identical, every kind
            pooled = ref["first"][: GLOBAL_BATCH * width].view(GLOBAL_BATCH, width)[rank * B:(rank + 1) * B]
            offs = local_batch(0, 0, 1).feature("hist").offsets
            rows = seq[int(offs[rank * B]):int(offs[(rank + 1) * B])]
            assert torch.equal(g["first"], torch.cat([pooled.flatten(), rows.flatten()])), f"{what}: rank {rank}"
            assert g["step"] == case["steps"]
        # the owner of a pooled table-wise table sums its gradients in one pass, as one process does
        exact = {t for t, k in case["plan"].items() if k.startswith("table_wise") and t in POOLED} \
            if not case.get("dense") else set()
        merged, want = merge_shards([g["tables"] for g in got], replicated(case["plan"])), ref["tables"]
        if dtype != "float32":
            layouts = {c.name: s.layout for c, s in EmbeddingCollection(tables(case["opt"], dtype=dtype),
                                                                        device="meta").stores()}
            assert all(lay.packed for lay in layouts.values())
            merged, want = typed_rows(merged, layouts), typed_rows(want, layouts)
        assert_tables(merged, want, exact, what, **tol)
        scored = torch.cat([g["eval"][: B * width] for g in got] + [g["eval"][B * width:] for g in got])
        if exact == set(POOLED):
            assert torch.equal(scored[: GLOBAL_BATCH * width], ref["eval"][: GLOBAL_BATCH * width]), what
        torch.testing.assert_close(scored.double(), ref["eval"].double(), **tol)
        if case.get("dense"):
            for g in got:
                for k, v in ref["dense"].items():
                    torch.testing.assert_close(g["dense"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {k}: {m}")
        checked += 1
    return checked


def test_two_ranks_train_like_one_process_for_every_kind_and_optimizer(two):
    assert check_cases(two, 2) == 6 * 3 + 2 + 4 + 1 + 2


def test_tiered_shards_train_bit_for_bit_as_in_memory_shards(two):
    """Each rank's tiered shards (caches of one step's rows, missing every step) hold exactly what its
    in-memory shards hold after the same steps: rows, optimizer state, keys, counts; outputs equal too."""
    for case in tiered_cases(2, None)[1::2]:
        plain = case["name"].replace("tiered/", "wide/")
        for rank, r in enumerate(two):
            got, want = r["cases"][case["name"]], r["cases"][plain]
            assert_tables(got["tables"], want["tables"], set(ALL), f"{case['name']} rank {rank}")
            assert torch.equal(got["first"], want["first"]) and torch.equal(got["eval"], want["eval"]), case["name"]
            assert got["step"] == want["step"]
            assert want["tiers"] is None
        tiers = [r["cases"][case["name"]]["tiers"]["tables"] for r in two]
        for name in ALL:  # every table evicted dirty rows to disk on some rank
            if name == "user":  # admit_min_count 2: few wide ids come twice, few get rows
                continue
            assert sum(t[name]["rows_written"] for t in tiers if name in t) > 0, (case["name"], name)
            assert {t[name]["capacity_rows"] for t in tiers if name in t} == {case["tiered"]["cache_rows"][name]}
        assert sum(t[n]["rows_read"] for t in tiers for n in t) > 0, case["name"]


@pytest.mark.slow
def test_four_ranks_train_like_one_process(four):
    assert check_cases(four, 4) == 3 * 3 + 2 + 2 + 1 + 2


# -- bytes: deduplicated before the exchange -------------------------------------------------------------------


def owner(key: int, world: int, static: bool) -> int:
    return key % world if static else (mix64_int(key) & 0xFFFFFFFF) % world


def unique_keys(step: int, rank: int, world: int) -> dict[str, list[int]]:
    """Oracle: the distinct ids each table reads in a rank's batch (empty country bags read default id 3)."""
    sf = local_batch(step, rank, world)
    out = {}
    for name in ALL:
        ids = set(sf.feature(name).values.tolist())
        if name == "country" and bool((sf.feature(name).lengths() == 0).any()):
            ids.add(3)
        out[name] = sorted(ids)
    return out


def pad8(n: int) -> int:
    return n + (-n) % 8


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_bytes_sent_are_unique_keys_per_destination_times_record_size(two, four, world):
    results = two if world == 2 else four
    D, key_bytes, count_bytes, row_bytes = 4, 8, 4, 4 * 4
    saved_by_dedup = 0
    for step in range(2):
        mine = [unique_keys(step, r, world) for r in range(world)]
        for rank in range(world):
            sent = results[rank]["cases"]["bytes"]["bytes"][step]
            want = {"input_dist (header)": [8 * (5 + len(ALL))] * world,  # fixed: 5 + one size per table
                    "input_dist": [0] * world, "output_dist": [0] * world, "grad_dist": [0] * world}
            for d in range(world):  # the four tables (one dim) travel as one segment per field
                n = sum(1 for name in ALL for k in mine[rank][name] if owner(k, world, name == "country") == d)
                asked = sum(1 for name in ALL for k in mine[d][name] if owner(k, world, name == "country") == rank)
                want["input_dist"][d] += pad8(n * key_bytes) + pad8(n * count_bytes)
                want["grad_dist"][d] += pad8(n * row_bytes)
                want["output_dist"][d] += pad8(asked * row_bytes)
            assert sent == want, f"step {step} rank {rank}"
            ids = sum(local_batch(step, rank, world).feature(n).values.numel() for n in ALL)
            saved_by_dedup += ids - sum(len(v) for v in mine[rank].values())
    assert saved_by_dedup > 0 and D == 4  # the batches repeat ids: dedup sent fewer keys than ids


# -- snapshots across world sizes and plans ------------------------------------------------------------------------


def test_reshard_one_to_two_then_two_to_four_and_training_continues(chain, two, four):
    at = chain["at"]
    link = [r["chain"][0] for r in two]  # 1 -> 2 (row-wise), train 3..6, save
    assert all(r["loaded_step"] == 3 for r in link)
    assert_tables(merge_shards([r["loaded"] for r in link]), at[3], set(ALL), "1 -> 2 ranks: loaded")
    assert_tables(merge_shards([r["trained"] for r in link]), at[6], set(), "1 -> 2 ranks: trained on")
    one_to_four = [r["chain"][0] for r in four]  # 1 -> 4 (mixed plan)
    assert_tables(merge_shards([r["loaded"] for r in one_to_four], replicated(plans(4)["mixed"])), at[3], set(ALL),
                  "1 -> 4 ranks: loaded")
    two_to_four = [r["chain"][1] for r in four]  # 2 (row-wise) -> 4 (table-wise), train 6..8, save
    assert_tables(merge_shards([r["loaded"] for r in two_to_four]), merge_shards([r["trained"] for r in link]),
                  set(ALL), "2 -> 4 ranks: loaded")
    assert_tables(merge_shards([r["trained"] for r in two_to_four]), at[8], set(), "2 -> 4 ranks: trained on")


def test_a_snapshot_loads_into_tiered_shards_which_train_on_and_save(chain, two):
    at = chain["at"]
    plain = [r["chain"][0] for r in two]
    tiered = [r["chain"][2] for r in two]
    assert_tables(merge_shards([r["loaded"] for r in tiered]), at[3], set(ALL), "1 -> 2 tiered ranks: loaded")
    for a, b in zip(plain, tiered):  # the same plan in memory and on disk: bit for bit
        assert_tables(b["trained"], a["trained"], set(ALL), "tiered vs in-memory shards, trained on")
    # the loaded rows went to disk and came back through caches of one step's rows
    assert sum(t["rows_read"] for r in tiered for t in r["tiers"]["tables"].values()) > 0
    assert sum(t["rows_written"] for r in tiered for t in r["tiers"]["tables"].values()) > 0
    ec = EmbeddingCollection(tables(CHAIN_OPT))
    ckpt.load(chain["root"] / "t2", ec, restore_rng=False)
    assert_tables(export_all(ec), merge_shards([r["trained"] for r in plain]), set(ALL), "t2 -> 1 process")


@pytest.mark.parametrize("snapshot,step", [("s2", 6), ("s4", 8)])
def test_sharded_snapshots_load_into_one_process(chain, two, four, snapshot, step):
    manifest = ckpt.read_manifest(chain["root"] / snapshot)
    assert manifest["world_size"] == (2 if snapshot == "s2" else 4) and manifest["plan"]["world_size"] > 1
    ec = EmbeddingCollection(tables(CHAIN_OPT))
    ckpt.load(chain["root"] / snapshot, ec, restore_rng=False)
    assert ec.step == step
    assert_tables(export_all(ec), chain["at"][step], set(), f"{snapshot} -> 1 process")


def test_sharded_deltas_load_anywhere_as_the_ranks_held_them(chain, two, four):
    d2 = chain["root"] / "d2"
    mixed = replicated(plans(2)["mixed"])
    on_two = merge_shards([r["chain"][1]["delta_trained"] for r in two], mixed)  # what 2 ranks held at step 7
    m = ckpt.read_manifest(two[0]["chain"][1]["delta_saved"])
    assert (m["kind"], m["step"], m["parent"]["name"], m["world_size"]) == ("delta", 7, "step-000000005", 2)
    assert sum(sh["removed"] for t in m["tables"] for sh in t["shards"]) > 0  # the eviction shows, rank by rank
    # 2 ranks -> 4 ranks (another plan): the chain loads exactly, and their delta of step 8 too
    links = [r["chain"][2] for r in four]
    assert all(r["loaded_step"] == 7 for r in links)
    assert_tables(merge_shards([r["loaded"] for r in links]), on_two, set(ALL), "2-rank delta -> 4 ranks")
    m = ckpt.read_manifest(d2)
    assert (m["kind"], m["step"], m["depth"], m["world_size"]) == ("delta", 8, 2, 4)
    for snap, want in (("step-000000007", on_two), ("step-000000008", merge_shards([r["trained"] for r in links]))):
        ec = EmbeddingCollection(tables(CHAIN_OPT))
        ckpt.load(d2 / snap, ec, restore_rng=False)
        assert_tables(export_all(ec), want, set(ALL), f"{snap} -> 1 process")


@pytest.fixture(scope="module")
def two_again(chain, four):
    link = {"plan": plans(2)["mixed"], "opt": CHAIN_OPT, "load": str(chain["root"] / "s4"), "train": (8, 10)}
    fail = {"plan": plans(2)["mixed"], "step": 2, "victim": 1, "mode": "die", "timeout": 20.0}
    return run_ranks(2, "tests.dist.workers:main", {"chain": [link], "fail": fail, "broken_group": True},
                     expected_codes={1: 3})


@pytest.mark.slow
def test_reshard_four_to_two_then_training_continues(chain, two_again):
    links = [r["chain"][0] for r in two_again]  # rank 1 saved its result before it was killed
    assert all(r["loaded_step"] == 8 for r in links)
    assert_tables(merge_shards([r["trained"] for r in links], replicated(plans(2)["mixed"])), chain["at"][10], set(),
                  "4 -> 2 ranks: trained on")


@pytest.mark.slow
def test_a_killed_rank_stops_the_others_with_a_clear_error(two_again):
    fail = two_again[0]["fail"]
    assert fail["error"] is not None, "rank 0 kept training after rank 1 died"
    assert "rank 0 of 2: collective 'input_dist (header)' at step 3 failed" in fail["error"], fail["error"]
    assert "--resume" in fail["error"] and "died, hung" in fail["error"]
    assert fail["seconds"] < 20.0  # gloo sees the closed connection at once; the timeout is 20 s


@pytest.mark.slow
def test_a_hung_rank_stops_the_others_after_the_timeout():
    fail = {"plan": plans(2)["row_wise"], "step": 1, "victim": 1, "mode": "hang", "timeout": 3.0}
    res = run_ranks(2, "tests.dist.workers:main", {"fail": fail, "broken_group": True}, expected_codes={1: None})
    got = res[0]["fail"]
    assert got["error"] is not None and "collective 'input_dist (header)' at step 2" in got["error"], got["error"]
    assert "timeout 3 s" in got["error"]
    assert 2.5 < got["seconds"] < 15.0


def test_accumulation_under_eviction_pressure_equals_one_unlimited_process(two):
    from .common import accumulation_tables, accumulation_windows, train_windows

    ref = EmbeddingCollection(accumulation_tables(None))
    train_windows(ref, accumulation_windows())
    want = export_all(ref)["u"]
    last = torch.tensor([300 + i for i in range(6)])
    for kind in ("table_wise", "data_parallel"):
        got = merge_shards([r["accumulation"][kind] for r in two],
                           replicated={"u"} if kind == "data_parallel" else set())["u"]
        for name, table in (("sharded", got), ("reference", want)):
            assert set(last.tolist()) <= set(table["keys"].tolist()), (kind, name)
        pick = lambda t: t["rows"][torch.searchsorted(t["keys"], last)]  # noqa: E731
        torch.testing.assert_close(pick(got), pick(want), rtol=1e-6, atol=1e-7, msg=kind)


def test_a_second_backward_of_a_sharded_step_is_refused_on_every_rank(two):
    for r in two:
        assert "runs once" in r["second_backward"], r["second_backward"]
