"""Timing and bookkeeping of bench/tiered.py: a training step, per-phase clocks around the
collection's and the store's calls, runners that time cases round-robin, and the printed profile."""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict

import numpy as np
import torch

from _common import print_table
from _tiered_ids import Workload
from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection
from hugeembed.store import TieredStore
from hugeembed.store import _tier_cache  # init_rows is timed there (the fetch creates rows there)

TABLE = "big"


class Trainer:
    """One training step: forward, a fixed linear logit over the pooled [B, 26, D] with BCE, backward
    (the dense part is one matrix-vector product: the step is the embedding layer's)."""

    def __init__(self, ec: EmbeddingCollection, work: Workload, dim: int) -> None:
        self.ec = ec
        g = torch.Generator().manual_seed(1)
        self.w = torch.randn(len(work.names) * dim, generator=g) * 0.1  # the logit: pooled [B, 26 * D] @ w
        self.clock = Clock()

    def step(self, sf: SparseFeatures, labels: torch.Tensor) -> None:
        c = self.clock
        with c("forward"):
            out = self.ec(sf).stacked()
        with c("loss"):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(out.flatten(1) @ self.w, labels)
        with c("backward (grads + row-wise Adagrad)"):
            loss.backward()


# ------------------------------------------------------------------ timing

