"""Snapshots: round trip, bit-identical resume, crash mid-save, corrupted and mismatched snapshots."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hugeembed import CheckpointError
from hugeembed.checkpoint import latest, list_snapshots, load, read_manifest, save
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD, Adagrad

from .helpers import build, tables_equal, train

REPO = Path(__file__).resolve().parents[3]


def test_round_trip_restores_tables_dense_optimizers_and_step(tmp_path):
    ec, whole, opt, sched = build()
    train(ec, whole, opt, sched, range(5))
    path = save(tmp_path, ec, model=whole, dense_optimizer=opt, extra={"scheduler": sched.state_dict(), "epoch": 2})
    assert path.name == "step-000000005" and latest(tmp_path) == path
    ec2, whole2, opt2, sched2 = build()
    torch.nn.init.zeros_(whole2["mlp"][0].weight)  # differs from the saved model until loaded
    info = load(tmp_path, ec2, model=whole2, dense_optimizer=opt2)
    assert info.step == 5 and info.extra["epoch"] == 2 and ec2.step == 5
    assert tables_equal(ec, ec2)
    for (k, a), (_, b) in zip(whole["mlp"].state_dict().items(), whole2["mlp"].state_dict().items()):
        assert torch.equal(a, b), k
    assert opt.state_dict()["state"][0]["exp_avg"].equal(opt2.state_dict()["state"][0]["exp_avg"])
    assert [g["lr"] for g in ec.optimizer.param_groups] == [g["lr"] for g in ec2.optimizer.param_groups]
    manifest = read_manifest(tmp_path)
    assert {t["name"]: t["shards"][0]["rows"] for t in manifest["tables"]} == ec.num_rows()
    assert manifest["tables"][0]["optimizer"]["name"] == "adam"


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    ec, whole, opt, sched = build()
    train(ec, whole, opt, sched, range(8))

    ec1, whole1, opt1, sched1 = build()
    train(ec1, whole1, opt1, sched1, range(4))
    save(tmp_path, ec1, model=whole1, dense_optimizer=opt1, extra={"scheduler": sched1.state_dict()})
    ec2, whole2, opt2, sched2 = build()
    torch.manual_seed(12345)  # disturb the RNG: the snapshot must restore it
    info = load(tmp_path, ec2, model=whole2, dense_optimizer=opt2)
    sched2.load_state_dict(info.extra["scheduler"])
    train(ec2, whole2, opt2, sched2, range(4, 8))

    assert tables_equal(ec, ec2)
    for a, b in zip(whole.parameters(), whole2.parameters()):
        assert torch.equal(a, b)
    assert ec.step == ec2.step == 8


_CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from unit.checkpoint.helpers import build, train
    from hugeembed.checkpoint import save, _files, _snapshot
    ec, whole, opt, sched = build()
    train(ec, whole, opt, sched, range(3))
    save({root!r}, ec, model=whole, dense_optimizer=opt)
    train(ec, whole, opt, sched, range(3, 6))
    written = []
    real = _files.write_tensor
    def dying_write(path, t):
        written.append(path)
        if len(written) == {die_after}:
            os._exit(17)  # the process dies in the middle of the second save
        return real(path, t)
    _snapshot.write_tensor = dying_write
    save({root!r}, ec, model=whole, dense_optimizer=opt)
""")


@pytest.mark.slow
def test_crash_mid_save_leaves_previous_snapshot_loadable(tmp_path):
    script = _CRASH_SCRIPT.format(tests=str(REPO / "tests"), root=str(tmp_path), die_after=5)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 17, proc.stderr
    assert latest(tmp_path).name == "step-000000003"
    assert [p.name for p in list_snapshots(tmp_path)] == ["step-000000003"]
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())  # the half-written save
    ec, whole, opt, _ = build()
    assert load(tmp_path, ec, model=whole, dense_optimizer=opt).step == 3
    save(tmp_path, ec, model=whole, dense_optimizer=opt, step=4)  # a later save cleans the crashed one up
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


