"""Serving: lookup throughput of exported int8 / int4 tables against TorchRec's QuantEmbeddingBagCollection
(when installed), ids chosen to collide in the artifact's public hash, the load time and RSS of a large
artifact in a fresh process, and HTTP latency of `hugeembed serve` (1 / 64 / 1024 rows, 1 and 8 keep-alive
clients, and 64 rows under a client posting maximal bodies) with its cost split.

    python bench/serve.py --quick       # 1/20 of the rows, fewer requests
    python bench/serve.py               # Criteo-26 rows (capped at 10 M), d64

Lookup: the serving op (hugeembed_serve::pooled_lookup, one kernel per dim group) on 26 tables of
the lookup bench's sizes (dynamic, and static like QEBC's), batch 4096, one id per bag, Zipf ids;
ids/s counts ids looked up; every implementation timed in interleaved runs (medians).  Latency: a
DLRM trained for a few steps on synthetic Criteo, exported int8 and served on 127.0.0.1;
client-side p50/p99 per request, and the server's own parse / queue / model times (Server-Timing;
the rest is HTTP and JSON).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
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
from _common import criteo_batches, criteo_rows, fmt_rate, free_memory, measure_together, print_table  # noqa: E402

from hugeembed._native import tune_malloc  # noqa: E402
from hugeembed.serving import _lookup_ops, pooled_lookup, quantize  # noqa: E402
from hugeembed.serving._quant import row_width, storage_dtype  # noqa: E402
from hugeembed.serving._index import group_tables, index_probes, serving_index  # noqa: E402
from hugeembed.serving._runtime import MAX_PROBE  # noqa: E402
from hugeembed.store import _alloc  # noqa: E402


def lookup_bench(rows: list[int], dim: int, batch: int, runs: int, two_pass: bool = False) -> list[list[str]]:
    """The serving op on Criteo-26 tables against TorchRec's QuantEmbeddingBagCollection (static tables,
    the id is the row), all timed together (interleaved runs, medians).  Ours: dynamic tables (keys
    ``7 i + 3``, found through the private salted index loaded tables read, or through the artifact's
    own index) and static tables (the id is the row, as QEBC).  `two_pass`: also both as before he_serve_pool
    (the id -> row kernel, then torch's quantized embedding_bag op).  Rows, ours and QEBC's, on 2 MiB pages (as an
    artifact's mapped files are here, and the private index the kernels build) unless `_alloc.HUGE_PAGES` is off
    (--small-pages).  CPU: the process's CPU time a call (every thread), median: what the load of a shared
    machine inflates much less than the wall time."""
    batches = criteo_batches(rows, batch, 1, n_batches=4)
    T = len(rows)
    keys = torch.cat([torch.arange(n, dtype=torch.int64) * 7 + 3 for n in rows])  # sorted, not the identity
    # the stored rows straight from chunks of random weights: at full size (33.6 M rows) float32 weights
    # alone would take 8.6 GB
    stored = {d: _random_rows(sum(rows) + 1, dim, d) for d in ("int8", "int4")}
    offsets = torch.arange(T * batch + 1, dtype=torch.int64)
    dyn_values = [torch.cat([ids * 7 + 3 for ids in b]) for b in batches]
    static_values = [torch.cat(b) for b in batches]
    dyn = {"table_keys": list(range(T)), "table_rows": [0] * T, "table_shared": [0] * T}
    t0 = time.perf_counter()
    _, _, index, meta = group_tables(dyn, rows, stored["int8"], keys)
    t1 = time.perf_counter()
    private = serving_index(keys, meta)
    t2 = time.perf_counter()
    print(f"# key index: {keys.numel()} keys; the artifact's: {index.numel()} {index.dtype} slots, longest chain "
          f"{int(meta[:, MAX_PROBE].max())}, built in {t1 - t0:.1f} s (torch); the private salted one: longest chain "
          f"{int(private[2])}, built in {t2 - t1:.2f} s (kernels, at load)")
    static = {"table_keys": [-1] * T, "table_rows": list(rows), "table_shared": [0] * T}
    _, _, s_index, s_meta = group_tables(static, rows, stored["int8"], torch.zeros(0, dtype=torch.int64))
    free_memory()

    def ours(dtype, values, idx, m, pool=True):
        def step(i):
            saved = _lookup_ops.pool_accelerator
            _lookup_ops.pool_accelerator = saved if pool else None
            try:
                pooled_lookup(values[i % 4], offsets, stored[dtype], keys, idx, m, list(range(T)), list(range(T)),
                              [0] * T, batch, dim, dtype)
            finally:
                _lookup_ops.pool_accelerator = saved
        return step

    fns = {}
    for dtype in ("int8", "int4"):
        fns[f"ours {dtype}, dynamic (private index)"] = ours(dtype, dyn_values, private, meta)
        fns[f"ours {dtype}, dynamic (artifact index)"] = ours(dtype, dyn_values, index, meta)
        fns[f"ours {dtype}, static"] = ours(dtype, static_values, s_index, s_meta)
        if two_pass:
            fns[f"ours {dtype}, dynamic (private index), two passes"] = ours(dtype, dyn_values, private, meta, False)
            fns[f"ours {dtype}, static, two passes"] = ours(dtype, static_values, s_index, s_meta, False)
    qebc = _qebc(rows, dim, batches, offsets, stored)
    fns.update(qebc)
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    t = measure_together({name: _cpu_timed(fn, cpu[name]) for name, fn in fns.items()}, 0, runs, seconds=0.5)
    out = []
    for name, timing in t.items():
        dtype = "int8" if "int8" in name else "int4"
        ref = t.get(f"torchrec QEBC {dtype}")
        ratio = f"{ref.median_s / timing.median_s:.2f}x" if ref is not None else "-"
        ns = statistics.median(cpu[name]) / (batch * T) * 1e9
        ref_ns = statistics.median(cpu[f"torchrec QEBC {dtype}"]) / (batch * T) * 1e9 if ref is not None else None
        width = stored[dtype].shape[1]
        out.append([name, fmt_rate(batch * T / timing.median_s), _spread(batch * T, timing), ratio, f"{ns:.1f}",
                    f"{ref_ns / ns:.2f}x" if ref_ns else "-", str(width)])
    if not qebc:
        out.append(["torchrec QEBC", "not installed", "-", "-", "-", "-", "-"])
    return out


def _cpu_timed(fn, into: list[float]):
    """fn, appending the process's CPU seconds of each call to `into` (every thread's)."""
    def step(i):
        c0 = time.process_time()
        fn(i)
        into.append(time.process_time() - c0)
    return step


def _random_rows(n: int, dim: int, dtype: str, chunk: int = 1 << 20) -> torch.Tensor:
    """`n` stored rows of `dtype` quantized from uniform(-0.05, 0.05) weights a chunk at a time (the last row
    zero: the zero row), never holding the float32 weights of more than one chunk; on 2 MiB pages (_alloc)."""
    out = _alloc.empty((n, row_width(dtype, dim)), storage_dtype(dtype))
    g = torch.Generator().manual_seed(0)
    for s in range(0, n, chunk):
        w = torch.empty(min(chunk, n - s), dim).uniform_(-0.05, 0.05, generator=g)
        if s + w.shape[0] == n:
            w[-1] = 0
        out[s: s + w.shape[0]] = quantize(w, dtype)
    return out


def _qebc(rows, dim, batches, offsets, stored) -> dict:
    """TorchRec's QuantEmbeddingBagCollection, int8 and int4, one step each (empty where not installed), holding
    the same quantized rows as ours (`stored`, see qebc_holding)."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError:
        return {}
    T = len(rows)
    kjts = [KeyedJaggedTensor.from_offsets_sync([f"f{t}" for t in range(T)], torch.cat(b), offsets) for b in batches]
    out = {}
    for dtype in ("int8", "int4"):
        qebc = qebc_holding(rows, dim, stored[dtype], dtype)
        out[f"torchrec QEBC {dtype}"] = (lambda q: (lambda i: q(kjts[i % 4])))(qebc)
    return out


def qebc_holding(rows: list[int], dim: int, stored: torch.Tensor, dtype: str):
    """A QuantEmbeddingBagCollection (table t: feature f<t>, `rows[t]` rows) holding our quantized rows `stored`
    (the tables one after the other, `dtype` int8 or int4), copied into FBGEMM's layout table by table: no
    float EmbeddingBagCollection first, which at full size would hold 8.6 GB of float32 weights per dtype.
    FBGEMM keeps a float16 scale and bias before each row's bytes; ours are after them, float32 for int8
    (rounded to float16 here: int8 rows differ from ours by that rounding) and float16 for int4 (the same).
    Its weights then move to 2 MiB pages, as ours are (_alloc; measured: QEBC itself gains little from them)."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QEBC

    cfgs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{t}"],
                               data_type=DataType.INT8 if dtype == "int8" else DataType.INT4)
            for t, n in enumerate(rows)]
    qebc = QEBC(cfgs, is_weighted=False, device=torch.device("cpu"))
    (tbe,) = qebc._emb_modules
    width = dim if dtype == "int8" else dim // 2
    first = 0
    for (w, scale_bias), n in zip(tbe.split_embedding_weights(split_scale_shifts=True), rows):
        ours = stored[first: first + n]
        first += n
        w[:, :width].copy_(ours[:, :width])
        sb = scale_bias.view(torch.float16)
        if dtype == "int8":
            sb.copy_(ours[:, width:].view(torch.float32))
        else:
            sb.copy_(ours[:, width: width + 4].view(torch.float16))
    if tbe.weights_host.numel():  # its CPU forward reads weights_host
        tbe.weights_host = _alloc.empty(tuple(tbe.weights_host.shape), torch.uint8).copy_(tbe.weights_host)
    return qebc


def hostile_bench(n: int, runs: int) -> list[list[str]]:
    """Issue 31: `n` ids chosen to share one home slot of the artifact's index (its hash is public), looked
    up through that index and through the private salted one, against as many random ids: the time of a
    lookup of every id, and the slots read (he_serve_index_probes)."""
    m64 = (1 << 64) - 1

    def unsplitmix(z):
        def unxs(y, s):
            x = y
            for _ in range(64 // s + 1):
                x = y ^ (x >> s)
            return x
        z = unxs(z, 31)
        z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & m64
        z = unxs(z, 27)
        z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & m64
        return unxs(z, 30)

    def signed(x):
        return x - (1 << 64) if x >> 63 else x

    hostile = sorted(signed((unsplitmix(3 + (j << 32)) - 0x9E3779B97F4A7C15) & m64) for j in range(n))
    rng = np.random.default_rng(0)
    random_ids = sorted(set(rng.integers(-(1 << 62), 1 << 62, n).tolist()))
    out = []
    dim = 8
    for name, ids in (("chosen ids", hostile), ("random ids", random_ids)):
        keys = torch.tensor(ids, dtype=torch.int64)
        rows = quantize(torch.zeros(len(ids) + 1, dim), "int8")
        group = {"table_keys": [0], "table_rows": [0], "table_shared": [0]}
        t0 = time.perf_counter()
        _, _, index, meta = group_tables(group, [len(ids)], rows, keys)
        built = time.perf_counter() - t0
        private = serving_index(keys, meta)
        offsets = torch.arange(len(ids) + 1, dtype=torch.int64)
        fns = {idx_name: (lambda idx: lambda i: pooled_lookup(keys, offsets, rows, keys, idx, meta, [0], [0], [0],
                                                              len(ids), dim, "int8"))(idx)
               for idx_name, idx in (("artifact index", index), ("private index", private))}
        t = measure_together(fns, 0, runs, seconds=0.3)
        _, probes = index_probes(private, keys, torch.zeros_like(keys), keys, meta)
        out.append([name, f"{t['artifact index'].median_s * 1000:.2f}", f"{int(meta[0, MAX_PROBE])}",
                    f"{built:.1f}", f"{t['private index'].median_s * 1000:.2f}",
                    f"{float(probes.double().mean()):.2f}", f"{int(private[2])}"])
    return out


def _spread(items: int, t) -> str:
    """The runs' slowest and fastest rates: how much the median can be trusted on a shared machine."""
    return f"{fmt_rate(items / max(t.runs))}-{fmt_rate(items / min(t.runs))}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _predict_body(gen, n: int) -> bytes:
    import json

    from hugeembed.data import CAT_NAMES

    blk = gen.rows(10**7, n)
    return json.dumps({"dense": blk.dense.tolist(),
                       "sparse": {f: [[int(x)] for x in blk.cats[:, j]] for j, f in enumerate(CAT_NAMES)}}).encode()


def _maximal_body(gen) -> bytes:
    """Just under 8 MiB of JSON (the default body limit): 4096 rows (the row limit) of 9 ids a bag, refused at
    its last id, so the server parses all of it and answers 400."""
    import json

    from hugeembed.data import CAT_NAMES

    blk = gen.rows(2 * 10**7, 4096)
    ids = (blk.cats[:, :, None] % 10_000_000 + np.arange(9)).tolist()
    body = {"dense": blk.dense.astype(np.float64).round(3).tolist(),
            "sparse": {f: [row[j] for row in ids] for j, f in enumerate(CAT_NAMES)}}
    body["sparse"]["C26"][-1][-1] = "zz"
    return json.dumps(body, separators=(",", ":")).encode()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) the process `pid` has used: its work, whatever the load."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _clients(port: int, body: bytes, clients: int, per_client: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep-alive clients (one connection each) posting `body` in turn: (latency ms, the server's parse, queue,
    model ms, the model call's CPU ms and the event loop thread's CPU ms from its Server-Timing header) of every
    request."""
    import http.client

    lat, server = [], []

    def client():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for _ in range(per_client):
            t0 = time.perf_counter()
            c.request("POST", "/predict", body, {"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            lat.append((time.perf_counter() - t0) * 1000)
            if r.status != 200:
                raise SystemExit(f"latency bench: the server answered {r.status}")
            parts = dict(p.strip().split(";dur=") for p in r.getheader("server-timing").split(","))
            # app-cpu: the event loop thread's CPU (servers before it lack it: nan)
            server.append([float(parts.get(k, "nan")) for k in ("parse", "queue", "model", "model-cpu", "app-cpu")])
        c.close()

    ts = [threading.Thread(target=client) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return np.array(lat), np.array(server)


class _BigBodies:
    """One client posting maximal bodies in a loop, and a probe timing /healthz every 20 ms, while running."""

    def __init__(self, port: int, body: bytes) -> None:
        import http.client

        self.stop, self.health, self.posted = threading.Event(), [], 0

        def loader():
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            while not self.stop.is_set():
                c.request("POST", "/predict", body, {"content-type": "application/json"})
                c.getresponse().read()
                self.posted += 1
            c.close()

        def prober():
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            while not self.stop.is_set():
                t0 = time.perf_counter()
                c.request("GET", "/healthz")
                c.getresponse().read()
                self.health.append((time.perf_counter() - t0) * 1000)
                time.sleep(0.02)
            c.close()

        self.threads = [threading.Thread(target=loader), threading.Thread(target=prober)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        while not self.posted:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def latency_bench(n_requests: int, threads: int, work: Path, art: Path | None = None,
                  sizes: tuple[int, ...] = (1, 64, 1024), big: bool = True) -> list[list[str]]:
    """`hugeembed serve` of an int8 DLRM d64 on 127.0.0.1, keep-alive clients: latency p50 / p99 and its
    split (the server's parse, queue and model medians from Server-Timing; HTTP + JSON: the rest).
    `art`: an artifact of that model exported before (else one is trained and exported here)."""
    import httpx

    from hugeembed.data import SyntheticConfig, SyntheticCriteo
    from hugeembed.serving import export
    from hugeembed.training import TrainConfig, Trainer

    if art is None:
        Trainer(TrainConfig(steps=20, batch_size=1024, embedding_dim=64, checkpoint_dir=str(work / "run"),
                            checkpoint_every=20, eval_every=0, eval_rows=1024, synthetic_max_cardinality=200_000),
                progress=None).fit()
        art = export(work / "run", work / "art", dtype="int8")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "hugeembed", "serve", str(art), "--port", str(port),
                             "--watch", "0", "--threads", str(threads)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        gen = SyntheticCriteo(SyntheticConfig(max_cardinality=200_000))
        bodies = {n: _predict_body(gen, n) for n in sizes}

        def row(label, n, clients, lat, server, cpu_s, extra="-"):
            split = np.median(server, axis=0)
            rest = np.median(lat - server[:, :3].sum(axis=1))
            cpu = cpu_s * 1000 / len(lat)
            return [label, str(n), str(clients), f"{np.percentile(lat, 50):.2f}", f"{np.percentile(lat, 99):.2f}",
                    f"{split[0]:.2f}", f"{split[1]:.2f}", f"{split[2]:.2f}", f"{rest:.2f}",
                    f"{cpu:.2f}", f"{split[3]:.2f}", f"{split[4]:.2f}", extra]

        def timed(n, clients, per):
            cpu0 = _cpu_s(proc.pid)
            lat, server = _clients(port, bodies[n], clients, per)
            return lat, server, _cpu_s(proc.pid) - cpu0

        out = []
        for n in sizes:
            for clients in (1, 8):
                per = max(5, (n_requests if n < 1024 else n_requests // 4) // clients)
                _clients(port, bodies[n], clients, 3)  # warm-up
                lat, server, cpu_s = timed(n, clients, per)
                out.append(row("", n, clients, lat, server, cpu_s))
                if clients == 1:  # its slowest 1%: did they cost more CPU (model CPU, app CPU) or wait?
                    slow = lat >= np.percentile(lat, 99)
                    out.append(row(f"slowest {slow.sum()}", n, clients, lat[slow], server[slow], float("nan")))
        if not big or 64 not in bodies:
            return out
        per = max(5, n_requests // 8)
        with _BigBodies(port, _maximal_body(gen)) as load:
            lat, server, cpu_s = timed(64, 8, per)
        out.append(row("big-body load", 64, 8, lat, server, cpu_s, f"{max(load.health):.0f} ({load.posted} bodies)"))
        return out
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


def _passive_openmp() -> None:
    """Runs this script again with OMP_WAIT_POLICY=PASSIVE (as `hugeembed serve` runs), unless a wait policy is
    set: with spinning workers every implementation here ran 2-3x slower on a loaded 2-CPU machine."""
    if os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT"):
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])


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
    p.add_argument("--two-pass", action="store_true", help="lookup: also the two passes before he_serve_pool (A/B in one run)")
    p.add_argument("--small-pages", action="store_true", help="lookup: rows (ours and QEBC's) on 4 KiB pages (the private index asks for 2 MiB ones either way)")
    p.add_argument("--artifact", type=Path, help="latency: serve this int8 DLRM d64 export (else one is trained)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 1024], help="latency: request sizes")
    p.add_argument("--requests", type=int, help="latency: requests per size (default 100 --quick, else 400)")
    p.add_argument("--no-big", action="store_true", help="latency: skip the run under maximal bodies")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_malloc()  # for every implementation alike: they share this process (and `hugeembed serve` does it too)
    rows = criteo_rows(scale=0.05 if args.quick else 1.0)
    _alloc.HUGE_PAGES = not args.small_pages
    if not args.no_lookup:
        print(f"# lookup: Criteo-26, {sum(rows) / 1e6:.1f} M rows, d{args.dim}, batch {args.batch}, P1, "
              f"{args.threads} threads (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}), rows on "
              f"{'4 KiB' if args.small_pages else '2 MiB'} pages, Zipf ids; interleaved runs, medians (range: the slowest and fastest run); "
              f"vs QEBC: QEBC's time / ours, same dtype; CPU: the process's CPU time a call (every thread), median")
        print_table(["impl", "ids/s", "range", "vs QEBC", "CPU ns/id", "CPU vs QEBC", "bytes/row"],
                    lookup_bench(rows, args.dim, args.batch, 3 if args.quick else 5, args.two_pass))
        print(f"# load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        n = 4000 if args.quick else 24000
        print(f"\n# {n} ids chosen to share one home slot of the artifact's index (its hash is public), and {n} "
              f"random ids: a lookup of each, ms (issue 31: 24 k made a table 800x slower)")
        print_table(["ids", "artifact index ms", "longest chain", "index built s", "private index ms",
                     "mean slots read", "longest chain"], hostile_bench(n, 3))
    if not args.no_load:
        print(f"\n# load: an int8 d{args.dim} artifact of these tables in a fresh process (s; RSS MiB; warm page "
              f"cache: the files were just written); verify: sha256 of every file, part of load")
        with tempfile.TemporaryDirectory() as d:
            print_table(["artifact", "import", "load", "verify", "RSS start", "RSS loaded",
                         f"RSS after {args.batch} rows", "batch ms"], load_bench(rows, args.dim, args.batch, Path(d)))
    if not args.no_latency:
        print(f"\n# server latency: int8 DLRM d64, JSON bodies, keep-alive clients, --threads {args.threads} (ms; "
              f"parse, queue, model: the server's medians from Server-Timing; HTTP+JSON: the median rest; big-body "
              f"load: while one client posts 8 MiB bodies in a loop, with the slowest /healthz; server CPU: the server "
              f"process's CPU ms per request, every thread; model CPU: the median model call's CPU ms, on its "
              f"thread (a call serves every request batched into it); app CPU: the median request's CPU ms on the event "
              f"loop's thread, from its arrival in the app to its answer (with several clients, theirs too); the rest "
              f"of server CPU is uvicorn's HTTP and the hand-offs between threads; 'slowest k': the medians of the "
              f"one-client requests at or above the p99 (their model CPU and app CPU against the row above: did "
              f"they cost more or wait?))")
        with tempfile.TemporaryDirectory() as d:
            before = os.getloadavg()
            table = latency_bench(args.requests or (100 if args.quick else 400), args.threads, Path(d), args.artifact,
                                  tuple(args.rows), not args.no_big)
            print_table(["", "rows", "clients", "p50", "p99", "parse", "queue", "model", "HTTP+JSON", "server CPU",
                         "model CPU", "app CPU", "slowest /healthz"], table)
        # wall times wait for the CPUs the machine's other work holds; the server's CPU per request does much less
        print(f"# load average (1 min) {before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} "
              f"CPUs (above {os.cpu_count()}, the wall p50/p99 include waits for a CPU; 'server CPU' much less so)")
    return 0


if __name__ == "__main__":
    _passive_openmp()
    raise SystemExit(main())
