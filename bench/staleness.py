"""Bounded staleness over gloo: samples/s and held-out quality of `hugeembed train --nproc N --staleness K`.

Each configuration is a whole CLI run (synthetic Criteo-like data, DLRM, default flags) on N
processes; configurations are interleaved run by run and the medians reported.  Stragglers are
simulated with --jitter P:F (with probability P a step sleeps F-1 times its compute: the cores
stay free).  samples/s counts the training steps and the pipeline's drains, not evaluation.

    python bench/staleness.py          # 2 ranks; jitter 0.2:3: sync vs K=4 with D=0,2,4; no jitter: sync vs K=1
    python bench/staleness.py --nproc 4 --cases 0,0:0.2:3 4,4:0.2:3 --runs 3
    python bench/staleness.py --cases 4,4:0.2:3 4,4,plain:0.2:3    # staleness-aware steps vs plain
    python bench/staleness.py --cases 0,0 4,1,dc=1e6 --steps 1500   # delay-compensated row gradients
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(nproc: int, k: int, d: int, jitter: str | None, args, options: tuple = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, "-m", "hugeembed", "train", "--nproc", str(nproc), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--staleness", str(k), "--dense-staleness", str(d), "--synthetic-rows", str(args.rows), "--eval-rows",
               str(args.eval_rows), "--eval-every", str(args.steps), "--threads", "1", "--quiet", "--summary-json",
               str(out), "--dist-timeout", "120"]
        if jitter:
            cmd += ["--jitter", jitter]
        for opt in options:
            if opt == "plain":
                cmd.append("--no-stale-scale")
            else:  # dc=LAMBDA
                cmd += ["--stale-compensation", opt.partition("=")[2]]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=["0,0:0.2:3", "4,0:0.2:3", "4,2:0.2:3", "4,4:0.2:3", "0,0", "1,0"],
                   help="K,D or K,D:P:F (table staleness, dense staleness, jitter), then options after K,D: "
                   "plain (--no-stale-scale: the unscaled steps), dc=LAMBDA (--stale-compensation LAMBDA)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256, help="per process")
    p.add_argument("--rows", type=int, default=200_000, help="synthetic rows")
    p.add_argument("--eval-rows", type=int, default=8000)
    args = p.parse_args()
    cases = []
    for c in args.cases:
        kd, _, jitter = c.partition(":")
        k, d, *rest = kd.split(",") if "," in kd else (kd, "0")
        if any(o != "plain" and not o.startswith("dc=") for o in rest):
            p.error(f"case {c!r}: K,D[,plain][,dc=LAMBDA][:P:F]")
        cases.append((c, int(k), int(d or 0), jitter or None, tuple(rest)))
    got: dict[str, list[dict]] = {c[0]: [] for c in cases}
    for _ in range(args.runs):  # interleaved: each round runs every case once
        for name, k, d, jitter, options in cases:
            got[name].append(run(args.nproc, k, d, jitter, args, options))
    print(f"# {args.nproc} gloo ranks, {args.steps} steps of {args.batch_size} per rank, medians of {args.runs} runs")
    print(f"{'case (K,D[:P:F])':16s} {'samples/s':>10s} {'vs K=0':>7s} {'AUC':>8s} {'log loss':>9s}")
    base = {}
    for name, k, d, jitter, _ in cases:
        rate = statistics.median(r["samples_per_s"] for r in got[name])
        if k == d == 0:
            base[jitter] = rate
        ref = base.get(jitter)
        auc = statistics.median(r["auc"] for r in got[name])
        ll = statistics.median(r["logloss"] for r in got[name])
        print(f"{name:16s} {rate:10.0f} {rate / ref if ref else float('nan'):7.2f} {auc:8.4f} {ll:9.4f}")


if __name__ == "__main__":
    main()
