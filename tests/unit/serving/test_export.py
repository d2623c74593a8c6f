"""Export and the inference API: predictions against the training model's own eval, quantization
quality on held-out data, the artifact's checks, and the program in a process without hugeembed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from hugeembed.cli import main
from hugeembed.errors import ArtifactError, ConfigError, InputError
from hugeembed.features import SparseFeatures
from hugeembed.serving import ServingModel, export

from .conftest import reference_probs


def served_probs(art, batches) -> torch.Tensor:
    m = ServingModel.load(art)
    return torch.cat([m.predict(b.dense, b.sparse) for b in batches])


@pytest.mark.slow
def test_fp32_export_equals_eval_and_fp16_is_close(artifacts, heldout):
    model, batches = heldout
    ref = reference_probs(model, batches[:4])
    torch.testing.assert_close(served_probs(artifacts("fp32"), batches[:4]), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(served_probs(artifacts("fp16"), batches[:4]), ref, atol=1e-3, rtol=0)


@pytest.mark.slow
def test_quantized_tables_lose_little_auc(artifacts, heldout):
    """int8 loses <= 0.0005 AUC, int4 <= 0.002, against the fp32 export on the run's held-out rows."""
    _, batches = heldout
    labels = torch.cat([b.labels for b in batches]).numpy()
    p32 = served_probs(artifacts("fp32"), batches).numpy()
    auc32, ll32 = roc_auc_score(labels, p32), log_loss(labels, p32)
    report = {}
    for dtype, budget in (("int8", 0.0005), ("int4", 0.002)):
        p = served_probs(artifacts(dtype), batches).numpy()
        auc, ll = roc_auc_score(labels, p), log_loss(labels, p)
        report[dtype] = (auc32 - auc, ll - ll32)
        assert auc32 - auc <= budget, f"{dtype}: AUC {auc:.5f} vs fp32 {auc32:.5f}"
    print(f"\nheld-out rows {labels.size}: fp32 AUC {auc32:.5f} log loss {ll32:.5f}; "
          + "; ".join(f"{d}: AUC -{a:.5f}, log loss {l:+.5f}" for d, (a, l) in report.items()))


def test_predict_takes_any_feature_order_and_refuses_bad_input(artifacts, heldout):
    m = ServingModel.load(artifacts("fp32"))
    b = heldout[1][0]
    sf = b.sparse
    reordered = sf.select(list(reversed(sf.keys())))
    torch.testing.assert_close(m.predict(b.dense, reordered), m.predict(b.dense, sf), atol=0, rtol=0)
    with pytest.raises(InputError, match=r"\[B, 13\]"):
        m.predict(b.dense[:, :12], sf)
    with pytest.raises(InputError, match="C26"):
        m.predict(b.dense, sf.select(list(sf.keys())[:25]))
    with pytest.raises(InputError, match="samples"):
        m.predict(b.dense[:3], sf)


def test_unknown_ids_read_zeros_like_eval(artifacts, heldout):
    """Ids the tables never saw (and pruned negative ids) read as the training model's eval reads them."""
    model, batches = heldout
    b = batches[0]
    vals = b.sparse.values().clone()
    vals[::3] = (1 << 40) + torch.arange(vals[::3].numel())  # never seen
    vals[1::7] = -5  # dropped by the clean stage
    sf = SparseFeatures(list(b.sparse.keys()), vals, offsets=b.sparse.offsets(), batch_size=b.batch_size)
    with torch.no_grad():
        ref = torch.sigmoid(model(b.dense, sf))
    torch.testing.assert_close(ServingModel.load(artifacts("fp32")).predict(b.dense, sf), ref, atol=1e-6, rtol=0)


def test_artifact_records_config_schema_and_checksums(artifacts, run):
    art = artifacts("int8")
    m = json.loads((art / "manifest.json").read_text())
    assert m["dtype"] == "int8" and m["model"] == "dlrm" and m["config"]["embedding_dim"] == 8
    assert m["features"] == {"dense": 13, "sparse": [f"C{i}" for i in range(1, 27)]}
    assert m["source"]["name"] == "step-000000160"
    for rec in m["files"].values():
        assert len(rec["sha256"]) == 64 and (art / rec["file"]).stat().st_size == rec["bytes"]
    rows = np.load(art / m["files"]["rows.0"]["file"])
    assert rows.dtype == np.uint8 and rows.shape[1] == 8 + 8  # D bytes + float32 scale and bias
    assert sum(t["rows"] for t in m["tables"]) + 1 == rows.shape[0]  # + the zero row


