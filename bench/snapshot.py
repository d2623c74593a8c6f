"""Snapshot save / load: throughput and the memory they need beyond the tables.

    python bench/snapshot.py [--rows 2000000] [--dim 64] [--repeats 3] [--dir /tmp/hugeembed_bench]
    python bench/snapshot.py --quick        # ~10 s smoke run

One table with row-wise state (Adagrad: weights + accumulator, 2*dim floats per row),
static and dynamic.  Each save and load runs in a fresh process that samples its
anonymous resident memory (RssAnon, every 2 ms): the peak minus the figure before the
call is what the operation needed on top of the live tables, reported as a multiple of
the table's bytes.  Memory-mapped snapshot pages are page cache (reclaimable), not
counted.  Reference in the same run: ``torch.save`` of the table's ``state_dict`` and
``torch.load`` back, the plain-PyTorch way to checkpoint it.

Targets: saving needs no second copy of a table (extra < 0.5x); loading builds the new
table beside the live one so that a failed load changes nothing (extra ~1x, no more).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, shutil, sys, threading, time, torch
from hugeembed import checkpoint as ckpt
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adagrad

kind, op, rows, dim, root = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) * 1024

cfg = TableConfig("t", dim, num_rows=rows if kind == "static" else None, optimizer=Adagrad(lr=0.1))
ec = EmbeddingCollection([cfg])
if kind == "dynamic":
    ec.store("t").find_or_insert(torch.arange(rows, dtype=torch.int64) * 7919 - rows, 1)
table_bytes = ec.store("t").storage()[:rows].numel() * 4
peak, done = [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
base = anon()
th = threading.Thread(target=sample, daemon=True)
th.start()
t = time.perf_counter()
if op == "save":
    ckpt.save(root, ec)
elif op == "load":
    ckpt.load(root, ec)
elif op == "torch_save":
    torch.save(ec.state_dict(), root + "/state.pt")
else:
    ec.load_state_dict(torch.load(root + "/state.pt"))
dt = time.perf_counter() - t
done[0] = True
th.join()
peak[0] = max(peak[0], anon())
print(json.dumps({"seconds": dt, "table_bytes": table_bytes, "extra": (peak[0] - base) / table_bytes}))
"""


def child(kind: str, op: str, rows: int, dim: int, root: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, kind, op, str(rows), str(dim), str(root)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} {op} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/hugeembed_bench")
    p.add_argument("--quick", action="store_true", help="200k rows, 1 repeat")
    args = p.parse_args()
    if args.quick:
        args.rows, args.repeats = 200_000, 1
    base = Path(args.dir) / "snapshot"
    print(f"one table, {args.rows} rows, dim {args.dim} + Adagrad state; median of {args.repeats} "
          f"(extra = peak anonymous memory beyond the live table, x table bytes)")
    print(f"{'table':8} {'operation':12} {'MB/s':>8} {'extra':>7}   {'torch.save/load MB/s':>20} {'extra':>7}")
    for kind in ("static", "dynamic"):
        for ours, ref in (("save", "torch_save"), ("load", "torch_load")):
            got = {"ours": [], "ref": []}
            for _ in range(args.repeats):
                for which, op in (("ours", ours), ("ref", ref)):
                    root = base / kind / which
                    if op in ("save", "torch_save"):
                        shutil.rmtree(root, ignore_errors=True)
                        root.mkdir(parents=True)
                    got[which].append(child(kind, op, args.rows, args.dim, root))
            line = [f"{kind:8} {ours:12}"]
            for which in ("ours", "ref"):
                rate = statistics.median(r["table_bytes"] / r["seconds"] / 1e6 for r in got[which])
                extra = statistics.median(r["extra"] for r in got[which])
                line.append(f"{rate:8.0f} {extra:6.2f}x" if which == "ours" else f"{rate:20.0f} {extra:6.2f}x")
            print("   ".join(line), flush=True)
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
