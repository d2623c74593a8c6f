"""Peak memory of saving a snapshot of a column-wise table on 2 gloo ranks (and its time).

Workload: one static table (--rows x --dim, float32, SGD: no optimizer state), column-wise over
both ranks (each holds a block of dim/2 columns of every row), one training step, then a full
snapshot; with --delta also a delta after --touch more ids are seen; then the newest snapshot
is loaded back.  Each rank samples its resident set (/proc/self/statm) every millisecond from a
thread while it saves (loads), and reports the peak above its resident set just before (the
table's blocks are resident then).

    python bench/column_wise_snapshot.py                     # D 256, 300 k rows: a 307 MB table
    python bench/column_wise_snapshot.py --rows 30000        # quick

To compare with another hugeembed (e.g. an export of an older commit), run it with that one first
on PYTHONPATH; the line "hugeembed from ..." says which ran.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import on_gloo_ranks  # noqa: E402

PAGE = resource.getpagesize()


def rss(anonymous: bool = False) -> int:
    """Resident bytes; `anonymous`: less the file-backed pages (memory-mapped snapshot files, reclaimable)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - (int(fields[2]) if anonymous else 0)) * PAGE


class PeakRSS:
    """The largest resident set seen while the block runs (sampled every `every` seconds)."""

    def __init__(self, every: float = 0.001) -> None:
        self.every, self.peak, self.anon_peak, self._stop = every, 0, 0, threading.Event()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak, self.anon_peak = max(self.peak, rss()), max(self.anon_peak, rss(True))
            time.sleep(self.every)

    def __enter__(self):
        self.before, self.anon_before = self.peak, self.anon_peak = rss(), rss(True)
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak, self.anon_peak = max(self.peak, rss()), max(self.anon_peak, rss(True))


def run(rank: int, world: int, cfg: dict) -> dict:
    from hugeembed import checkpoint as ckpt
    from hugeembed.distributed import ShardedEmbeddingCollection, ShardingPlan
    from hugeembed.features import SparseFeatures
    from hugeembed.nn import TableConfig
    from hugeembed.optim import SGD

    torch.set_num_threads(1)
    table = TableConfig("wide", cfg["dim"], num_rows=cfg["rows"], features=("f",), optimizer=SGD(lr=0.01))
    ec = ShardedEmbeddingCollection([table], plan=ShardingPlan(world, {"wide": "column_wise"}), timeout=900)
    g = torch.Generator().manual_seed(rank)

    def step(n: int) -> None:
        ids = torch.randint(0, cfg["rows"], (n,), generator=g)
        ec(SparseFeatures(["f"], ids, offsets=torch.arange(n + 1), batch_size=n))["f"].sum().backward()

    step(1024)
    out = {}
    for what, delta in (("full", False), ("delta", True))[: 2 if cfg["delta"] else 1]:
        if delta:
            step(cfg["touch"])
        dist.barrier()
        t0 = time.perf_counter()
        with PeakRSS() as m:
            ckpt.save(cfg["root"], ec, delta=delta)
        out[what] = {"before": m.before, "peak": m.peak, "anon": m.anon_peak - m.anon_before,
                     "s": time.perf_counter() - t0}
    dist.barrier()
    t0 = time.perf_counter()
    with PeakRSS() as m:  # the newest snapshot back into the same collection (each rank keeps its block)
        ckpt.load(cfg["root"], ec, restore_rng=False)
    out["load"] = {"before": m.before, "peak": m.peak, "anon": m.anon_peak - m.anon_before,
                   "s": time.perf_counter() - t0}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rows", type=int, default=300_000)
    p.add_argument("--delta", action="store_true", help="also a delta after --touch more ids")
    p.add_argument("--touch", type=int, default=20_000)
    a = p.parse_args()
    import hugeembed

    with tempfile.TemporaryDirectory() as out:
        cfg = {"dim": a.dim, "rows": a.rows, "delta": a.delta, "touch": a.touch, "root": os.path.join(out, "ck")}
        res = on_gloo_ranks(run, 2, cfg)
    whole = a.rows * a.dim * 4
    print(f"hugeembed from {os.path.dirname(hugeembed.__file__)}")
    print(f"one static table {a.rows:,} x {a.dim} float32 (SGD): {whole / 1e6:.0f} MB whole, {whole / 2e6:.0f} MB "
          f"a block; 2 gloo ranks; {os.cpu_count()} cores (load {os.getloadavg()[0]:.1f})")
    for what in ("full", "delta")[: 2 if a.delta else 1] + ("load",):
        for r, got in enumerate(res):
            g = got[what]
            doing = "loading" if what == "load" else "saving"
            print(f"{what:<6} rank {r}: resident before {g['before'] / 1e6:7.0f} MB, peak while {doing} "
                  f"{g['peak'] / 1e6:7.0f} MB (+{(g['peak'] - g['before']) / 1e6:.0f} MB; "
                  f"not file-backed +{g['anon'] / 1e6:.0f} MB), {g['s']:.2f} s")


if __name__ == "__main__":
    sys.exit(main())
