"""Shared pieces of the benchmarks: the Criteo-26 workload, Zipf ids, timing, reporting.

Benchmarks compare against references measured in the same run and report medians:
this machine is noisy (the same case repeated can differ 2x), ratios are what count.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hugeembed._format import human_count

# Criteo Kaggle (display advertising challenge) cardinalities of C1..C26, as used by DLRM.
CRITEO_KAGGLE_ROWS = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]


def criteo_rows(cap: int = 10_000_000, scale: float = 1.0) -> list[int]:
    """Row counts of the 26 tables, capped (and optionally scaled down for quick runs)."""
    return [max(2, int(min(n, cap) * scale)) for n in CRITEO_KAGGLE_ROWS]


class ZipfSampler:
    """Bounded Zipf(a) ids over [0, n) with the hot ranks scattered over the table.

    Rank r (0 = hottest) maps to id (r * p) mod n for a prime p coprime to n, so hot
    rows are spread over the whole table as real hashed ids are, not packed at 0.
    """

    _PRIME = 2_654_435_761

    def __init__(self, n: int, a: float = 1.05, seed: int = 0) -> None:
        self.n = n
        ranks = np.arange(1, n + 1, dtype=np.float64)
        cdf = np.cumsum(ranks ** (-a))
        self.cdf = cdf / cdf[-1]
        self.rng = np.random.default_rng(seed)
        p = self._PRIME
        while math.gcd(p, n) != 1:
            p += 2
        self.p = p

    def sample(self, size: int) -> np.ndarray:
        r = np.searchsorted(self.cdf, self.rng.random(size), side="right")
        r = np.minimum(r, self.n - 1).astype(np.int64)
        return (r * self.p) % self.n


def criteo_batches(rows: list[int], batch: int, pooling: int, n_batches: int, a: float = 1.05, seed: int = 0):
    """`n_batches` batches of per-table id arrays [batch * pooling] (table-major)."""
    samplers = [ZipfSampler(n, a, seed + t) for t, n in enumerate(rows)]
    out = []
    for _ in range(n_batches):
        out.append([torch.from_numpy(s.sample(batch * pooling)) for s in samplers])
    return out


@dataclass
class Timing:
    median_s: float
    runs: list[float]

    def rate(self, items: float) -> float:
        return items / self.median_s


def measure(fn: Callable[[int], None], iters: int, runs: int, warmup: int = 2, seconds: float = 1.0) -> Timing:
    """Median wall time per iteration over `runs` runs of `iters` iterations; fn(i) does iteration i.

    iters <= 0: steady state, sized by time.  Warm-up calls go on until `seconds` have passed
    (at least `warmup` calls), and each run is then about `seconds` long.  The first calls
    after a process has written gigabytes of tables run up to 10x slower for a while
    (measured on this VM, whichever implementation comes first), and a run of one or two
    calls would time that, not the implementation.
    """
    return measure_together({"fn": fn}, iters, runs, warmup, seconds)["fn"]


def measure_together(fns: dict[str, Callable[[int], None]], iters: int, runs: int, warmup: int = 2,
                     seconds: float = 1.0) -> dict[str, Timing]:
    """:func:`measure` of several implementations, their runs interleaved (run r of each, in
    turn, the order reversed every other run), so that a machine that speeds up or slows down
    over the minutes of a benchmark (page compaction, other tenants) weighs on all of them
    alike instead of on whichever came first."""
    k = {name: 0 for name in fns}
    n_iters = {}
    for name, fn in fns.items():
        warm: list[float] = []
        while k[name] < warmup or (iters <= 0 and sum(warm) < seconds):
            sync()
            t0 = time.perf_counter()
            fn(k[name])
            sync()
            warm.append(time.perf_counter() - t0)
            k[name] += 1
        if iters > 0:
            n_iters[name] = iters
        else:  # from the calls of the last half of the warm-up (past its slow start)
            per_call = statistics.median(warm[len(warm) // 2 :]) if warm else 0.0
            n_iters[name] = max(1, round(seconds / per_call)) if per_call > 0 else 1
    per_iter: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(runs):
        # timed iterations see fresh batches, not the warm-up ones again (as far as the
        # caller's batches go round)
        for name in order if r % 2 == 0 else order[::-1]:
            fn = fns[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(n_iters[name]):
                fn(k[name])
                k[name] += 1
            sync()  # GPU work is asynchronous: a run ends when the device has finished it
            per_iter[name].append((time.perf_counter() - t0) / n_iters[name])
    return {name: Timing(statistics.median(t), t) for name, t in per_iter.items()}


def sync() -> None:
    """Wait for queued GPU work (a no-op where CUDA was never used)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def fbgemm_available(cuda: bool = False) -> bool:
    """FBGEMM's TBE importable (and, with `cuda`, built with CUDA: fbgemm-gpu-cpu is not)."""
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
        if cuda:
            torch.ops.fbgemm.split_embedding_codegen_lookup_sgd_function_cuda  # noqa: B018
    except Exception as e:  # any import failure means "not installed properly here"
        print(f"# fbgemm_gpu{' (CUDA)' if cuda else ''} not usable: {type(e).__name__}: {e}", file=sys.stderr)
        return False
    return True


def fmt_rate(x: float) -> str:
    return human_count(x) + ("" if x >= 1e3 else " ")


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    sys.stdout.flush()


def _gloo_rank(rank: int, run, world: int, port: int, cfg: dict, out: str) -> None:
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    torch.save(run(rank, world, cfg), os.path.join(out, f"r{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def on_gloo_ranks(run, world: int, cfg: dict) -> list:
    """``run(rank, world, cfg)`` on `world` spawned gloo ranks (a free local port); each rank's result, by rank."""
    import os
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_gloo_rank, args=(run, world, port, cfg, out), nprocs=world, join=True)
        return [torch.load(os.path.join(out, f"r{r}.pt")) for r in range(world)]
