"""Bounded staleness over gloo: samples/s and held-out quality of `hugeembed train --nproc N --staleness K`.

Each configuration is a whole CLI run (synthetic Criteo-like data, DLRM, default flags) on N
processes; configurations are interleaved run by run and the medians reported.  Stragglers are
simulated with --jitter P:F (with probability P a step sleeps F-1 times its compute: the cores
stay free).  samples/s counts the training steps and the pipeline's drains, not evaluation.

    python bench/staleness.py          # 2 ranks; jitter 0.2:3: sync vs K=4 with D=0,2,4; no jitter: sync vs K=1
    python bench/staleness.py --nproc 4 --cases 0,0:0.2:3 4,4:0.2:3 --runs 3
    python bench/staleness.py --cases 4,4:0.2:3 4,4,plain:0.2:3    # staleness-aware steps vs plain
    python bench/staleness.py --cases 0,0 4,1,dc=1e6 --steps 1500   # delay-compensated row gradients
    python bench/staleness.py --seeds 0 1 2 --cases 4,1 4,0 0,4 --steps 1500 --cache runs.json
        # quality over seeds: AUC and log loss against the same seed's synchronous run, mean and spread
        # (a run is deterministic: once per seed; --cache keeps finished runs across invocations)
    python bench/staleness.py --seeds 0 1 --cases 4,1,lr-decay=0.5 --steps 1500   # any train flag: FLAG=VALUE
    python bench/staleness.py --seeds 0 --init-seeds 0 1 2 3 --cases 4,1 --eval-rows 64000 --steps 1500
        # the noise floor: the same data, other inits (--init-seed); per case its paired deltas' mean and se
    python bench/staleness.py --seeds 0 --init-seeds 0 1 3 --cases "4,1,dp<=6000" --eval-rows 64000 --steps 1500
        # the 16 tables of at most 6000 ids data-parallel (read min(K, D) steps stale; docs/distributed.md)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(nproc: int, k: int, d: int, jitter: str | None, args, options: tuple = (), seed: int = 0,
        init_seed: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, "-m", "hugeembed", "train", "--nproc", str(nproc), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--staleness", str(k), "--dense-staleness", str(d), "--synthetic-rows", str(args.rows), "--eval-rows",
               str(args.eval_rows), "--eval-every", str(args.steps), "--threads", "1", "--quiet", "--summary-json",
               str(out), "--dist-timeout", "120"]
        if jitter:
            cmd += ["--jitter", jitter]
        cmd += ["--seed", str(seed)] + (["--init-seed", str(init_seed)] if init_seed is not None else [])
        for opt in options:
            if opt == "plain":
                cmd.append("--no-stale-scale")
            elif opt.startswith("dc="):
                cmd += ["--stale-compensation", opt.partition("=")[2]]
            elif opt.startswith("dp<="):  # replicate the tables of the features with at most N distinct ids
                cmd += [a for name in small_features(int(opt[4:])) for a in ("--shard", f"{name}=data_parallel")]
            else:  # FLAG=VALUE: any `hugeembed train` flag
                flag, _, value = opt.partition("=")
                cmd += [f"--{flag}", *(value.split("/") if value else ())]  # FLAG= : a switch
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def small_features(at_most: int) -> list[str]:
    """The synthetic Criteo features with at most `at_most` distinct ids (Criteo Kaggle's counts): the hot
    tables every batch updates (the trainer's plan replicates those of at most 2 MiB, sized by the synthetic
    cardinalities: these 16 at the defaults, dim 16 and Adam; this places them explicitly at any dim)."""
    from hugeembed.data._synthetic_config import CRITEO_KAGGLE_CARDINALITIES

    return [f"C{j + 1}" for j, n in enumerate(CRITEO_KAGGLE_CARDINALITIES) if n <= at_most]


def jitter_bound(world: int, slack: int, p: float, f: float, steps: int = 20_000, seed: int = 0) -> float:
    """The speed-up over synchronous steps that absorbing --jitter P:F stalls alone can give with `slack`
    steps of look-ahead (min(K, D): a rank starts step t once every rank finished step t-1-slack), for
    steps of equal compute and free communication (a Monte Carlo of the ranks' finishing times)."""
    def rate(s: int) -> float:
        rng = random.Random(seed)  # the same stalls for both: the ratio's Monte Carlo noise cancels
        done = [[0.0] * (steps + 1) for _ in range(world)]
        for t in range(1, steps + 1):
            gate = max(d[t - 1 - s] for d in done) if t - 1 - s >= 0 else 0.0
            for d in done:
                d[t] = max(d[t - 1], gate) + (f if rng.random() < p else 1.0)
        return steps / max(d[steps] for d in done)

    return rate(slack) / rate(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cases", nargs="+", default=["0,0:0.2:3", "4,0:0.2:3", "4,2:0.2:3", "4,4:0.2:3", "0,0", "1,0"],
                   help="K,D or K,D:P:F (table staleness, dense staleness, jitter), then options after K,D: "
                   "plain (--no-stale-scale: the unscaled steps), dc=LAMBDA (--stale-compensation LAMBDA), dp<=N (the "
                   "tables of features with at most N distinct ids data-parallel: --shard C=data_parallel), "
                   "FLAG=VALUE (--FLAG VALUE, values split at '/'; FLAG=: the switch --FLAG)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256, help="per process")
    p.add_argument("--rows", type=int, default=200_000, help="synthetic rows")
    p.add_argument("--eval-rows", type=int, default=8000)
    p.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                   help="quality over seeds instead: each case once per seed (runs are deterministic), AUC and log "
                   "loss against the synchronous run of the same seed and options; mean and spread over the seeds")
    p.add_argument("--init-seeds", type=int, nargs="+", metavar="SEED",
                   help="with --seeds: each case and its synchronous run once per (seed, init seed) (--init-seed: the "
                   "same data, another init and trajectory); also the noise floor: the synchronous runs' AUC spread "
                   "over init seeds")
    p.add_argument("--cache", type=Path, help="with --seeds: a JSON file of finished runs, read and extended "
                   "(a deterministic run is not repeated)")
    args = p.parse_args()
    cases = []
    for c in args.cases:
        kd, _, jitter = c.partition(":")
        k, d, *rest = kd.split(",") if "," in kd else (kd, "0")
        if any(o != "plain" and "=" not in o for o in rest):
            p.error(f"case {c!r}: K,D[,plain][,dc=LAMBDA][,dp<=N][,FLAG=VALUE][:P:F]")
        cases.append((c, int(k), int(d or 0), jitter or None, tuple(rest)))
    if args.seeds:
        quality(cases, args)
        return
    got: dict[str, list[dict]] = {c[0]: [] for c in cases}
    for _ in range(args.runs):  # interleaved: each round runs every case once
        for name, k, d, jitter, options in cases:
            got[name].append(run(args.nproc, k, d, jitter, args, options))
    print(f"# {args.nproc} gloo ranks, {args.steps} steps of {args.batch_size} per rank, medians of {args.runs} runs")
    print(f"{'case (K,D[:P:F])':16s} {'samples/s':>10s} {'vs K=0':>7s} {'bound':>6s} {'AUC':>8s} {'log loss':>9s}   "
          "rank 0's ms per step: training, of it slept (jitter), waited for rows, for dense grads")
    print("(bound: what absorbing the jitter's stalls alone can give at slack min(K, D), communication free)")
    base = {}
    for name, k, d, jitter, _ in cases:
        rate = statistics.median(r["samples_per_s"] for r in got[name])
        if k == d == 0:
            base[jitter] = rate
        ref = base.get(jitter)
        auc = statistics.median(r["auc"] for r in got[name])
        ll = statistics.median(r["logloss"] for r in got[name])
        ms = [statistics.median(1e3 * r.get(key, float("nan")) / r["steps"] for r in got[name])
              for key in ("train_seconds", "jitter_sleep_s", "wait_rows_s", "wait_dense_s")]
        bound = jitter_bound(args.nproc, min(k, d), *map(float, jitter.split(":"))) if jitter else float("nan")
        print(f"{name:16s} {rate:10.0f} {rate / ref if ref else float('nan'):7.2f} {bound:6.2f} {auc:8.4f} {ll:9.4f}   "
              + " ".join(f"{x:6.1f}" for x in ms))


def quality(cases, args) -> None:
    """Each case once per seed (and init seed), without jitter (it changes the timing only); deltas against
    the synchronous run with the same seeds and the same options (those that act at K = 0)."""
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    stale_only = ("plain", "dc=", "stale-", "no-stale-", "dense-stale")  # options that change nothing at K = D = 0
    sync_only = lambda opts: tuple(o for o in opts if not o.startswith(stale_only))  # noqa: E731
    inits = args.init_seeds or [None]

    def result(k, d, options, seed, init):
        key = json.dumps([args.nproc, args.steps, args.batch_size, args.rows, args.eval_rows, k, d, list(options), seed]
                         + ([] if init is None else [init]))
        if key not in cache:
            r = run(args.nproc, k, d, None, args, options, seed, init)
            cache[key] = {"auc": r["auc"], "logloss": r["logloss"]}
            if args.cache:
                args.cache.write_text(json.dumps(cache, indent=0))
            print(f"  ran K={k} D={d} {','.join(options) or '-'} seed {seed} init {init}: AUC {r['auc']:.4f} log loss "
                  f"{r['logloss']:.4f}", flush=True)
        return cache[key]

    rows = []
    for seed in args.seeds:
        for init in inits:
            for name, k, d, _, options in cases:
                ref, got = result(0, 0, sync_only(options), seed, init), result(k, d, options, seed, init)
                rows.append((name, (seed, init), got, got["auc"] - ref["auc"], got["logloss"] / ref["logloss"] - 1))
    print(f"# {args.nproc} gloo ranks, {args.steps} steps of {args.batch_size} per rank, {args.eval_rows} rows held out, "
          f"seeds {args.seeds}, init seeds {args.init_seeds or 'as seed'}; deltas against the synchronous run of the "
          "same seeds and options; se: the mean's standard error")
    print(f"{'case (K,D,opts)':28s} {'dAUC per run':>30s} {'mean':>8s} {'sd':>7s} {'se':>7s} {'dLL% per run':>24s} "
          f"{'mean':>6s}")
    for name, *_ in cases:
        mine = [r for r in rows if r[0] == name]
        da, dl = [r[3] for r in mine], [100 * r[4] for r in mine]
        sd = statistics.stdev(da) if len(da) > 1 else float("nan")
        print(f"{name.partition(':')[0]:28s} {' '.join(f'{x:+.4f}' for x in da):>30s} {statistics.mean(da):+8.4f} "
              f"{sd:7.4f} {sd / len(da) ** 0.5:7.4f} {' '.join(f'{x:+.2f}' for x in dl):>24s} {statistics.mean(dl):+6.2f}")
    if len(inits) > 1:  # the noise floor: one configuration, another trajectory on the same samples
        for seed in args.seeds:
            sync = [result(0, 0, (), seed, i) for i in inits]
            auc, ll = [r["auc"] for r in sync], [r["logloss"] for r in sync]
            print(f"noise floor, seed {seed}: synchronous AUC over init seeds {' '.join(f'{x:.4f}' for x in auc)}: sd "
                  f"{statistics.stdev(auc):.4f} (a difference of two runs: sd {statistics.stdev(auc) * 2 ** 0.5:.4f}); "
                  f"log loss sd {100 * statistics.stdev(ll) / statistics.mean(ll):.2f}%")


if __name__ == "__main__":
    main()
