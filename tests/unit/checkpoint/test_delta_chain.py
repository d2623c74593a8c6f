"""A delta's chain is verified before anything is loaded: a missing, edited, out-of-order, cyclic or torn link,
a removed key its parent does not hold, or rows beyond a table's capacity is a CheckpointError naming the
snapshot and what is wrong -- and the collection, model and optimizer are left exactly as they were."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hugeembed import checkpoint as ckpt
from hugeembed.checkpoint._files import write_tensor
from hugeembed.errors import CheckpointError

from ..damage import set_field
from .delta_helpers import assert_same, exports, make, seeded_ids, step
from .helpers import build, train

BASE, D1, D2, TIP = (f"step-00000000{s}" for s in (3, 5, 7, 9))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A full snapshot at step 3 and deltas at 5, 7, 9 of the helpers' model (ttl eviction, admission, global Adam)."""
    root = tmp_path_factory.mktemp("chain") / "ck"
    ec, whole, opt, sched = build()
    train(ec, whole, opt, sched, range(3))
    ckpt.save(root, ec, model=whole, dense_optimizer=opt)
    for a in (3, 5, 7):
        train(ec, whole, opt, sched, range(a, a + 2))
        ckpt.save(root, ec, model=whole, dense_optimizer=opt, delta=True)
    assert sum(t["shards"][0]["removed"] for t in ckpt.read_manifest(root / D2)["tables"]) > 0  # evictions happened
    return root


@pytest.fixture
def root(saved, tmp_path):
    out = tmp_path / "ck"
    shutil.copytree(saved, out)
    return out


def _edit_manifest(snap, change) -> None:
    path = snap / "manifest.json"
    path.write_text(json.dumps(change(json.loads(path.read_text())), indent=1))


def _refused(root, fragments, target=None) -> None:
    """Loading `root` raises a CheckpointError holding every fragment; a trained target is left unchanged."""
    ec, whole, opt, sched = target or build()
    if target is None:
        train(ec, whole, opt, sched, range(2))  # a state of its own, which a failed load must keep
    tables, step_, dense = exports(ec), ec.step, {k: v.clone() for k, v in whole.state_dict().items()}
    opt_state = opt.state_dict()["state"][0]["exp_avg"].clone() if opt.state_dict()["state"] else None
    with pytest.raises(CheckpointError) as e:
        ckpt.load(root, ec, model=whole, dense_optimizer=opt)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))
    assert_same(exports(ec), tables, "after a refused load")
    assert ec.step == step_
    assert all(torch.equal(dense[k], v) for k, v in whole.state_dict().items())
    if opt_state is not None:
        assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt_state)


def test_the_intact_chain_loads(root):
    assert [p.name for p in ckpt.snapshot_chain(root)] == [BASE, D1, D2, TIP]
    ec, whole, opt, _ = build()
    assert ckpt.load(root, ec, model=whole, dense_optimizer=opt).step == 9 and ec.step == 9


def test_a_missing_parent(root):
    shutil.rmtree(root / D1)
    _refused(root, [f"{root / D2} is a delta of {D1}, which is missing", f"the chain to its base {BASE} is broken"])
    with pytest.raises(CheckpointError, match=f"{D1}, which is missing"):
        ckpt.snapshot_chain(root)


def test_an_edited_parent_manifest(root):
    _edit_manifest(root / BASE, set_field(["created_unix"], 0.0))
    _refused(root, [f"{root / D1} is a delta of {root / BASE}, whose manifest changed after the delta was written",
                    "the parent was replaced or edited"])


def test_a_delta_not_after_its_parent(root):
    _edit_manifest(root / TIP, set_field(["step"], 7))
    _refused(root, [f"{root / TIP} (step 7) is out of order: its parent {D2} is at step 7, not before it"])


def test_a_parent_step_that_differs_from_the_recorded_one(root):
    _edit_manifest(root / TIP, set_field(["parent", "step"], 6))
    _refused(root, [f"{root / TIP}: its parent {D2} is at step 7, the delta recorded step 6"])