@pytest.mark.slow
def test_sigkill_during_repeated_saves_never_breaks_latest(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from unit.checkpoint.helpers import build, train
        from hugeembed.checkpoint import save
        ec, whole, opt, sched = build(dim=64)
        train(ec, whole, opt, sched, range(2))
        for step in range(1, 10_000):
            save({str(tmp_path)!r}, ec, model=whole, dense_optimizer=opt, step=step, keep=3)
            print(step, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    for _ in range(6):  # let a few saves complete, then kill at an arbitrary moment
        proc.stdout.readline()
    time.sleep(0.013)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    snap = latest(tmp_path)
    assert snap is not None
    ec, whole, opt, _ = build(dim=64)
    assert load(tmp_path, ec, model=whole, dense_optimizer=opt).step == int(snap.name.split("-")[1])


def test_keep_prunes_old_snapshots(tmp_path):
    ec, whole, opt, sched = build()
    for step in range(1, 5):
        save(tmp_path, ec, step=step, keep=2)
    assert [p.name for p in list_snapshots(tmp_path)] == ["step-000000003", "step-000000004"]


def _saved(tmp_path):
    ec, whole, opt, sched = build()
    train(ec, whole, opt, sched, range(3))
    return save(tmp_path, ec, model=whole, dense_optimizer=opt), ec


def test_corrupted_file_is_named_and_model_left_untouched(tmp_path):
    path, _ = _saved(tmp_path)
    rows = next((path / "tables").glob("item.r0.rows.npy"))
    data = bytearray(rows.read_bytes())
    data[-1] ^= 0xFF
    rows.write_bytes(bytes(data))
    ec, whole, opt, _ = build()
    before = [s.export().rows.clone() for _, s in ec.stores()]
    with pytest.raises(CheckpointError, match=r"item\.r0\.rows\.npy is corrupted"):
        load(tmp_path, ec, model=whole, dense_optimizer=opt)
    assert all(torch.equal(b, s.export().rows) for b, (_, s) in zip(before, ec.stores()))
    assert ec.step == 0


def test_truncated_and_missing_files(tmp_path):
    path, _ = _saved(tmp_path)
    f = path / "dense_model.pt"
    f.write_bytes(f.read_bytes()[:10])
    ec, whole, opt, _ = build()
    with pytest.raises(CheckpointError, match="dense_model.pt has 10 bytes, the manifest says .*truncated"):
        load(tmp_path, ec, model=whole, dense_optimizer=opt)
    f.unlink()
    with pytest.raises(CheckpointError, match="dense_model.pt is missing"):
        load(tmp_path, ec, model=whole, dense_optimizer=opt)


def test_mismatches_are_named(tmp_path):
    path, _ = _saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"table 'user': initializer seed .* build the collection with the seed"):
        load(tmp_path, build(seed=3)[0])
    mk = lambda tables, opt=Adagrad(lr=0.1): EmbeddingCollection(tables, optimizer=opt)
    with pytest.raises(CheckpointError, match=r"has no table 'other'"):
        load(tmp_path, mk([TableConfig("other", 4)]))
    base = [TableConfig("user", 4, optimizer=build()[0].rules[0]), TableConfig("item", 4),
            TableConfig("country", 4, num_rows=7)]
    with pytest.raises(CheckpointError, match=r"table 'item': dim 4 in .*, 8 in the model"):
        load(tmp_path, mk([base[0], TableConfig("item", 8), base[2]]))
    with pytest.raises(CheckpointError, match=r"table 'country': num_rows 7 in .*, 9 in the model"):
        load(tmp_path, mk([base[0], base[1], TableConfig("country", 4, num_rows=9)]))
    with pytest.raises(CheckpointError, match=r"table 'item': optimizer state width 4 in .*, 0 in the model"):
        load(tmp_path, mk(base, opt=SGD(lr=0.1)))
    with pytest.raises(CheckpointError, match=r"has tables \['country'\] the model does not"):
        load(tmp_path, mk(base[:2]))


def test_bad_manifest_and_missing_snapshot(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load(tmp_path / "nope", build()[0])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete snapshot"):
        load(tmp_path / "empty", build()[0])
    path, _ = _saved(tmp_path / "ck")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99, this hugeembed reads 1"):
        load(tmp_path / "ck", build()[0])
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        load(tmp_path / "ck", build()[0])
