"""Snapshot deltas: a full base plus a chain of deltas loads bit for bit as the live collection was (rows,
optimizer state, counts, last steps, pending keys) under eviction, admission, static tables and every optimizer;
a delta holds only the rows seen since its parent; resuming from a delta equals the uninterrupted run; and a
delta is refused, before anything is written, whenever the collection's rows may not descend from the newest
snapshot."""

from __future__ import annotations

import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed import CheckpointError
from hugeembed.checkpoint import delta_parent, latest, list_snapshots, load, read_manifest, save, snapshot_chain
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD

from .delta_helpers import BATCH, OPTIMIZERS, POOL, assert_same, exports, make, seeded_ids, step
from .helpers import build, tables_equal, train

_bags = lambda hi: st.lists(st.lists(st.integers(0, hi - 1), min_size=1, max_size=2), min_size=BATCH,  # noqa: E731
                            max_size=BATCH)
_batches = st.fixed_dictionaries({"cap": _bags(POOL), "ttl": _bags(POOL), "prob": _bags(POOL), "fixed": _bags(5)})
# what happens between two snapshots: some training steps, then maybe an explicit eviction down to a row count
_segment = st.tuples(st.lists(_batches, max_size=3), st.one_of(st.none(), st.integers(0, 4)))


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@settings(max_examples=8)
@given(segments=st.lists(_segment, min_size=2, max_size=5))
@pytest.mark.slow
def test_a_base_and_chain_of_deltas_load_as_the_live_collection_was(opt, segments):
    ec = make(opt)
    # durability is test_snapshot.py's business: here fsync would only cost most of the time
    with tempfile.TemporaryDirectory() as root, mock.patch("os.fsync"):
        snaps = []
        for i, (batches, evict_to) in enumerate(segments):
            for ids in batches:
                step(ec, ids)
            if evict_to is not None:
                ec.evict(max_rows=evict_to)
            path = save(root, ec, step=i + 1, delta=i > 0)  # names need not follow the collection's step
            snaps.append((path, exports(ec), ec.step))
        for depth, (path, live, at) in enumerate(snaps):
            assert read_manifest(path)["kind"] == ("delta" if depth else "full")
            assert len(snapshot_chain(path)) == depth + 1
            fresh = make(opt)
            load(path, fresh)
            assert fresh.step == at
            assert_same(exports(fresh), live, f"{path.name} (base + {depth} deltas)")


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_rows_not_seen_since_a_snapshot_are_unchanged_in_storage(opt):
    """The rule deltas rest on: a row whose last step is at most the settled step did not change, for every
    optimizer -- global Adam included, whose untouched rows are stored lazily with their step counter."""
    ec = make(opt, cap=20)
    for s in range(6):
        step(ec, seeded_ids(s))
    before, settled = exports(ec), ec.settled_step()
    for s in range(6, 9):
        step(ec, seeded_ids(s, hi=4))  # only ids 0..3: most rows stay untouched
    after = exports(ec)
    untouched = 0
    for table, now in after.items():
        old_index = {k: i for i, k in enumerate(before[table]["keys"].tolist())}
        for i, (k, last) in enumerate(zip(now["keys"].tolist(), now["last_step"].tolist())):
            if last <= settled:
                j = old_index[k]
                untouched += 1
                assert torch.equal(now["rows"][i], before[table]["rows"][j]), (table, k)
                assert now["counts"][i] == before[table]["counts"][j], (table, k)
    assert untouched >= 5


def test_a_delta_holds_only_the_rows_seen_since_its_parent(tmp_path):
    ec = EmbeddingCollection([TableConfig("big", 4, combiner="sum"), TableConfig("fixed", 4, num_rows=300)],
                             optimizer=SGD(lr=0.1))
    step(ec, {"big": [list(range(0, 100)), list(range(100, 200)), list(range(200, 250))],
              "fixed": [list(range(300))[:100], list(range(100, 200)), list(range(200, 300))]})
    full = read_manifest(save(tmp_path, ec))
    step(ec, {"big": [[7], [7, 12], [999]], "fixed": [[3], [4], [3]]})  # 999 is new
    delta = read_manifest(save(tmp_path, ec, delta=True))
    rows = lambda m: {t["name"]: t["shards"][0]["rows"] for t in m["tables"]}  # noqa: E731
    assert rows(full) == {"big": 250, "fixed": 300}
    assert rows(delta) == {"big": 3, "fixed": 2}  # the distinct ids of the step
    assert all(t["shards"][0]["removed"] == 0 for t in delta["tables"])
    size = lambda p: sum(f.stat().st_size for f in (Path(p) / "tables").iterdir())  # noqa: E731
    assert size(delta["_path"]) < size(full["_path"]) / 10
    fresh = EmbeddingCollection([TableConfig("big", 4, combiner="sum"), TableConfig("fixed", 4, num_rows=300)],
                                optimizer=SGD(lr=0.1))
    load(tmp_path, fresh)
    assert_same(exports(fresh), exports(ec), "base + delta")


