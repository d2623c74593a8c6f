"""Benchmarks of hugeembed's embedding tables, each measured against a reference in the same run.

Parts (``--part``; run one or all):

* ``store``: id -> row mapping.  A HashStore pre-filled with ``--keys`` keys (default
  50 M); batches of ``--batch`` unique keys drawn Zipf(``--zipf``) over the table,
  ``--new-frac`` of them never seen; median of ``--runs`` runs of ``find`` and
  ``find_or_insert`` for our native store, our torch-ops store (the same arrays,
  ``use_backend("torch")``) and a torch.unique + searchsorted sorted-array reference.
  Also prints the bytes per row beyond weights + state.

* ``step``: a full embedding training step (fused lookup + backward + row-wise Adagrad
  in backward) on the Criteo-26 tables (Kaggle row counts capped at 10 M), batch 8192,
  pooling 1, Zipf ids, for an EmbeddingCollection of dynamic (hash) tables, the same
  with static tables, and FBGEMM's TBE with EXACT_ROWWISE_ADAGRAD (when installed).
  Each timed step sees a fresh batch (new ids keep arriving in the dynamic tables).

Further parts register in PARTS below.

    python bench/tables.py --help
    python bench/tables.py --quick          # ~20 s smoke run
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
from pathlib import Path

# Torch's OpenMP workers spin for a while after each parallel op; the store's
# kernels start their own threads right after such ops and would find the other
# core taken (measured on 2 cores: find 5 M keys/s with spinning workers, 34 M
# keys/s without).  Must be set before torch loads libgomp; override from outside.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hugeembed import _native  # noqa: E402
from hugeembed._hashing import mix64  # noqa: E402
from hugeembed.store import HashStore, TruncatedNormal, Uniform  # noqa: E402
from hugeembed.store import _alloc  # noqa: E402
from hugeembed.store._dynamic import MAX_LOAD  # noqa: E402

_SALT = 0x5DEECE66D


def table_key(ids: torch.Tensor) -> torch.Tensor:
    """The key of table entry i (a bijection of i, so keys are unique and scattered)."""
    return mix64(ids + _SALT)


def zipf_ranks(n: int, size: int, a: float, gen: torch.Generator) -> torch.Tensor:
    """`size` ranks in [0, n) with P(rank = r) ~ (r + 1)^-a (inverse CDF of the continuous law)."""
    u = torch.rand(size, generator=gen, dtype=torch.float64)
    e = 1.0 - a
    r = ((n ** e - 1.0) * u + 1.0) ** (1.0 / e) - 1.0
    return r.long().clamp_(0, n - 1)


class Batches:
    """Unique query batches: Zipf-hot existing keys plus never-seen keys."""

    def __init__(self, n_keys: int, batch: int, new_frac: float, a: float, seed: int = 0):
        self.n, self.batch, self.a = n_keys, batch, a
        self.n_new = int(batch * new_frac)
        self.next_new = n_keys  # ids >= n_keys are not in the table
        self.gen = torch.Generator().manual_seed(seed)
        # Hot ranks sit at scattered table positions, as real hot ids do.
        self.perm_mul = 2654435761

    def make(self) -> torch.Tensor:
        want = self.batch - self.n_new
        got = torch.empty(0, dtype=torch.int64)
        while got.numel() < want:
            r = zipf_ranks(self.n, 2 * want, self.a, self.gen)
            ids = (r * self.perm_mul) % self.n
            got = torch.cat([got, ids]).unique()
        existing = got[torch.randperm(got.numel(), generator=self.gen)[:want]]
        new = torch.arange(self.next_new, self.next_new + self.n_new)
        self.next_new += self.n_new
        keys = table_key(torch.cat([existing, new]))
        return keys[torch.randperm(keys.numel(), generator=self.gen)]


class SortedReference:
    """The torch-only reference: a sorted key array with a slot array beside it."""

    def __init__(self, keys: torch.Tensor):
        self.keys, order = keys.sort()
        self.slots = order

    def find(self, q: torch.Tensor) -> torch.Tensor:
        i = torch.searchsorted(self.keys, q).clamp_(max=self.keys.numel() - 1)
        return torch.where(self.keys[i] == q, self.slots[i], -1)

    def find_or_insert(self, q: torch.Tensor) -> torch.Tensor:
        out = self.find(q)
        new = torch.unique(q[out < 0])  # sorted
        if new.numel():
            at = torch.searchsorted(self.keys, new) + torch.arange(new.numel())
            n = self.keys.numel() + new.numel()
            is_new = torch.zeros(n, dtype=torch.bool)
            is_new[at] = True
            keys, slots = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
            keys[at] = new
            slots[at] = torch.arange(self.keys.numel(), n)
            keys[~is_new] = self.keys
            slots[~is_new] = self.slots
            self.keys, self.slots = keys, slots
            out[out < 0] = self.find(q[out < 0])
        return out


def _median_rate(fn, batches: list[torch.Tensor]) -> tuple[float, float]:
    """Median M keys/s of fn over the batches (one call each), wall clock and per CPU-second.

    The second figure (keys per second of CPU time used by this process, all
    threads) tells how much of a slow wall-clock figure is other load on the machine.
    """
    rates, cpu_rates = [], []
    for b in batches:
        t0, c0 = time.perf_counter(), time.process_time()
        fn(b)
        t1, c1 = time.perf_counter(), time.process_time()
        rates.append(b.numel() / (t1 - t0) / 1e6)
        cpu_rates.append(b.numel() / max(c1 - c0, 1e-9) / 1e6)
    return statistics.median(rates), statistics.median(cpu_rates)


def bench_store(args) -> None:
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    _alloc.HUGE_PAGES = not args.no_hugepages
    init = Uniform(-0.05, 0.05) if args.init == "uniform" else TruncatedNormal(0.0, 0.05)
    print(f"# store: {args.keys:,} keys, batches of {args.batch:,} unique keys (Zipf {args.zipf}, "
          f"{args.new_frac:.0%} new), dim {args.dim}, {args.init} init, {args.threads} threads, "
          f"huge pages {'on' if _alloc.HUGE_PAGES else 'off'}, max load {MAX_LOAD}, median of {args.runs} runs")
    backend = "native" if _native.available() else "torch"
    # The reservation hint covers the keys the timed batches will add, so no
    # growth (a one-off 1.5x copy of the storage) lands inside a timed run.
    backends = [b for b in args.backends.split(",") if b and (b != "native" or _native.available())]
    expected_new = (2 * args.runs + 1) * len(backends) * int(args.batch * args.new_frac)
    store = HashStore("bench", args.dim, initializer=init, initial_rows=args.keys + expected_new, backend=backend)
    t0 = time.perf_counter()
    chunk = 1 << 20
    for start in range(0, args.keys, chunk):
        store.find_or_insert(table_key(torch.arange(start, min(args.keys, start + chunk))), 0)
    fill = time.perf_counter() - t0
    print(f"pre-fill ({backend}): {args.keys / fill / 1e6:.1f} M keys/s in 1 M-key batches ({fill:.1f} s)")

    gen = Batches(args.keys, args.batch, args.new_frac, args.zipf)
    results: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {}
    for name in backends:
        store.use_backend(name)
        qs = [gen.make() for _ in range(args.runs + 1)]
        find = _median_rate(store.find, qs[1:])
        store.find_or_insert(qs[0], 1)  # warm-up (scratch buffers, allocator)
        ins = _median_rate(lambda b: store.find_or_insert(b, 2), [gen.make() for _ in range(args.runs)])
        results[f"HashStore {name}"] = (find, ins)
    store.use_backend(backends[0])
    mem = store.memory_breakdown()
    rows = len(store)

    if not args.no_reference:
        ref_keys = table_key(torch.arange(gen.next_new))  # everything the store holds now, same count
        ref = SortedReference(ref_keys[: args.keys])
        del ref_keys
        gc.collect()
        qs = [gen.make() for _ in range(args.runs)]
        find = _median_rate(ref.find, qs)
        ins = _median_rate(ref.find_or_insert, [gen.make() for _ in range(args.runs)])
        results["unique+searchsorted (ref)"] = (find, ins)

    ref = results.get("unique+searchsorted (ref)")
    print(f"load average before the runs: {' '.join(f'{x:.1f}' for x in load_before)} "
          f"(on {os.cpu_count()} cores; the rate per CPU-second is in brackets)")
    print(f"{'':28s} {'find M keys/s':>20s} {'find_or_insert M keys/s':>26s}")
    for name, ((f, fc), (i, ic)) in results.items():
        ratio = f"   {f / ref[0][0]:.1f}x / {i / ref[1][0]:.1f}x ref" if ref and not name.endswith("(ref)") else ""
        print(f"{name:28s} {f:11.1f} ({fc:5.1f}) {i:17.1f} ({ic:5.1f}){ratio}")
    index = mem["index"]
    meta = mem["row_metadata"]
    spare = mem["storage"] - rows * args.dim * 4
    print(f"bytes/row beyond weights+state at {rows:,} rows: index {index / rows:.1f} "
          f"(key + code, 12 B x {store.num_buckets:,} buckets, load {store._st_get('entries') / store.num_buckets:.2f}), "
          f"per-row metadata (count + last step, in the bucket record) {meta / rows:.1f}, spare rows {spare / rows:.1f}, "
          f"total {store.index_overhead_bytes() / rows:.1f}")


def bench_step(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import criteo_batches, criteo_rows, fbgemm_available, fmt_rate, measure, print_table

    from hugeembed.features import SparseFeatures
    from hugeembed.nn import EmbeddingCollection, TableConfig
    from hugeembed.optim import RowWiseAdagrad

    torch.set_num_threads(args.threads)
    _native.tune_malloc()
    rows = criteo_rows(scale=0.05 if args.quick else 1.0)
    B, D, lr = 8192, args.dim, 0.01
    iters, runs = 2, (3 if args.quick else 5)
    warm = 0 if args.quick else args.warm_batches
    batches = criteo_batches(rows, B, 1, n_batches=warm + 3 + iters * runs, seed=7)
    names = [f"C{t + 1}" for t in range(len(rows))]
    sfs = [SparseFeatures(names, torch.cat(b), lengths=torch.ones(len(rows) * B, dtype=torch.int64)) for b in batches]
    grad = torch.randn(B, len(rows), D)
    rates = {}
    for kind in ("dynamic", "static"):
        tables = [TableConfig(n, D, num_rows=(r if kind == "static" else None), combiner="sum",
                              initializer=Uniform(-0.05, 0.05)) for n, r in zip(names, rows)]
        ec = EmbeddingCollection(tables, optimizer=RowWiseAdagrad(lr=lr))

        def step(i, ec=ec, first=0):
            ec(sfs[first + i % (len(sfs) - first)]).stacked().backward(grad)

        if kind == "dynamic" and warm:
            # early training: nearly every id is new, the tables grow every step
            rates["dynamic (fresh)"] = measure(step, iters, runs).rate(B)
            for i in range(3 + iters * runs, warm):  # then train on to the steady state
                step(i)
            step = functools.partial(step, first=warm)
        rates[kind] = measure(step, iters, runs).rate(B)
        print(f"# {kind}: {fmt_rate(rates[kind])} samples/s, {sum(ec.num_rows().values()):,} rows after the run",
              flush=True)
        del ec, step
        gc.collect()
    if fbgemm_available():
        from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                            SplitTableBatchedEmbeddingBagsCodegen)

        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(n, D, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in rows],
            optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=1e-8, pooling_mode=PoolingMode.SUM)
        offsets = torch.arange(0, len(rows) * B + 1)
        grad2 = grad.reshape(B, -1)
        rates["fbgemm"] = measure(lambda i: tbe(sfs[i % len(sfs)].values(), offsets).backward(grad2),
                                  iters, runs).rate(B)
        del tbe
        gc.collect()
    r = lambda a, b: f"{rates[a] / rates[b]:.2f}x" if a in rates and b in rates else "-"
    if "dynamic (fresh)" in rates:
        print(f"# dynamic tables in early training (first {3 + iters * runs} batches, nearly every id new): "
              f"{fmt_rate(rates['dynamic (fresh)'])} samples/s; below: after {warm} batches (steady state)")
    print_table(["case", "dynamic", "static", "FBGEMM TBE", "dynamic/static (target >= 0.8)",
                 "static/FBGEMM (target >= 1.2)", "dynamic/FBGEMM"],
                [[f"d{D} P1 b{B}"] + [f"{fmt_rate(rates[k])}/s" if k in rates else "-" for k in
                                      ("dynamic", "static", "fbgemm")]
                 + [r("dynamic", "static"), r("static", "fbgemm"), r("dynamic", "fbgemm")]])


PARTS = {"store": bench_store, "step": bench_step}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=[*PARTS, "all"], default="all", help="which benchmark to run")
    p.add_argument("--quick", action="store_true", help="small sizes for a ~20 s smoke run")
    p.add_argument("--keys", type=int, default=50_000_000, help="keys pre-filled in the table")
    p.add_argument("--batch", type=int, default=200_000, help="unique keys per batch")
    p.add_argument("--new-frac", type=float, default=0.1, help="fraction of never-seen keys per batch")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the key popularity")
    p.add_argument("--runs", type=int, default=7, help="timed runs (the median is reported)")
    p.add_argument("--dim", type=int, default=16, help="embedding width of the table")
    p.add_argument("--init", choices=["uniform", "truncnormal"], default="uniform", help="initializer of new rows")
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    p.add_argument("--no-hugepages", action="store_true", help="do not madvise(MADV_HUGEPAGE) the store arrays")
    p.add_argument("--no-reference", action="store_true", help="skip the sorted-array reference")
    p.add_argument("--backends", default="native,torch", help="HashStore backends to time (comma-separated)")
    p.add_argument("--warm-batches", type=int, default=60,
                   help="step part: batches the dynamic tables train on before the steady-state timing")
    args = p.parse_args(argv)
    if args.quick:
        args.keys, args.batch, args.runs = min(args.keys, 2_000_000), min(args.batch, 100_000), min(args.runs, 5)
    for name, fn in PARTS.items():
        if args.part in (name, "all"):
            fn(args)


if __name__ == "__main__":
    main()