def test_a_delta_that_is_its_own_parent(root):
    _edit_manifest(root / TIP, set_field(["parent", "name"], TIP))
    _refused(root, [f"{root / TIP}: its parent {TIP} is itself or a later link of its own chain (a cycle"])


def test_a_delta_naming_another_base(root):
    _edit_manifest(root / TIP, set_field(["base"], D1))
    _refused(root, [f"{root / TIP} names {D1} as its base, but its chain reaches the full snapshot {BASE}"])


# a link's own dense files are not loaded, and are checked all the same
@pytest.mark.parametrize("where,file,cut", [(D1, "tables/user.r0.rows.npy", True),
                                            (TIP, "tables/item.r0.removed_keys.npy", False),
                                            (D2, "dense_model.pt", True)])
def test_a_torn_link(root, where, file, cut):
    path = root / where / file
    data = bytearray(path.read_bytes())
    if cut:
        path.write_bytes(bytes(data[: len(data) // 2]))
        fragment = f"{path} has {len(data) // 2} bytes, the manifest says {len(data)}: truncated?"
    else:
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        fragment = f"{path} is corrupted"
    _refused(root, [fragment])


def test_a_removed_key_the_parent_does_not_hold(root):
    snap = root / TIP
    rec = write_tensor(snap / "tables" / "item.r0.removed_keys.npy", torch.tensor([123456789], dtype=torch.int64))
    rec["file"] = "tables/item.r0.removed_keys.npy"
    _edit_manifest(snap, set_field(["tables", 1, "shards", 0, "files", "removed_keys"], rec))
    _refused(root, [f"{snap}: table 'item': the delta removes key 123456789, which its parent does not hold"])


def test_rows_beyond_a_tables_capacity(tmp_path):
    ec = make("adagrad", cap=20)
    for s in range(3):
        step(ec, seeded_ids(s))
    ckpt.save(tmp_path, ec)
    base_rows = len(ec.store("cap"))
    step(ec, seeded_ids(3))
    ckpt.save(tmp_path, ec, delta=True)
    rows = len(ec.store("cap"))
    assert base_rows <= 2 < rows  # the base fits a capacity of 2; the table after the delta does not
    small = make("adagrad", cap=2)
    step(small, seeded_ids(9))
    before, at = exports(small), small.step
    with pytest.raises(CheckpointError, match=rf"table 'cap': .*step-000000004 holds {rows} rows here, more than "
                                              rf"the table's capacity 2: build the table with a capacity of at least "
                                              rf"{rows}"):
        ckpt.load(tmp_path, small)
    assert_same(exports(small), before, "after a refused load")
    assert small.step == at


DELTA_DAMAGES = [
    (set_field(["parent"], KeyError), "parent is missing"),
    (set_field(["parent", "name"], "../step-000000007"), "parent.name must be a snapshot name"),
    (set_field(["parent", "manifest_sha256"], "abc"), "parent.manifest_sha256 must be a hex sha256"),
    (set_field(["base"], KeyError), "base is missing"),
    (set_field(["depth"], 0), "depth must be a positive integer"),
    (set_field(["kind"], "full"), "kind must be 'delta' in a format version 2 manifest"),
    (set_field(["format_version"], 1), "kind must be 'full' in a format version 1 manifest"),
    (set_field(["tables", 0, "shards", 0, "removed"], KeyError), "table 'user' shards[0].removed is missing"),
    (set_field(["tables", 0, "shards", 0, "files", "removed_keys"], KeyError),
     "shards[0].files.removed_keys is missing"),
]


@pytest.mark.parametrize("change,fragment", DELTA_DAMAGES)
def test_a_damaged_delta_manifest_is_named(root, change, fragment):
    _edit_manifest(root / TIP, change)
    _refused(root, [str(root / TIP / "manifest.json"), fragment])
