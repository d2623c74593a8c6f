"""Disk-tiered tables (TieredStore, issue 11): training through a memory cache over a file of rows.

Workload: one static table read by all 26 features of a Criteo-like batch (4096 samples, one id
per feature each; 26 tables would give 26 caches of 1/8 each and one more Zipf per table: one
shared table is the simpler and harder case, every id competing for one cache).  Ids: ranks drawn
from Zipf(1.05) over the table's rows (bounded, exact: rejection-inversion, no CDF array), mapped
rank -> id through a fixed pseudo-random permutation (a Feistel network, no table either), so hot
ids are spread over the table.  Row-wise Adagrad fused in backward; the loss is a fixed linear
logit over the pooled embeddings with BCE, so a step is forward + loss + backward (= the optimizer)
as training sees it.  Batches are generated outside the timed region; every case reads the same
batches (batch i is a function of the seed and i).

Case 1 (default), per dim (d64, d128; the table ~1.5 GiB in memory):
  in-memory   the table in RAM (no storage_dir)
  tiered      storage_dir under --storage-root, memory_budget = 1/8 of the table's row bytes,
              cache_policy lfu and lru, with and without ``collection.prefetch(next batch)``
              (interleaved runs on the same store)
  rocksdb     the same TieredStore (same cache) with its RowFile swapped for RocksRowFile
              (rocksdict: multi-get reads, WriteBatch writes, WAL off), rows keyed by their
              logical slot (InPlaceSpace: RocksDB compacts by itself, so no segments, no cleaner);
              timed in a second phase beside the in-memory table again, after ours are closed
              (RocksDB's background compactions would otherwise run during our timed steps)
  Before training, every row is written to the tier (--prefill, default on): a table trained for
  a while has all its rows on disk, so a miss is a read, not a first-touch initialisation.
  Reported after --warmup steps: steps/s, samples/s, ratio to in-memory (target >= 0.6x), the
  cache hit rate (target >= 88%) beside a static cache of the hottest keys on the same batches,
  rows and bytes read / written per step, ratio to RocksDB (target >= 2x), and where the time of
  a step goes (perf_counter around the collection's and the store's calls).

Case 2 (--scale, only it): a table larger than this machine's memory (--scale-rows, default 90 M
  rows of d128 + row-wise Adagrad = 516 B each, 46 GB), memory_budget --scale-budget-gib (6 GiB),
  static (see --help of --scale-dynamic): peak RSS (ru_maxrss, VmHWM) against budget + key index
  + 1 GiB, the step rate against case 1's in-memory d128 rate (measured afterwards in the same
  process, target >= 0.5x), the key index's bytes per row.  The storage dir is deleted at the end.

    python bench/tiered.py                         # case 1, d64 and d128
    python bench/tiered.py --quick                 # seconds: tiny table, parity of the tiers checked
    python bench/tiered.py --scale                 # case 2 (90 M rows: needs ~50 GB of disk)
    python bench/tiered.py --scale --scale-rows 20000000
"""

from __future__ import annotations

import argparse
from collections import defaultdict
import gc
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_rate, print_table  # noqa: E402
from _tiered_ids import IdPermutation, Workload, ZipfRanks  # noqa: E402,F401  (the tests use them from here)
from _tiered_run import (TABLE, Runner, Trainer, mib, print_profile, round_robin, rss_now,  # noqa: E402
                         static_hit_rate, summarize, tier_stats, time_init_rows)

from hugeembed._native import tune_malloc  # noqa: E402
from hugeembed.errors import StoreError  # noqa: E402
from hugeembed.nn import EmbeddingCollection, TableConfig  # noqa: E402
from hugeembed.optim import RowWiseAdagrad  # noqa: E402
from hugeembed.store import SLOT_METADATA_BYTES, StoreExport, TieredStore  # noqa: E402
from hugeembed.store._tier_space import RecordSpace  # noqa: E402

LR = 0.01
GiB = 1 << 30


# ------------------------------------------------------------------ the RocksDB tier