def test_evicted_keys_are_removed_and_readmitted_ones_written(tmp_path):
    ec = make("adagrad", cap=20)
    ids = {"cap": [[1, 2], [3], [1]], "ttl": [[1, 2], [3], [4]], "prob": [[1], [2], [3]], "fixed": [[0], [1], [2]]}
    step(ec, ids)
    step(ec, ids)  # "cap" admits after two sightings
    save(tmp_path, ec)
    ec.evict(max_rows=0)  # every dynamic row goes...
    # ...1 comes back (twice in the batch: admitted again in "cap"), 9 is new (pending)
    step(ec, {**ids, "cap": [[1], [1], [9]], "ttl": [[1], [1], [1]]})
    m = read_manifest(save(tmp_path, ec, delta=True))
    shard = {t["name"]: t["shards"][0] for t in m["tables"]}
    assert (shard["cap"]["rows"], shard["cap"]["pending"], shard["cap"]["removed"]) == (1, 1, 2)  # 2, 3 removed
    assert (shard["ttl"]["rows"], shard["ttl"]["removed"]) == (1, 3)  # 1 written; 2, 3, 4 removed
    fresh = make("adagrad", cap=20)
    load(tmp_path, fresh)
    assert_same(exports(fresh), exports(ec), "after eviction and readmission")


def test_resume_from_a_delta_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    ec, whole, opt, sched = build()
    train(ec, whole, opt, sched, range(8))

    ec1, whole1, opt1, sched1 = build()
    train(ec1, whole1, opt1, sched1, range(3))
    save(tmp_path, ec1, model=whole1, dense_optimizer=opt1, extra={"scheduler": sched1.state_dict()})
    for a, b in ((3, 5), (5, 6)):
        train(ec1, whole1, opt1, sched1, range(a, b))
        save(tmp_path, ec1, model=whole1, dense_optimizer=opt1, extra={"scheduler": sched1.state_dict()}, delta=True)
    assert read_manifest(tmp_path)["depth"] == 2
    ec2, whole2, opt2, sched2 = build()
    torch.manual_seed(12345)  # disturb the RNG: the delta must restore it
    info = load(tmp_path, ec2, model=whole2, dense_optimizer=opt2)
    sched2.load_state_dict(info.extra["scheduler"])
    assert info.step == 6 and ec2.step == 6
    train(ec2, whole2, opt2, sched2, range(6, 8))
    save(tmp_path, ec2, model=whole2, dense_optimizer=opt2, delta=True)  # a loaded delta may be a parent

    assert tables_equal(ec, ec2)
    for a, b in zip(whole.parameters(), whole2.parameters()):
        assert torch.equal(a, b)
    ec3 = build()[0]
    load(tmp_path, ec3)
    assert tables_equal(ec, ec3) and read_manifest(tmp_path)["depth"] == 3


def test_a_snapshot_taken_with_a_batch_in_flight_is_followed_by_its_gradient(tmp_path):
    """Saved between a forward and its backward, the rows are pre-gradient with last_step = the new step: the
    settled step stays one before it, so the next delta holds them again, with the gradient applied."""
    from .delta_helpers import batch

    ec = make("adagrad", cap=20)
    step(ec, seeded_ids(0))
    out = ec(batch(seeded_ids(1))).concat()
    assert ec.settled_step() == ec.step - 1
    save(tmp_path, ec)
    (out * torch.linspace(-1.0, 1.0, out.numel()).view_as(out)).sum().backward()
    del out
    assert ec.settled_step() == ec.step  # the graph is gone: nothing can land later
    save(tmp_path, ec, step=ec.step + 1, delta=True)
    fresh = make("adagrad", cap=20)
    load(tmp_path, fresh)
    assert_same(exports(fresh), exports(ec), "delta after a snapshot with a batch in flight")


def test_re_saving_the_newest_step_as_a_delta_keeps_its_parent(tmp_path):
    ec = make("sgd")
    step(ec, seeded_ids(0))
    save(tmp_path, ec)
    step(ec, seeded_ids(1))
    first = read_manifest(save(tmp_path, ec, delta=True))
    again = read_manifest(save(tmp_path, ec, delta=True))  # a run's final save after a periodic one
    assert again["parent"] == first["parent"] and again["_path"] == first["_path"] and again["depth"] == 1
    fresh = make("sgd")
    load(tmp_path, fresh)
    assert_same(exports(fresh), exports(ec), "re-saved delta")


# -- when no delta may be written --------------------------------------------------------------------------------


def _refused(root, ec, fragment: str, **kw) -> None:
    before = sorted(p.name for p in Path(root).iterdir()) if Path(root).exists() else None
    assert delta_parent(root, ec, kw.get("step")) is None
    with pytest.raises(CheckpointError, match=fragment):
        save(root, ec, delta=True, **kw)
    after = sorted(p.name for p in Path(root).iterdir()) if Path(root).exists() else None
    assert after == before  # nothing written, nothing left behind


