"""Serving: lookup throughput of exported fp32 / int8 / int4 tables (vs TorchRec's QuantEmbeddingBagCollection
int8 when installed), memory per row, the load time and RSS of a large artifact in a fresh process, and HTTP
latency of `hugeembed serve` (1 / 64 / 1024 rows, 1 and 8 clients).

    python bench/serve.py --quick       # 1/20 of the rows, fewer requests
    python bench/serve.py               # Criteo-26 rows (capped at 10 M), d64

Lookup: the serving op (hugeembed_serve::pooled_lookup, one kernel per dim group) on 26 dynamic
tables of the lookup bench's sizes, batch 4096, one id per bag, Zipf ids, 2 threads; rows/s
counts ids looked up.  Latency: a DLRM trained for a few steps on synthetic Criteo, exported
int8 and served on 127.0.0.1; client-side p50/p99 per request, and the server's own parse /
model times (the rest is HTTP and JSON).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import criteo_batches, criteo_rows, fmt_rate, free_memory, measure, print_table  # noqa: E402

from hugeembed.serving import pooled_lookup, quantize  # noqa: E402
from hugeembed.serving._runtime import MAX_PROBE, group_tables  # noqa: E402


def lookup_bench(rows: list[int], dim: int, batch: int, iters: int, runs: int) -> list[list[str]]:
    batches = criteo_batches(rows, batch, 1, n_batches=4)
    keys = torch.cat([torch.arange(n, dtype=torch.int64) * 7 + 3 for n in rows])  # sorted, not the identity
    weights = torch.empty(sum(rows) + 1, dim).uniform_(-0.05, 0.05)
    weights[-1] = 0
    offsets = torch.arange(len(rows) * batch + 1, dtype=torch.int64)
    values = [torch.cat([ids * 7 + 3 for ids in b]) for b in batches]
    T = len(rows)
    group = {"table_keys": list(range(T)), "table_rows": [0] * T, "table_shared": [0] * T}
    t0 = time.perf_counter()
    _, _, index, meta = group_tables(group, rows, weights, keys)
    print(f"# key index: {index.numel()} {index.dtype} slots for {keys.numel()} keys, max probe "
          f"{int(meta[:, MAX_PROBE].max())}, built in {time.perf_counter() - t0:.1f} s")
    out = []
    for dtype in ("fp32", "int8", "int4"):
        stored = quantize(weights, dtype)

        def step(i, stored=stored, dtype=dtype):
            pooled_lookup(values[i % 4], offsets, stored, keys, index, meta, list(range(T)), list(range(T)), [0] * T,
                          batch, dim, dtype)

        t = measure(step, iters, runs)
        out.append([f"ours {dtype}", fmt_rate(batch * T / t.median_s), _spread(batch * T, t),
                    f"{stored.shape[1] * stored.element_size()}"])
    try:
        from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.quant.embedding_modules import EmbeddingBagCollection as QEBC
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError:
        out.append(["torchrec QEBC int8", "not installed", "-", "-"])
        return out
    cfgs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{t}"],
                               data_type=DataType.INT8) for t, n in enumerate(rows)]
    ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("cpu"))
    ebc.qconfig = torch.ao.quantization.QConfig(activation=torch.ao.quantization.PlaceholderObserver,
                                                weight=torch.ao.quantization.PlaceholderObserver.with_args(
                                                    dtype=torch.qint8))
    qebc = QEBC.from_float(ebc)
    kjts = [KeyedJaggedTensor.from_offsets_sync([f"f{t}" for t in range(T)], torch.cat(b), offsets) for b in batches]
    t = measure(lambda i: qebc(kjts[i % 4]), iters, runs)
    out.append(["torchrec QEBC int8", fmt_rate(batch * T / t.median_s), _spread(batch * T, t), f"{dim + 8}"])
    return out


def _spread(items: int, t) -> str:
    """The runs' slowest and fastest rates: how much the median can be trusted on a shared machine."""
    return f"{fmt_rate(items / max(t.runs))}-{fmt_rate(items / min(t.runs))}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def latency_bench(n_requests: int, work: Path) -> list[list[str]]:
    import httpx

    from hugeembed.data import CAT_NAMES, SyntheticConfig, SyntheticCriteo
    from hugeembed.serving import export
    from hugeembed.training import TrainConfig, Trainer

    Trainer(TrainConfig(steps=20, batch_size=1024, embedding_dim=64, checkpoint_dir=str(work / "run"),
                        checkpoint_every=20, eval_every=0, eval_rows=1024, synthetic_max_cardinality=200_000),
            progress=None).fit()
    art = export(work / "run", work / "art", dtype="int8")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "hugeembed", "serve", str(art), "--port", str(port),
                             "--watch", "0", "--threads", "2"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        gen = SyntheticCriteo(SyntheticConfig(max_cardinality=200_000))
        rows_out = []
        for n in (1, 64, 1024):
            blk = gen.rows(10**7, n)
            body = {"dense": blk.dense.tolist(), "sparse": {f: [[int(x)] for x in blk.cats[:, j]]
                                                            for j, f in enumerate(CAT_NAMES)}}
            for clients in (1, 8):
                lat: list[float] = []

                def client():
                    with httpx.Client(timeout=30) as c:
                        for _ in range(max(5, n_requests // clients)):
                            t0 = time.perf_counter()
                            c.post(url + "/predict", json=body).raise_for_status()
                            lat.append((time.perf_counter() - t0) * 1000)

                client()  # warm-up
                lat.clear()
                before = httpx.get(url + "/metrics").json()
                ts = [threading.Thread(target=client) for _ in range(clients)]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                wall = time.perf_counter() - t0
                m = httpx.get(url + "/metrics").json()
                rows_out.append([str(n), str(clients), f"{np.percentile(lat, 50):.2f}", f"{np.percentile(lat, 99):.2f}",
                                 f"{m['parse_ms']['p50']:.2f}", f"{m['model_ms']['p50']:.2f}",
                                 fmt_rate(len(lat) * n / wall), f"{(m['requests'] - before['requests']) / max(1, m['batches'] - before['batches']):.1f}"])
        return rows_out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


_LOAD_PROBE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
from hugeembed.serving import ServingModel, _runtime
t1 = time.perf_counter()


def rss_mb():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) / 1024 for k, v in (l.split(":", 1) for l in f) if k in ("VmRSS", "RssFile", "RssAnon")}


