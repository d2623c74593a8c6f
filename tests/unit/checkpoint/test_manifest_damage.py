"""A snapshot whose manifest.json is structurally damaged is a CheckpointError naming the file and the field,
before anything is loaded (no KeyError / TypeError / AttributeError)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hugeembed import checkpoint as ckpt
from hugeembed.errors import CheckpointError

from ..damage import set_field
from .helpers import build, train


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("snap") / "ck"
    ec, whole, opt, sched = build()
    train(ec, whole, opt, sched, range(3))
    ckpt.save(root, ec, model=whole, dense_optimizer=opt, step=3)
    return root




DAMAGES = [
    (lambda m: [m], "the manifest must be a JSON object"),
    (lambda m: None, "the manifest must be a JSON object"),
    (lambda m: "step-3", "the manifest must be a JSON object"),
    (set_field(["tables"], KeyError), "tables is missing"),
    (set_field(["files"], KeyError), "files is missing"),
    (set_field(["step"], KeyError), "step is missing"),
    (set_field(["step"], "3"), "step must be a non-negative integer, got '3'"),
    (set_field(["world_size"], 0), "world_size must be a positive integer"),
    (set_field(["tables"], {"user": {}}), "tables must be a list"),
    (set_field(["tables", 0], "user"), "tables[0] must be a table record"),
    (set_field(["tables", 0, "name"], KeyError), "tables[0].name is missing"),
    (set_field(["tables", 1, "dim"], "4"), "table 'item' dim must be a positive integer"),
    (set_field(["tables", 0, "shards"], KeyError), "table 'user' shards is missing"),
    (set_field(["tables", 0, "shards"], []), "table 'user' shards must be a non-empty list"),
    (set_field(["tables", 0, "shards", 0, "rows"], KeyError), "table 'user' shards[0].rows is missing"),
    (set_field(["tables", 0, "shards", 0, "files"], None), "table 'user' shards[0].files must be a mapping"),
    (set_field(["tables", 0, "shards", 0, "files", "keys"], KeyError), "shards[0].files.keys is missing"),
    (set_field(["tables", 0, "shards", 0, "files", "rows", "shape"], "10x4"), "files.rows.shape must be a list"),
    (set_field(["tables", 2, "optimizer"], "adagrad"), "table 'country' optimizer must be null or a mapping"),
    (set_field(["files", "dense_model"], "dense_model.pt"), "files.dense_model must be a file record"),
    (set_field(["files", "extra"], {"file": "/etc/passwd", "bytes": 1, "sha256": "0" * 64}),
     "files.extra.file must be a relative path"),
    (set_field(["files", "rng", "bytes"], None), "files.rng.bytes must be a non-negative integer"),
]


@pytest.mark.parametrize("change,fragment", DAMAGES)
def test_a_damaged_manifest_is_a_checkpoint_error_naming_file_and_field(saved, tmp_path, change, fragment):
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    path = root / "step-000000003" / "manifest.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    ec, whole, opt, _ = build()
    before = {k: v.clone() for k, v in whole.state_dict().items()}
    for call in (lambda: ckpt.read_manifest(root), lambda: ckpt.load(root, ec, model=whole, dense_optimizer=opt),
                 lambda: ckpt.read_extra(root)):
        with pytest.raises(CheckpointError) as e:
            call()
        assert str(path) in str(e.value) and fragment in str(e.value), str(e.value)
    assert all(torch.equal(before[k], v) for k, v in whole.state_dict().items())  # nothing changed


def test_an_empty_table_file_is_a_checkpoint_error(saved, tmp_path):
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    (root / "step-000000003" / "tables" / "user.r0.keys.npy").write_bytes(b"")
    ec, whole, opt, _ = build()
    with pytest.raises(CheckpointError, match=r"user.r0.keys.npy has 0 bytes, the manifest says"):
        ckpt.load(root, ec, model=whole, dense_optimizer=opt)


@pytest.mark.parametrize("latest", [b"\xff\xfe\x00junk", b"../../elsewhere", b""])
def test_a_damaged_latest_pointer_falls_back_to_the_newest_snapshot(saved, tmp_path, latest):
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    (root / "LATEST").write_bytes(latest)
    assert ckpt.latest(root) == root / "step-000000003"