class RocksRowFile:
    """RowFile's interface (store/_tier_file.py) over RocksDB through rocksdict: key = record
    number (int), value = the row's bytes.  Reads are one multi-get (``db[list_of_keys]``), writes
    one WriteBatch; default options, the WAL disabled (the tier is scratch, as our file is)."""

    def __init__(self, path, record_bytes: int, table: str) -> None:
        from rocksdict import Options, Rdict, WriteOptions

        self.path, self.record_bytes, self.table = Path(path), int(record_bytes), table
        opt = Options()
        opt.create_if_missing(True)
        self.db = Rdict(str(self.path), opt)
        wo = WriteOptions()
        wo.disable_wal = True
        self.db.set_write_options(wo)
        self._closed = False

    def read(self, records: torch.Tensor, out: torch.Tensor) -> None:
        if records.numel() == 0:
            return
        vals = self.db[records.tolist()]
        if any(v is None for v in vals):
            r = records.tolist()[[v is None for v in vals].index(True)]
            raise StoreError(f"table '{self.table}': record {r} is not in {self.path}")
        out.view(torch.uint8).reshape(-1).numpy()[:] = np.frombuffer(b"".join(vals), dtype=np.uint8)

    def read_rows(self, records: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        buf = torch.empty((records.numel(), *rows.shape[1:]), dtype=rows.dtype)
        self.read(records, buf)
        rows.index_copy_(0, slots, buf)

    def write_rows(self, records: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self.write(records, rows.index_select(0, slots))

    def write(self, records: torch.Tensor, rows: torch.Tensor) -> None:
        from rocksdict import WriteBatch

        if records.numel() == 0:
            return
        data, b = rows.contiguous().view(torch.uint8).numpy().tobytes(), self.record_bytes
        wb = WriteBatch()
        for i, r in enumerate(records.tolist()):
            wb.put(r, data[i * b : (i + 1) * b])
        self.db.write(wb)

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        from rocksdict import Rdict

        self.db.close()
        Rdict.destroy(str(self.path))
        shutil.rmtree(self.path, ignore_errors=True)


class InPlaceSpace(RecordSpace):
    """RecordSpace's interface with record = logical slot: RocksDB keys a row by its record number and
    compacts by itself, so the RocksDB tier gets neither our segments nor our cleaner."""

    def to_clean(self, n: int) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int64)

    def plan(self, logical: torch.Tensor, stream: int = 0) -> SimpleNamespace:
        return SimpleNamespace(records=logical.to(torch.int64).clone())

    def commit(self, plan, logical: torch.Tensor) -> None:
        self.n_live += int((self.rec[logical] < 0).sum())
        self.rec[logical] = logical.to(torch.int32)

    def release(self, logical: torch.Tensor) -> None:
        had = self.rec[logical] >= 0
        self.n_live -= int(had.sum())
        self.rec[logical[had]] = -1


def rocksdict_available() -> bool:
    try:
        import rocksdict  # noqa: F401
    except Exception as e:  # any import failure: the baseline is skipped
        print(f"# rocksdict not importable ({type(e).__name__}: {e}): the RocksDB baseline is skipped")
        return False
    return True


# ------------------------------------------------------------------ the collection

def make_collection(work: Workload, dim: int, storage_dir: str | None = None, budget: int | None = None,
                    policy: str = "lfu", rocks: bool = False, dynamic: bool = False) -> EmbeddingCollection:
    cfg = TableConfig(TABLE, dim=dim, num_rows=None if dynamic else work.rows, features=work.names,
                      combiner="sum", optimizer=RowWiseAdagrad(lr=LR), storage_dir=storage_dir,
                      memory_budget=budget, cache_policy=policy)
    ec = EmbeddingCollection([cfg], seed=0)
    if rocks:
        store = ec.store(TABLE)
        old = store.file
        store.file = RocksRowFile(old.path.with_name(old.path.stem + ".rocksdb"), old.record_bytes, old.table)
        old.close()
        store._space = InPlaceSpace(old.record_bytes, old.table)
    return ec


def prefill(ec: EmbeddingCollection, chunk: int = 1 << 18) -> float:
    """Writes every row (its initial value) to the tier: as after a long run, a miss is a disk read.
    Public calls only: read_logical gives a never-written row's initial value, import_ writes it."""
    store = ec.store(TABLE)
    n = store.index.num_rows
    e = torch.zeros(0, dtype=torch.int64)
    t0 = time.perf_counter()
    for a in range(0, n, chunk):
        keys = torch.arange(a, min(n, a + chunk), dtype=torch.int64)
        rows = store.read_logical(keys)
        z = torch.zeros_like(keys)
        store.import_(StoreExport(keys, rows, z, z.clone(), e, e.clone(), e.clone()))
    return time.perf_counter() - t0


# ------------------------------------------------------------------ case 1

def case1(args, dim: int, rows: int, root: Path) -> list[list[str]]:
    """Every case of one dim built side by side (the in-memory table and one tier per case), warmed
    up one after the other, then timed round-robin."""
    work = Workload(rows, args.batch, args.features, args.alpha, args.seed)
    rb = (dim + 1) * 4
    table_bytes = rows * rb
    budget = int(table_bytes * args.budget_fraction)
    modes = (False, True) if args.prefetch == "both" else ((args.prefetch == "on"),)
    W = args.warmup
    print(f"## d{dim}: {rows:,} rows x {rb} B (d{dim} fp32 + 1 accumulator) = {mib(table_bytes)} in memory; "
          f"memory_budget {args.budget_fraction:g} of it = {mib(budget)}; batch {args.batch} x {args.features} "
          f"features, Zipf({args.alpha}); prefill {args.prefill}; warm-up {W} steps, then {args.runs} rounds x "
          f"{args.iters} steps per case and mode, round-robin; load average {os.getloadavg()[0]:.2f}")
    # Two phases, each timing the in-memory table round-robin with its cases: ours, then RocksDB (its
    # background compactions would otherwise run during our cases' timed steps).
    phases = [[(f"tiered {p}", p, False) for p in args.policies]]
    if args.rocksdb and rocksdict_available():
        phases.append([(f"rocksdb {p}", p, True) for p in args.policies[:1]])
    info: dict[str, dict] = {}
    results: dict[str, dict] = {}
    mem_of: dict[str, str] = {}  # case -> the in-memory result of its phase
    mem_warm = min(W, 10)  # nothing to fill: a short warm-up, then the same batches as the others
    mem = Runner("in-memory", make_collection(work, dim), work, dim, first=W - mem_warm, modes=(False,))
    mem.warm(mem_warm)
    for ph, cases in enumerate(phases):
        runners, dirs = [], []
        mem_key = "in-memory" if ph == 0 else f"in-memory (phase {ph + 1})"
        mem.res[False] = {"runs": [], "cpu": [], "t": [], "n": defaultdict(int), "stats": defaultdict(float), "ranks": [],
                          "steps": 0}
        try:
            for label, policy, rocks in cases:
                d = tempfile.mkdtemp(prefix="tiered-", dir=root)
                dirs.append(d)
                ec = make_collection(work, dim, d, budget, policy, rocks=rocks)
                t0 = time.perf_counter()
                t_fill = prefill(ec) if args.prefill else 0.0
                rn = Runner(label, ec, work, dim, modes=modes)
                rn.warm(W)
                info[label] = {"prefill_s": t_fill, "warm_s": time.perf_counter() - t0 - t_fill}
                runners.append(rn)
            # the in-memory case times as many steps per round as a tiered store does over its modes
            mem_iters = args.iters * len(modes)
            for _ in range(args.runs):
                mem.timed(False, mem_iters)
                for rn in runners:
                    for m in rn.modes:
                        rn.timed(m, args.iters)
            results[mem_key] = summarize(mem.res[False], args.batch, rb)
            if ph == 0:
                ranks = mem.res[False]["ranks"]
            for rn in runners:
                store = rn.ec.store(TABLE)
                for m in rn.modes:
                    name = f"{rn.label}{' +prefetch' if m else ''}"
                    results[name] = summarize(rn.res[m], args.batch, rb)
                    mem_of[name] = mem_key
                mb = store.memory_breakdown()
                info[rn.label].update(capacity_rows=store.capacity_rows, disk=store.file.disk_bytes(),
                                      warm=rn.warm_hit_rates, index=mb["index"], tier_map=mb["tier_map"],
                                      cache=mb["resident_rows"] + mb["cache_metadata"],
                                      relocated=store.cache_stats()["rows_relocated"] / max(1, store.stats["rows_written"]))
        finally:
            for rn in runners:
                rn.ec.store(TABLE).close()
            runners.clear()
            gc.collect()
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)
    del mem
    gc.collect()

    cap = next(iter(info.values()))["capacity_rows"] if info else int(budget // (rb + SLOT_METADATA_BYTES))
    for label, i in info.items():
        print(f"# {label}: cache {i['capacity_rows']:,} rows ({mib(i['cache'])} with metadata), key index "
              f"{mib(i['index'])} + tier map {mib(i['tier_map'])} ({(i['index'] + i['tier_map']) / rows:.1f} B/row), "
              f"tier on disk {mib(i['disk'])}, rows moved by the cleaner per row written back "
              f"{i['relocated']:.2f}; prefill {i['prefill_s']:.1f} s, warm-up {i['warm_s']:.0f} s, its hit "
              f"rate by {max(1, W // 6)}-step windows: {' '.join(f'{h:.1%}' for h in i['warm'])}")
    # reference: static caches of the hottest keys, on the measured batches
    s_eighth = static_hit_rate(ranks, rows // 8)
    s_cap = static_hit_rate(ranks, cap)
    print(f"# static cache of the hottest keys on the measured batches: 1/8 of the keys ({rows // 8:,}): "
          f"{s_eighth:.1%}; as many as the LRU/LFU cache holds ({cap:,}): {s_cap:.1%}; load average now "
          f"{os.getloadavg()[0]:.2f}")
    def vs_mem(name: str) -> float:  # the step rate over the in-memory one timed in the same phase
        return results[name]["steps_per_s"] / results[mem_of.get(name, name)]["steps_per_s"]

    out = []
    for name, s in results.items():
        ratio = vs_mem(name)
        rocks_key = next((k for k in results if k.startswith("rocksdb") and k.endswith("+prefetch") ==
                          name.endswith("+prefetch")), None)
        # ours / RocksDB: each normalised by its own phase's in-memory rate (the phases ran apart)
        vs_rocks = (f"{vs_mem(name) / vs_mem(rocks_key):.2f}x"
                    + (" ok" if vs_mem(name) >= 2 * vs_mem(rocks_key) else " <2")
                    if rocks_key and name.startswith("tiered") else "-")
        f = lambda k, fmt: format(s[k], fmt) if k in s else "-"  # noqa: E731
        out.append([f"d{dim}", name, f"{s['steps_per_s']:.2f}", f"{fmt_rate(s['samples_per_s'])}/s",
                    f"{ratio:.2f}x" + ("" if name.startswith("in-memory") else (" ok" if ratio >= 0.6 else " <0.6")),
                    vs_rocks, f"{s['hit_rate']:.1%}" + (" ok" if s["hit_rate"] >= 0.88 else " <88%")
                    if "hit_rate" in s else "-",
                    f("misses", ",.0f"), f("rows_read_fetch", ",.0f"), f("rows_read_ahead", ",.0f"),
                    f("rows_prefetched_used", ",.0f"), f("rows_init", ",.0f"), f("rows_written", ",.0f"),
                    f("mb_read", ".2f"), f("mb_written", ".2f"), " ".join(f"{x * 1e3:.0f}" for x in s["runs"]),
                    f"{s['cpu_step_s'] * 1e3:.0f}, {results[mem_of.get(name, name)]['cpu_step_s'] / s['cpu_step_s']:.2f}x",
                    f"{os.getloadavg()[0]:.1f}"])
    profiles = {}
    for name, s in results.items():
        p = dict(s["profile"])
        p["_step"] = s["step_s"]
        profiles[name] = p
    print_profile(f"d{dim} (medians over the runs of each phase's mean per step)", profiles)
    return out


CASE1_HEADER = ["dim", "case", "steps/s", "samples/s", "vs in-mem (>=0.6x)", "ours/rocksdb (>=2x)",
                "hit rate (>=88%)", "misses/step", "rows read/step: fetch", "read ahead", "served by read-ahead",
                "rows init/step", "rows written/step", "MB read/step", "MB written/step", "ms per step, each run",
                "CPU ms/step, vs in-mem", "load avg"]


# ------------------------------------------------------------------ case 2

def case2(args, root: Path) -> None:
    dim, rows = args.scale_dim, args.scale_rows
    rb = (dim + 1) * 4
    budget = int(args.scale_budget_gib * GiB)
    work = Workload(rows, args.batch, args.features, args.alpha, args.seed)
    kind = "dynamic" if args.scale_dynamic else "static"
    rss0, _ = rss_now()
    print(f"## case 2: {rows:,} rows x {rb} B = {rows * rb / 1e9:.1f} GB of rows ({rows * rb / GiB:.1f} GiB), "
          f"{kind} table, memory_budget {args.scale_budget_gib:g} GiB, machine memory "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.1f} GiB; RSS before the table "
          f"{mib(rss0)}")
    d = tempfile.mkdtemp(prefix="tiered-scale-", dir=root)
    try:
        t0 = time.perf_counter()
        ec = make_collection(work, dim, d, budget, args.scale_policy, dynamic=args.scale_dynamic)
        store = ec.store(TABLE)
        t_build = time.perf_counter() - t0
        rss_built, _ = rss_now()
        t_fill = prefill(ec) if args.scale_prefill and not args.scale_dynamic else 0.0
        W = args.scale_warmup
        t0 = time.perf_counter()
        rn = Runner("case 2", ec, work, dim, modes=(True,))
        rn.warm(W, windows=10)
        round_robin([rn], args.runs, args.scale_iters)
        t_train = time.perf_counter() - t0
        s = summarize(rn.res[True], args.batch, rb)
        mb = store.memory_breakdown()
        st = store.cache_stats()
        disk = store.file.disk_bytes()
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        rss, hwm = rss_now()
        limit = budget + mb["index"] + GiB
        limit_map = limit + mb["tier_map"]
        print(f"# built in {t_build:.1f} s, prefill {t_fill:.1f} s, {W} warm-up + {args.runs * args.scale_iters} timed "
              f"steps in {t_train:.0f} s; cache {store.capacity_rows:,} rows, resident {st['resident_rows']:,}, "
              f"rows on disk {st['stored_rows']:,} ({disk / 1e9:.1f} GB of file), keys {len(store):,}")
        print(f"# warm-up hit rate by {max(1, W // 10)}-step windows: "
              f"{' '.join(f'{h:.1%}' for h in rn.warm_hit_rates)}; a static cache of the hottest keys on the "
              f"timed batches: 1/8 of the keys {static_hit_rate(rn.res[True]['ranks'], rows // 8):.1%}, as many "
              f"as the cache holds {static_hit_rate(rn.res[True]['ranks'], store.capacity_rows):.1%}")
        keys = len(store)
        print_table(["memory", "bytes", "per key held" if args.scale_dynamic else "per row"], [
            ["resident rows (cache)", mib(mb["resident_rows"]), f"{rb} B per cached row"],
            ["cache metadata", mib(mb["cache_metadata"]), f"{SLOT_METADATA_BYTES} B per cached row"],
            ["key index (memory_breakdown()['index'])", mib(mb["index"]), f"{mb['index'] / keys:.1f} B"],
            ["tier map", mib(mb["tier_map"]), f"{mb['tier_map'] / keys:.1f} B"],
            ["target: budget + index + 1 GiB", mib(limit), ""],
            ["  + tier map (also per row, beside the budget)", mib(limit_map), ""],
            ["peak RSS ru_maxrss", mib(maxrss), ("ok" if maxrss <= limit else "over target") + (
                "" if maxrss <= limit else (", ok with the tier map" if maxrss <= limit_map else ", over both"))],
            ["peak RSS VmHWM", mib(hwm), ("ok" if hwm <= limit else "over target") + (
                "" if hwm <= limit else (", ok with the tier map" if hwm <= limit_map else ", over both"))],
            ["RSS now (VmRSS)", mib(rss), ""],
            ["RSS before the table", mib(rss0), ""],
            ["RSS once the table was built (cache, index, tier map allocated)", mib(rss_built), ""]])
        print()
        p = {**s["profile"], "_step": s["step_s"]}
        pm = {**s["profile_mean"], "_step": s["mean_step_s"]}
        store.close()
        del ec, rn, store
        gc.collect()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"# storage dir {d} deleted")
    # case 1's in-memory rate at the same dim (after the RSS readings: it allocates its own table)
    ref_rows = args.rows or int(args.table_gib * GiB / rb) // 1000 * 1000
    ref = Workload(ref_rows, args.batch, args.features, args.alpha, args.seed)
    mem = Runner("in-memory", make_collection(ref, dim), ref, dim, first=W - 10)
    mem.warm(10)
    round_robin([mem], args.runs, args.iters)
    m = summarize(mem.res[False], args.batch, rb)
    del mem
    # The median run can miss the big evictions (every ~C/16 misses: one in several runs here); the
    # mean over every timed step is what training gets, and the ratio is taken on it.
    ratio_med = s["steps_per_s"] / m["steps_per_s"]
    ratio = m["mean_step_s"] / s["mean_step_s"]
    print_table(["case", "steps/s (median run)", "steps/s (all steps)", "samples/s (all steps)",
                 "vs case-1 in-memory (>=0.5x): median, all", "hit rate", "misses/step",
                 "rows read/step (fetch + ahead)", "rows init/step", "MB read/step", "MB written/step",
                 "ms per step, each run"], [
        [f"case 2: {rows / 1e6:.0f} M rows d{dim}, {args.scale_budget_gib:g} GiB, {args.scale_policy} +prefetch",
         f"{s['steps_per_s']:.2f}", f"{1 / s['mean_step_s']:.2f}", f"{fmt_rate(args.batch / s['mean_step_s'])}/s",
         f"{ratio_med:.2f}x, {ratio:.2f}x" + (" ok" if ratio >= 0.5 else " <0.5"), f"{s['hit_rate']:.1%}",
         f"{s['misses']:,.0f}", f"{s['rows_read_fetch']:,.0f} + {s['rows_read_ahead']:,.0f}",
         f"{s['rows_init']:,.0f}", f"{s['mb_read']:.2f}", f"{s['mb_written']:.2f}",
         " ".join(f"{x * 1e3:.0f}" for x in s["runs"])],
        [f"case 1 in-memory: {ref_rows / 1e6:.1f} M rows d{dim}", f"{m['steps_per_s']:.2f}",
         f"{1 / m['mean_step_s']:.2f}", f"{fmt_rate(args.batch / m['mean_step_s'])}/s", "1.00x", "-", "-", "-",
         "-", "-", "-", " ".join(f"{x * 1e3:.0f}" for x in m["runs"])]])
    print()
    print_profile(f"case 2 vs case-1 in-memory d{dim}: median run, and mean over all timed steps",
                  {"case 2 (median run)": p, "case 2 (mean)": pm,
                   "in-memory (median run)": {**m["profile"], "_step": m["step_s"]},
                   "in-memory (mean)": {**m["profile_mean"], "_step": m["mean_step_s"]}})