before = rss_mb()
t2 = time.perf_counter()
model = ServingModel.load(sys.argv[1])
t3 = time.perf_counter()
loaded = rss_mb()
x = torch.load(sys.argv[2])
t4 = time.perf_counter()
model.logits_raw(x["dense"], x["values"], x["offsets"])
t5 = time.perf_counter()
looked = rss_mb()
# verification alone (the files are hashed again: the same work load did first)
m = model.manifest
t6 = time.perf_counter()
for rec in m["files"].values():
    _runtime.verify_file(model.directory / rec["file"], rec)
t7 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t3 - t2, "verify_s": t7 - t6, "first_batch_s": t5 - t4,
                  "rss_before": before, "rss_loaded": loaded, "rss_after_batch": looked}))
"""


def load_bench(rows: list[int], dim: int, batch: int, work: Path) -> list[list[str]]:
    """A large int8 artifact (the given table sizes) loaded in a fresh process: load time (and how much of
    it is sha256 verification), RSS after load and after one lookup batch.  The artifact is a small
    trained export whose tables are replaced by big random ones through the export's own writers."""
    import json

    from hugeembed import checkpoint as ckpt
    from hugeembed.serving import export
    from hugeembed.serving._export import GroupSpec, write_group
    from hugeembed.training import TrainConfig, Trainer

    Trainer(TrainConfig(steps=2, batch_size=256, embedding_dim=dim, checkpoint_dir=str(work / "run"),
                        checkpoint_every=2, eval_every=0, eval_rows=1024, synthetic_max_cardinality=1000),
            progress=None).fit()
    art = export(work / "run", work / "art", dtype="int8")
    m = json.loads((art / "manifest.json").read_text())
    if len(m["groups"]) != 1:
        raise SystemExit(f"load bench: expected one dim group, the export has {len(m['groups'])}")
    spec = GroupSpec.from_dict(m["groups"][0])
    by_name = {f"C{i + 1}": n for i, n in enumerate(rows)}
    sizes = [by_name[t] for t in spec.tables]
    t0 = time.perf_counter()
    stored = torch.randint(0, 256, (sum(sizes) + 1, dim + 8), dtype=torch.uint8)
    scale_bias = stored[:, dim:].view(torch.float32)  # per row float32 scale and bias after the D bytes
    scale_bias[:, 0] = 1e-3
    scale_bias[:, 1] = -0.128
    stored[-1] = 0  # the zero row (scale 0, bias 0)
    keys = torch.cat([torch.arange(n, dtype=torch.int64) * 7 + 3 for n in sizes])
    for f in ("g0.rows.npy", "g0.keys.npy", "g0.index.npy"):
        (art / "tables" / f).unlink()
    m["files"].update(write_group(art, 0, spec, sizes, stored, keys))
    for t in m["tables"]:
        t["rows"] = by_name[t["name"]]
    ckpt.write_bytes(art / "manifest.json", json.dumps(m, indent=1, sort_keys=True).encode())
    built = time.perf_counter() - t0
    size_gb = sum(rec["bytes"] for rec in m["files"].values()) / 1e9
    index_gb = m["files"]["index.0"]["bytes"] / 1e9
    del stored, scale_bias, keys
    free_memory()
    # one batch: `batch` rows, one id per feature, Zipf ids over each table (as the lookup bench)
    ids = criteo_batches(rows, batch, 1, n_batches=1)[0]
    feats = m["features"]["sparse"]
    values = torch.cat([ids[int(f[1:]) - 1] * 7 + 3 for f in feats])
    torch.save({"dense": torch.zeros(batch, m["features"]["dense"]), "values": values,
                "offsets": torch.arange(len(feats) * batch + 1, dtype=torch.int64)}, work / "in.pt")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", _LOAD_PROBE, str(art), str(work / "in.pt")], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"load bench: the probe failed: {proc.stderr[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return [[f"{sum(sizes) / 1e6:.1f} M rows, {size_gb:.2f} GB ({index_gb:.2f} GB index), built in {built:.0f} s",
             f"{r['import_s']:.2f}", f"{r['load_s']:.2f}", f"{r['verify_s']:.2f}",
             f"{r['rss_before']['VmRSS']:.0f}", f"{r['rss_loaded']['VmRSS']:.0f}",
             f"{r['rss_after_batch']['VmRSS']:.0f} ({r['rss_after_batch']['RssFile']:.0f} file)",
             f"{r['first_batch_s'] * 1000:.0f}"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-latency", action="store_true")
    p.add_argument("--no-load", action="store_true", help="skip exporting and loading the large artifact")
    p.add_argument("--no-lookup", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = criteo_rows(scale=0.05 if args.quick else 1.0)
    if not args.no_lookup:
        print(f"# lookup: Criteo-26, {sum(rows) / 1e6:.1f} M rows, d{args.dim}, batch {args.batch}, P1, "
              f"{args.threads} threads (range: the slowest and fastest of 3 runs)")
        print_table(["impl", "ids/s", "range", "bytes/row"],
                    lookup_bench(rows, args.dim, args.batch, 5 if args.quick else 10, 3))
    if not args.no_load:
        print(f"\n# load: an int8 d{args.dim} artifact of these tables in a fresh process (s; RSS MiB; warm page "
              f"cache: the files were just written); verify: sha256 of every file, part of load")
        with tempfile.TemporaryDirectory() as d:
            print_table(["artifact", "import", "load", "verify", "RSS start", "RSS loaded",
                         f"RSS after {args.batch} rows", "batch ms"], load_bench(rows, args.dim, args.batch, Path(d)))
    if not args.no_latency:
        print("\n# server latency (int8 DLRM d64, JSON bodies; ms; parse/model: the server's own p50)")
        with tempfile.TemporaryDirectory() as d:
            print_table(["rows", "clients", "p50", "p99", "parse p50", "model p50", "rows/s", "req/batch"],
                        latency_bench(100 if args.quick else 400, Path(d)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