def test_a_delta_needs_a_snapshot_the_collection_saved_or_loaded(tmp_path):
    ec = make("adagrad")
    step(ec, seeded_ids(0))
    _refused(tmp_path / "empty", ec, "no snapshot under .* the first snapshot must be full")
    save(tmp_path, ec)
    assert delta_parent(tmp_path, ec, step=2) == latest(tmp_path)
    assert delta_parent(tmp_path, ec) is None  # its own step again: a full snapshot has no parent to re-save against
    other = make("adagrad")
    _refused(tmp_path, other, "neither saved to nor loaded from a snapshot")
    load(tmp_path, other)
    step(other, seeded_ids(1))
    assert delta_parent(tmp_path, other) == latest(tmp_path)  # loading it makes it a parent
    save(tmp_path, other, delta=True)
    step(ec, seeded_ids(2))
    _refused(tmp_path, ec, r"newest snapshot under .* is step-000000002, but the collection's rows descend from "
                           r".*step-000000001: a delta against step-000000002 would be wrong")


def test_rows_replaced_or_moved_outside_training_need_a_full_snapshot(tmp_path):
    ec = make("adam_global")
    step(ec, seeded_ids(0))
    save(tmp_path, ec)
    step(ec, seeded_ids(1))
    ec.catch_up_rows()  # global Adam rows moved without their ids being seen
    _refused(tmp_path, ec, r"replaced or changed outside training \(load_state_dict, catch_up_rows or a store")
    save(tmp_path, ec)  # a full one restores the lineage
    step(ec, seeded_ids(2))
    save(tmp_path, ec, delta=True)
    ec.load_state_dict(ec.state_dict())
    step(ec, seeded_ids(3))
    _refused(tmp_path, ec, "replaced or changed outside training")


@pytest.mark.parametrize("write", ["scatter", "import_", "remove"])
@pytest.mark.parametrize("tiered", [False, True])
def test_rows_written_straight_into_a_store_need_a_full_snapshot(tmp_path, write, tiered):
    """A delta holds the rows whose ids training saw: after a direct store write it would miss the
    written rows, so it is refused (nothing written); a full one then keeps them."""
    ec = make("adagrad")
    if tiered:  # the same tables with their rows on disk
        import dataclasses

        ec = EmbeddingCollection([dataclasses.replace(t, storage_dir=str(tmp_path / "tier"), memory_budget=1 << 16)
                                  for t in ec.tables], optimizer=ec.rules[0])
    root = tmp_path / "snaps"
    step(ec, seeded_ids(0))
    save(root, ec)
    step(ec, seeded_ids(1))
    store = ec.store("ttl")
    key = int(store.export_index().keys[0])
    if write == "scatter":
        store.scatter(store.find(torch.tensor([key])), torch.full((1, store.width), 7.0))
    elif write == "import_":
        store.import_(store.export())
    else:
        store.remove(torch.tensor([key]))
    want = exports(ec)
    before = list_snapshots(root)
    _refused(root, ec, "replaced or changed outside training")
    assert list_snapshots(root) == before
    save(root, ec)  # full
    other = make("adagrad")
    load(root, other)
    got = exports(other)
    assert_same(got, want, f"full snapshot after {write}")
    step(ec, seeded_ids(2))
    save(root, ec, delta=True)  # the lineage is whole again


def test_a_delta_must_come_after_its_parent_and_the_parent_must_be_unchanged(tmp_path):
    ec = make("sgd")
    step(ec, seeded_ids(0))
    save(tmp_path, ec, step=5)
    _refused(tmp_path, ec, r"a delta at step 5 needs a parent before it; .* is at step 5 \(a full snapshot: re-save "
                           r"it in full\)", step=5)
    _refused(tmp_path, ec, r"a delta at step 4 needs a parent before it", step=4)
    manifest = tmp_path / "step-000000005" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 5', '"step": 5 '))
    _refused(tmp_path, ec, r"step-000000005 was rewritten after this collection saved or loaded it", step=6)


def test_keep_never_prunes_what_a_kept_delta_needs(tmp_path):
    ec = make("adagrad")
    names = lambda: [p.name for p in list_snapshots(tmp_path)]  # noqa: E731
    for s in range(1, 5):  # a full snapshot, then three deltas, keeping one
        step(ec, seeded_ids(s))
        save(tmp_path, ec, step=s, delta=s > 1, keep=1)
    assert names() == [f"step-00000000{s}" for s in range(1, 5)]  # the newest's chain is all of them
    step(ec, seeded_ids(5))
    save(tmp_path, ec, step=5, keep=2)  # a full snapshot starts a new chain: the old one is needed by step 4 only
    assert names() == [f"step-00000000{s}" for s in range(1, 6)]
    step(ec, seeded_ids(6))
    save(tmp_path, ec, step=6, delta=True, keep=2)  # newest two: 5 (full) and 6 (its delta)
    assert names() == ["step-000000005", "step-000000006"]
    assert latest(tmp_path).name == "step-000000006"
    fresh = make("adagrad")
    load(tmp_path, fresh)
    assert_same(exports(fresh), exports(ec), "after pruning")