# ------------------------------------------------------------------ parity (--quick, tests)

# name -> (cache policy, RocksDB tier, every row written to the tier first)
PARITY_KINDS = {"tiered lfu": ("lfu", False, True), "tiered lru": ("lru", False, True),
                "tiered lfu (no prefill)": ("lfu", False, False), "rocksdb lfu": ("lfu", True, True)}


def parity_exports(root, kinds=tuple(PARITY_KINDS), rows: int = 30_000, dim: int = 16, batch: int = 64,
                   steps: int = 30) -> dict[str, tuple[StoreExport, int, dict]]:
    """Trains the same batches in memory and on each tier of `kinds` (budget 1/8; prefetch of the
    next batch, of the current one, or none, in turn) and returns each run's final table export,
    step and cache stats: every export must equal the in-memory one bit for bit."""
    work = Workload(rows, batch, 26, 1.05, seed=3)
    budget = rows * (dim + 1) * 4 // 8
    out = {}
    for name in ("in-memory", *kinds):
        policy, rocks, fill = PARITY_KINDS.get(name, (None, False, False))
        d = tempfile.mkdtemp(prefix="parity-", dir=root) if policy else None
        try:
            ec = make_collection(work, dim, d, budget if policy else None, policy or "lfu", rocks=rocks)
            if fill:
                prefill(ec, chunk=4096)
            tr = Trainer(ec, work, dim)
            nxt = work.batch(0)
            for i in range(steps):
                cur, nxt = nxt, work.batch(i + 1)
                if policy and i % 3 == 1:
                    ec.prefetch(nxt[0])
                elif policy and i % 3 == 2:
                    ec.prefetch(cur[0])
                tr.step(cur[0], cur[1])
            store = ec.store(TABLE)
            out[name] = (store.export(), ec.step, tier_stats(ec))
            if policy:
                store.close()
        finally:
            if d:
                shutil.rmtree(d, ignore_errors=True)
    return out