def test_tables_are_memory_mapped(artifacts):
    art = artifacts("fp32")
    m = ServingModel.load(art)
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert str(art / "tables" / "g0.rows.npy") in maps
    assert m.served.tables.rows[0].shape[0] > 1000


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "manifest"])
def test_a_damaged_artifact_is_refused_naming_the_file(artifacts, tmp_path, damage):
    import shutil

    art = shutil.copytree(artifacts("int8"), tmp_path / "a")
    target = art / ("program.pt2" if damage == "remove" else "tables/g0.rows.npy")
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
        match = "g0.rows.npy is damaged"
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
        match = "g0.rows.npy has .* bytes"
    elif damage == "remove":
        target.unlink()
        match = "program.pt2 is missing"
    else:
        (art / "manifest.json").write_text("{\"format\": \"something else\"}")
        match = "not a hugeembed serving manifest"
    with pytest.raises(ArtifactError, match=match):
        ServingModel.load(art)


def test_export_refuses_an_existing_path_and_writes_nothing_on_failure(artifacts, run, tmp_path):
    with pytest.raises(ConfigError, match="exists"):
        export(run, artifacts("fp32"))
    with pytest.raises(ConfigError, match="dtype"):
        export(run, tmp_path / "x", dtype="int3")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.slow
def test_cli_export_and_eval_predictions(run, tmp_path, capsys, heldout):
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "a"), "--dtype", "fp16"]) == 0
    assert "exported fp16 artifact" in capsys.readouterr().out
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "a")]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(run), "--predictions", str(tmp_path / "p.txt")]) == 0
    lines = (tmp_path / "p.txt").read_text().splitlines()
    model, batches = heldout
    ref = reference_probs(model, batches)
    assert len(lines) == ref.numel()
    torch.testing.assert_close(torch.tensor([float(x) for x in lines]), ref, atol=0, rtol=0)


@pytest.mark.slow
def test_the_program_runs_in_a_process_without_hugeembed(artifacts, heldout, tmp_path):
    """runtime.py (a copy in the artifact) and torch alone load and run the export."""
    art = artifacts("int4")
    b = heldout[1][0]
    torch.save({"dense": b.dense, "values": b.sparse.values(), "offsets": b.sparse.offsets()}, tmp_path / "in.pt")
    script = textwrap.dedent(f"""
        import importlib.util, sys, torch
        spec = importlib.util.spec_from_file_location("rt", {str(art / 'runtime.py')!r})
        rt = importlib.util.module_from_spec(spec); spec.loader.exec_module(rt)
        art = rt.load({str(art)!r})
        x = torch.load({str(tmp_path / 'in.pt')!r})
        torch.save(torch.sigmoid(art.logits(x["dense"], x["values"], x["offsets"])), {str(tmp_path / 'out.pt')!r})
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "hugeembed")
        assert not loaded, loaded
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(got, ServingModel.load(art).predict(b.dense, b.sparse), atol=0, rtol=0)


@pytest.mark.slow
def test_an_artifact_with_one_runtime_file_still_loads(artifacts, heldout, tmp_path):
    """Artifacts exported before the split carry one self-contained runtime.py (the op and the reader) and
    no lookup_ops.py: hugeembed loads them as before, and so does their own runtime.py without hugeembed."""
    import shutil

    from .crafting import record

    new = artifacts("int8")
    assert (new / "runtime.py").is_file() and (new / "lookup_ops.py").is_file()
    old = tmp_path / "old"
    shutil.copytree(new, old)
    (old / "lookup_ops.py").unlink()
    shutil.copyfile(Path(__file__).parent / "data" / "runtime_one_file.py", old / "runtime.py")
    m = json.loads((old / "manifest.json").read_text())
    del m["files"]["lookup_ops"]
    m["files"]["runtime"] = record(old, "runtime.py", array=False)
    (old / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))
    b = heldout[1][0]
    want = ServingModel.load(new).predict(b.dense, b.sparse)
    torch.testing.assert_close(ServingModel.load(old).predict(b.dense, b.sparse), want, atol=0, rtol=0)
    torch.save({"dense": b.dense, "values": b.sparse.values(), "offsets": b.sparse.offsets()}, tmp_path / "in.pt")
    script = textwrap.dedent(f"""
        import importlib.util, sys, torch
        spec = importlib.util.spec_from_file_location("rt", {str(old / 'runtime.py')!r})
        rt = importlib.util.module_from_spec(spec); spec.loader.exec_module(rt)
        art = rt.load({str(old)!r})
        x = torch.load({str(tmp_path / 'in.pt')!r})
        torch.save(torch.sigmoid(art.logits(x["dense"], x["values"], x["offsets"])), {str(tmp_path / 'out.pt')!r})
        assert not [m for m in sys.modules if m.split(".")[0] == "hugeembed"]
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), want, atol=0, rtol=0)
