"""Converted shards damaged after conversion are refused with an InputError naming the file (and row/field):
flipped bytes (checksum on first map), labels outside {0, 1}, negative ids, empty .npy, damaged manifests."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from hugeembed.data import Loader, ShardSet, SyntheticConfig, convert, write_criteo_tsv
from hugeembed.errors import InputError

from ..damage import set_field


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    write_criteo_tsv(d / "d.tsv", 300, config=SyntheticConfig(seed=4, max_cardinality=300))
    convert(d / "d.tsv", d / "out", rows_per_shard=200)
    return d / "out"


@pytest.fixture
def shards(clean, tmp_path):
    shutil.copytree(clean, tmp_path / "out")
    return tmp_path / "out"


def data_offset(path) -> int:
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def rewrite(root, name, array, *, update_manifest=True):
    """Writes `array` as shard file `name` and (by default) makes the manifest agree with it."""
    np.save(root / name, array)
    if update_manifest:
        m = json.loads((root / "manifest.json").read_text())
        for s in m["shards"]:
            for rec in s["files"].values():
                if rec["file"] == name:
                    rec["bytes"] = (root / name).stat().st_size
                    rec["sha256"] = hashlib.sha256((root / name).read_bytes()).hexdigest()
        (root / "manifest.json").write_text(json.dumps(m))


FILES = ["part-00000.dense.npy", "part-00000.cats.npy", "part-00000.labels.npy", "part-00001.cats.npy"]


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("where", [0.0, 0.37, 0.999])
def test_every_flipped_byte_is_refused_naming_the_file(shards, name, where):
    path = shards / name
    data = bytearray(path.read_bytes())
    at = data_offset(path) + int(where * (len(data) - data_offset(path) - 1))
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"{name}: checksum mismatch"):
        ShardSet(shards).read_all()
    with pytest.raises(InputError, match=rf"{name}: checksum mismatch"):
        list(Loader(shards, 64, prefetch=0))


def test_a_label_outside_0_1_names_file_and_row(shards):
    labels = np.load(shards / "part-00001.labels.npy")
    labels[57] = 254
    rewrite(shards, "part-00001.labels.npy", labels)
    s = ShardSet(shards)
    s.read(0, 200)  # the first shard is fine
    with pytest.raises(InputError, match=r"part-00001.labels.npy: row 57 has label 254; labels must be 0 or 1"):
        s.read(0, 300)


def test_a_negative_id_names_file_row_and_feature(shards):
    cats = np.load(shards / "part-00000.cats.npy")
    cats[123, 4] = -7
    rewrite(shards, "part-00000.cats.npy", cats)
    with pytest.raises(InputError, match=r"part-00000.cats.npy: row 123 has C5 id -7; category ids must be >= 0"):
        ShardSet(shards).read_all()


def test_an_empty_npy_file(shards):
    (shards / "part-00000.dense.npy").write_bytes(b"")
    with pytest.raises(InputError, match=r"part-00000.dense.npy: 0 bytes, the manifest says"):
        ShardSet(shards).read_all()
    with pytest.raises(InputError, match=r"part-00000.dense.npy: not a readable .npy file \(EOFError"):
        ShardSet(shards, verify="none").read_all()


def test_verify_modes(shards):
    data = bytearray((shards / "part-00001.dense.npy").read_bytes())
    data[-1] ^= 1
    (shards / "part-00001.dense.npy").write_bytes(bytes(data))
    with pytest.raises(InputError, match="part-00001.dense.npy: checksum mismatch"):
        ShardSet(shards, verify="all")
    s = ShardSet(shards)  # "open": the first shard reads; the damaged second one is refused when first mapped
    assert len(s.read(0, 200)) == 200
    with pytest.raises(InputError, match="part-00001.dense.npy"):
        s.read(200, 300)
    assert len(ShardSet(shards, verify="none").read_all()) == 300  # trusted: not checked
    with pytest.raises(ValueError, match="verify must be"):
        ShardSet(shards, verify="sometimes")




@pytest.mark.parametrize("change,fragment", [
    (lambda m: [m], "the manifest must be a JSON object"),
    (lambda m: None, "the manifest must be a JSON object"),
    (set_field(["rows"], KeyError), "rows must be a non-negative integer"),
    (set_field(["rows"], "300"), "rows must be a non-negative integer, got '300'"),
    (set_field(["shards"], KeyError), "shards must be a list"),
    (set_field(["shards"], {"a": 1}), "shards must be a list"),
    (set_field(["shards", 0], "part-00000"), "shards[0] must be a shard record"),
    (set_field(["shards", 1, "rows"], KeyError), "shards[1].rows must be a non-negative integer"),
    (set_field(["shards", 1, "rows"], -5), "shards[1].rows must be a non-negative integer"),
    (set_field(["shards", 0, "files"], KeyError), "shards[0].files must be a mapping"),
    (set_field(["shards", 0, "files", "labels"], KeyError), "shards[0].files.labels must be a file record"),
    (set_field(["shards", 0, "files", "cats", "file"], "../../etc/passwd"), "shards[0].files.cats.file must be a file name"),
    (set_field(["shards", 0, "files", "cats", "sha256"], None), "shards[0].files.cats.sha256 must be a hex sha256"),
    (set_field(["shards", 0, "name"], 3), "shards[0].name must be a string"),
])
def test_a_damaged_manifest_names_the_field(shards, change, fragment):
    path = shards / "manifest.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    with pytest.raises(InputError) as e:
        ShardSet(shards)
    assert str(path) in str(e.value) and fragment in str(e.value), str(e.value)


@pytest.mark.parametrize("content", [b"", b"\x00\xff\xfe garbage", b"[1, 2"])
def test_an_unreadable_manifest(shards, content):
    (shards / "manifest.json").write_bytes(content)
    with pytest.raises(InputError, match="manifest.json: unreadable manifest"):
        ShardSet(shards)