class Clock:
    """perf_counter sums per named phase, on the main thread (a background thread's calls apart)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.main = threading.get_ident()

    def __call__(self, name: str):
        return _Span(self, name)

    def wrap(self, obj, attr: str, name: str, count=None, bg_name: str | None = None) -> None:
        """Times `obj.attr` under `name`; a missing attribute (the store's internals changed) is left
        out of the profile instead of failing the benchmark."""
        fn = getattr(obj, attr, None)
        if fn is None:
            return
        clock = self

        def timed(*a, **k):
            bg = threading.get_ident() != clock.main
            key = (bg_name or name + " [prefetch thread]") if bg else name
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock.t[key] += time.perf_counter() - t0
                if count is not None:
                    clock.n[key] += count(*a, **k)

        setattr(obj, attr, timed)

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.t), dict(self.n)


class _Span:
    def __init__(self, clock: Clock, name: str) -> None:
        self.clock, self.name = clock, name

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.clock.t[self.name] += time.perf_counter() - self.t0


# The profile's rows: (indent, phase name); phases that did not run are left out.
PHASES = [
    (0, "prefetch() call"),
    (0, "forward"),
    (1, "prepare (clean + dedup)"),
    (1, "fetch: store.find_or_insert"),
    (2, "make room: key index find"),
    (2, "make room: victims + write-back"),
    (3, "write-back + cleaning: file.write_rows"),
    (3, "cleaning: file.read"),
    (3, "cleaning: file.write"),
    (2, "read misses before counting"),
    (3, "read misses: file.read_rows"),
    (3, "copy prefetched rows"),
    (2, "key index find_or_insert"),
    (2, "bring in"),
    (3, "init never-written rows"),
    (1, "pool (fused lookup)"),
    (0, "loss"),
    (0, "backward (grads + row-wise Adagrad)"),
    (0, "prefetch thread: file.read"),
]


def instrument(ec: EmbeddingCollection, clock: Clock) -> None:
    """Times the collection's and the store's calls (instance attributes shadow the methods)."""
    store = ec.store(TABLE)
    clock.wrap(ec.lookup, "prepare", "prepare (clean + dedup)")
    clock.wrap(store, "find_or_insert", "fetch: store.find_or_insert")
    clock.wrap(ec, "prefetch", "prefetch() call")
    if isinstance(store, TieredStore):
        clock.wrap(ec._slots_lookup, "lookup", "pool (fused lookup)")
        clock.wrap(store, "_make_room_for", "make room: victims + write-back")
        clock.wrap(store.index, "find", "make room: key index find")
        clock.wrap(store.file, "write_rows", "write-back + cleaning: file.write_rows",  # the cleaner's moves too
                   count=lambda rec, rows, slots: rec.numel())
        clock.wrap(store.file, "write", "cleaning: file.write", count=lambda rec, rows: rec.numel())
        clock.wrap(store.index, "find_or_insert", "key index find_or_insert")
        clock.wrap(store, "_read_before_counting", "read misses before counting")
        clock.wrap(store, "_bring_in", "bring in")
        clock.wrap(store.file, "read_rows", "read misses: file.read_rows", count=lambda rec, rows, slots: rec.numel())
        # file.read: the cleaner's segments on the main thread, prefetch's reads ahead on its thread
        clock.wrap(store.file, "read", "cleaning: file.read", count=lambda rec, out: rec.numel(),
                   bg_name="prefetch thread: file.read")
        clock.wrap(store, "_take_staged", "copy prefetched rows")
    else:
        clock.wrap(ec.lookup, "lookup", "pool (fused lookup)")


_CURRENT: list[Clock] = []  # the clock of the runner whose step is running (init_rows is a module function)


class time_init_rows:
    """Within it, hugeembed.store._tier_cache.init_rows (rows a fetch creates from the initializer:
    never written to the tier) is timed and counted on the running step's clock."""

    def __enter__(self):
        self.orig = orig = getattr(_tier_cache, "init_rows", None)
        if orig is None:  # moved: the profile goes without that row
            return self

        def timed(storage, slots, keys, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig(storage, slots, keys, *a, **k)
            finally:
                if _CURRENT:
                    _CURRENT[0].t["init never-written rows"] += time.perf_counter() - t0
                    _CURRENT[0].n["init never-written rows"] += keys.numel()

        _tier_cache.init_rows = timed
        return self

    def __exit__(self, *exc):
        if self.orig is not None:
            _tier_cache.init_rows = self.orig


def tier_stats(ec: EmbeddingCollection) -> dict:
    store = ec.store(TABLE)
    return store.cache_stats() if isinstance(store, TieredStore) else {}


class Runner:
    """One collection under training: its trainer, its cursor over the workload's batches, and what
    its timed steps measured, per prefetch mode.  Batch generation is never timed (the loader's job)."""

    def __init__(self, label: str, ec: EmbeddingCollection, work: Workload, dim: int, first: int = 0,
                 modes=(False,)) -> None:
        self.label, self.ec, self.work, self.modes = label, ec, work, tuple(modes)
        self.trainer = Trainer(ec, work, dim)
        instrument(ec, self.trainer.clock)
        self.i = first
        self.nxt = work.batch(first)
        self._empty = work.empty()
        self.warm_hit_rates: list[float] = []
        self.res = {m: {"runs": [], "cpu": [], "t": [], "n": defaultdict(int), "stats": defaultdict(float),
                        "ranks": [], "steps": 0} for m in self.modes}

    def _one(self, prefetch: bool) -> tuple[float, np.ndarray]:
        cur = self.nxt
        self.nxt = self.work.batch(self.i + 1)
        _CURRENT[:] = [self.trainer.clock]
        t0 = time.perf_counter()
        if prefetch:  # batch t+1's disk-only rows start reading before step t (as documented)
            self.ec.prefetch(self.nxt[0])
        self.trainer.step(cur[0], cur[1])
        dt = time.perf_counter() - t0
        _CURRENT.clear()
        self.i += 1
        return dt, cur[2]

    def warm(self, steps: int, windows: int = 6) -> None:
        """Untimed steps (prefetch on if any mode uses it); the hit rate of each of `windows` windows."""
        every = max(1, steps // windows)
        s0 = tier_stats(self.ec)
        for w in range(steps):
            self._one(any(self.modes))
            if s0 and (w + 1) % every == 0:
                s1 = tier_stats(self.ec)
                acc = s1["accesses"] - s0["accesses"]
                self.warm_hit_rates.append((s1["hits"] - s0["hits"]) / acc if acc else 0.0)
                s0 = s1

    def timed(self, mode: bool, iters: int) -> None:
        """`iters` timed steps in prefetch `mode`, recorded as one run."""
        r, clock, ec = self.res[mode], self.trainer.clock, self.ec
        if mode:  # the batch about to run was read ahead during the step before, as in steady state
            ec.prefetch(self.nxt[0])
        else:  # drop the reads ahead left by the other mode (they would serve this run's first step);
            # the store keeps the newest read ahead past a prefetch of nothing: join them all (private)
            ec.prefetch(self._empty)
            getattr(ec.store(TABLE), "_join_staged", lambda: None)()
        t_before, n_before = clock.snapshot()
        st_before = tier_stats(ec)
        total = 0.0
        cpu0 = time.process_time()  # every thread of the process (the OpenMP workers' spinning too)
        for _ in range(iters):
            dt, ranks = self._one(mode)
            total += dt
            r["ranks"].append(ranks)
        r["cpu"].append((time.process_time() - cpu0) / iters)
        t_after, n_after = clock.snapshot()
        st_after = tier_stats(ec)
        r["runs"].append(total / iters)
        r["steps"] += iters
        r["t"].append({k: (v - t_before.get(k, 0.0)) / iters for k, v in t_after.items()})
        for k, v in n_after.items():
            r["n"][k] += v - n_before.get(k, 0)
        for k in ("accesses", "hits", "rows_read", "rows_written", "rows_prefetched"):
            if k in st_after:
                r["stats"][k] += st_after[k] - st_before[k]


def round_robin(runners: list[Runner], runs: int, iters: int) -> None:
    """`runs` rounds; each round times `iters` steps of every runner in each of its modes, so that
    load from other processes on this shared machine falls on every case alike."""
    for _ in range(runs):
        for rn in runners:
            for m in rn.modes:
                rn.timed(m, iters)


def summarize(r: dict, batch: int, record_bytes: int) -> dict:
    steps = r["steps"]
    med = statistics.median(r["runs"])
    st = r["stats"]
    keys = [k for k in set().union(*r["t"]) if any(t.get(k) for t in r["t"])]
    mean = sum(r["runs"]) / len(r["runs"])  # runs of equal length: every timed step counts once
    out = {"step_s": med, "steps_per_s": 1.0 / med, "samples_per_s": batch / med, "mean_step_s": mean,
           "runs": r["runs"], "cpu_step_s": statistics.median(r["cpu"]) if r.get("cpu") else float("nan"),
           "profile": {k: statistics.median(t.get(k, 0.0) for t in r["t"]) for k in keys},
           "profile_mean": {k: sum(t.get(k, 0.0) for t in r["t"]) / len(r["t"]) for k in keys}}
    if st.get("accesses"):
        out["hit_rate"] = st["hits"] / st["accesses"]
        read_main = r["n"].get("read misses: file.read_rows", 0)
        read_bg = r["n"].get("prefetch thread: file.read", 0)
        out["rows_read_fetch"] = read_main / steps
        out["rows_read_ahead"] = read_bg / steps
        out["rows_prefetched_used"] = st["rows_prefetched"] / steps
        out["rows_init"] = r["n"].get("init never-written rows", 0) / steps
        out["rows_written"] = st["rows_written"] / steps
        out["mb_read"] = (read_main + read_bg) * record_bytes / steps / 1e6
        out["mb_written"] = st["rows_written"] * record_bytes / steps / 1e6
        out["misses"] = (st["accesses"] - st["hits"]) / steps
    return out


def static_hit_rate(ranks: list[np.ndarray], hottest: int) -> float:
    """Hit rate of a static cache holding the `hottest` ranks, over these batches' id occurrences."""
    hits = sum(int((r < hottest).sum()) for r in ranks)
    return hits / sum(r.size for r in ranks)


def print_profile(title: str, profiles: dict[str, dict]) -> None:
    """profiles: column name -> phase -> seconds per step."""
    cols = list(profiles)
    rows = []
    for indent, name in PHASES:
        if not any(name in p for p in profiles.values()):
            continue
        rows.append(["  " * indent + name] + [f"{profiles[c][name] * 1e3:.2f}" if name in profiles[c] else "-"
                                              for c in cols])
    step = ["step (timed wall)"] + [f"{profiles[c]['_step'] * 1e3:.2f}" for c in cols]
    print(f"# where the time goes, ms per step: {title}")
    print_table(["phase"] + cols, rows + [step])
    print()


def rss_now() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes from /proc/self/status."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got.get("VmRSS", 0), got.get("VmHWM", 0)


def mib(x: float) -> str:
    return f"{x / (1 << 20):,.0f} MiB"