def same_export(a: StoreExport, b: StoreExport) -> bool:
    return (torch.equal(a.keys, b.keys) and a.rows.dtype == b.rows.dtype and a.rows.shape == b.rows.shape
            and torch.equal(a.rows.view(torch.int32), b.rows.view(torch.int32))
            and torch.equal(a.counts, b.counts) and torch.equal(a.last_step, b.last_step))


def check_parity(root) -> bool:
    kinds = [k for k in PARITY_KINDS if not k.startswith("rocksdb") or rocksdict_available()]
    got = parity_exports(root, kinds)
    ref, step, _ = got["in-memory"]
    ok = True
    for name, (ex, st, stats) in got.items():
        if name == "in-memory":
            continue
        same = same_export(ex, ref) and st == step
        ok &= same
        print(f"# parity: {name} vs in-memory after {st} steps: {'bit-identical' if same else 'DIFFERENT'} "
              f"(hit rate {stats['hit_rate']:.1%}, rows read {stats['rows_read']:,}, prefetched "
              f"{stats['rows_prefetched']:,}, written {stats['rows_written']:,})")
    return ok


# ------------------------------------------------------------------ main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--table-gib", type=float, default=1.5, help="case 1: the table's bytes in memory (sets rows)")
    p.add_argument("--rows", type=int, default=0, help="case 1: rows (overrides --table-gib)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--budget-fraction", type=float, default=1 / 8)
    p.add_argument("--policies", nargs="+", default=["lfu", "lru"], choices=["lfu", "lru"])
    p.add_argument("--prefetch", choices=["both", "on", "off"], default="both")
    p.add_argument("--no-rocksdb", dest="rocksdb", action="store_false", help="skip the RocksDB baseline")
    p.add_argument("--no-prefill", dest="prefill", action="store_false",
                   help="case 1: leave rows unwritten until evicted (misses of never-seen rows initialise)")
    p.add_argument("--warmup", type=int, default=300, help="steps before timing (the cache reaches steady state)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--iters", type=int, default=10, help="steps per timed run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--storage-root", default=tempfile.gettempdir(), help="where the tiers' directories go")
    p.add_argument("--scale", action="store_true", help="case 2 only: a table larger than memory")
    p.add_argument("--scale-rows", type=int, default=90_000_000)
    p.add_argument("--scale-dim", type=int, default=128)
    p.add_argument("--scale-budget-gib", type=float, default=6.0)
    p.add_argument("--scale-policy", choices=["lfu", "lru"], default="lfu")
    p.add_argument("--scale-warmup", type=int, default=1500,
                   help="steps before timing: the 6 GiB cache fills after ~900 (12 M distinct rows seen)")
    p.add_argument("--scale-iters", type=int, default=40,
                   help="steps per timed run (several evictions of C/16 rows each per run)")
    p.add_argument("--scale-prefill", action="store_true", help="write every row to the tier first")
    p.add_argument("--scale-dynamic", action="store_true",
                   help="a dynamic (hash) table instead of a static one: its key index grows with the ids seen")
    p.add_argument("--no-tune-malloc", dest="tune_malloc", action="store_false",
                   help="leave glibc's malloc as it is (tune_malloc keeps up to 1 GiB of freed heap: peak RSS)")
    p.add_argument("--quick", action="store_true", help="seconds: a tiny table, and the parity of the tiers")
    args = p.parse_args(argv)
    if args.quick:
        args.dims, args.rows, args.batch, args.warmup, args.runs, args.iters = [64], 100_000, 1024, 30, 3, 3
    torch.set_num_threads(args.threads)
    tuned = tune_malloc() if args.tune_malloc else False
    root = Path(args.storage_root)
    root.mkdir(parents=True, exist_ok=True)
    print(f"# threads {args.threads}, torch {torch.__version__}, malloc tuned: {tuned}, storage under {root} "
          f"({shutil.disk_usage(root).free / 1e9:.0f} GB free), row-wise Adagrad lr {LR}, one table read by "
          f"{args.features} features; medians of {args.runs} runs")
    with time_init_rows():
        if args.scale:
            case2(args, root)
            return 0
        rc = 0
        if args.quick:
            rc = 0 if check_parity(root) else 1
        rows_out = []
        for dim in args.dims:
            rb = (dim + 1) * 4
            rows = args.rows or int(args.table_gib * GiB / rb) // 1000 * 1000
            rows_out += case1(args, dim, rows, root)
            print_table(CASE1_HEADER, rows_out)
            print()
    return rc


if __name__ == "__main__":
    sys.exit(main())
