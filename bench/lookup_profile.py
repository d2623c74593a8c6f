"""Where one step of bench/lookup.py's case goes: the device's kernels and the host's Python.

For each implementation and mode (forward, training step) of one case (26 Criteo tables, Zipf ids):
the median wall time of a step (synchronized), then torch.profiler over a few steps (each kernel's
device time and launches per step, the host's launch calls), then cProfile over a few steps (the
Python functions with the most own time per step: the host's share when the device waits).

    python bench/lookup_profile.py --device cuda --dim 16 --pooling 1
    python bench/lookup_profile.py --impls coll ebag --modes train
    py-spy record -f raw -o coll.txt -- python bench/lookup_profile.py --device cuda --impls coll --modes train --spin 5

--spin S runs the steps for S seconds with no profiler instead (after the warm-up), for a sampling
profiler outside the process: where the host's time goes when it, not the device, bounds the step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import criteo_batches, criteo_rows, sync  # noqa: E402
from lookup import _step_of, make_tables  # noqa: E402


def _wall(step, device, n: int) -> float:
    times = []
    for i in range(n):
        sync()
        t0 = time.perf_counter()
        step(i)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _spin(step, seconds: float) -> float:
    """Steps back to back for `seconds` (synchronized once at the end): the mean time of a step."""
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step(n)
        n += 1
    sync()
    return (time.perf_counter() - t0) / n


def _kernels(step, device, n: int, top: int) -> str:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        for i in range(n):
            step(i)
        sync()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if dev_us > 0 and e.key and not e.key.startswith(("aten::", "Lookup", "Optimizer")):
            rows.append((dev_us / n, e.count / n, e.key[:70]))
        elif e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                       "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize"):
            rows.append((0.0, e.count / n, f"[host] {e.key}: {e.cpu_time_total / n:.0f} us/step"))
    rows.sort(key=lambda r: -r[0])
    kernels = [r for r in rows if r[0] > 0]
    out = [f"  device time per step {sum(r[0] for r in kernels):.0f} us in {sum(r[1] for r in kernels):.0f} "
           f"kernels ({len(kernels)} names)"]
    out += [f"  {us:9.1f} us  x{c:5.1f}  {k}" for us, c, k in kernels[:top]]
    out += [f"  {'':9s}     x{c:5.1f}  {k}" for us, c, k in rows if us == 0]
    return "\n".join(out)


def _python(step, device, n: int, top: int) -> str:
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for i in range(n):
        step(i)
    sync()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    return "\n".join("  " + ln for ln in lines[:top + 8])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--pooling", type=int, default=1)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--row-scale", type=float, default=1.0)
    p.add_argument("--impls", nargs="+", default=["ours", "coll", "ebag"], choices=["ours", "coll", "ours-torch", "ebag"])
    p.add_argument("--modes", nargs="+", default=["fwd", "train"], choices=["fwd", "train"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--spin", type=float, default=0.0, help="run steps for this many seconds, no profiler")
    args = p.parse_args(argv)
    rows = criteo_rows(scale=args.row_scale)
    batches = [[ids.to(args.device) for ids in b] for b in criteo_batches(rows, args.batch, args.pooling, 4)]
    tables = make_tables(rows, args.dim, device=args.device)
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"# d{args.dim} P{args.pooling} batch {args.batch}, {where}, torch {torch.__version__}")
    for mode in args.modes:
        for impl in args.impls:
            step = _step_of(impl, tables, batches, args.batch, args.pooling, mode == "train")
            for i in range(5):  # warm-up: compiles, caches, the allocator
                step(i)
            if args.spin:
                print(f"## {impl} {mode}: {_spin(step, args.spin) * 1e3:.3f} ms a step, unsynchronized")
                continue
            wall = _wall(step, args.device, 3 * args.steps)
            print(f"\n## {impl} {mode}: {wall * 1e3:.3f} ms a step ({args.batch / wall / 1e3:.0f} k samples/s)")
            print(_kernels(step, args.device, args.steps, args.top))
            print(_python(step, args.device, args.steps, args.top))
            del step
    return 0


if __name__ == "__main__":
    sys.exit(main())
