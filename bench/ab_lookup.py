"""bench/lookup.py's cases, this checkout against another one (an older commit's worktree), in ONE process.

Between processes this VM's figures vary by up to 2x even when it is quiet (the EmbeddingBag reference
too), so an A/B of two processes needs many pairs to say 0.95x.  Here both versions' FusedEmbeddingLookup
(each with its own native library) and the EmbeddingBag loop run on the same tables and batches, their runs
interleaved (_common.measure_together); each run's new/old ratio is taken, and the median of those.

    git worktree add /tmp/old 78baa67 && (cd /tmp/old && python setup.py -q build_ext --inplace)
    python bench/ab_lookup.py --old /tmp/old --dims 16 64 --pooling 1 20 --runs 7
    python bench/ab_lookup.py --old /tmp/old --dims 16 64 --pooling 1 --instructions   # load does not move it

--instructions counts instead of timing (valgrind's callgrind, bench/_callgrind.py): the instructions of
--count-steps steps of each version and of the EmbeddingBag loop, on one thread, twice (the two rounds
agree within ~0.5%).  A timed ratio of one run swings 0.95-1.2x on a loaded VM; the count says whether
the code itself runs more work (it does not see memory stalls: the steps here are bound by them).

The older checkout is imported as the package ``hugeembed_old`` (its modules import each other
relatively, so both live side by side).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _callgrind import Regions, run_counted  # noqa: E402
from _callgrind import available as callgrind_available  # noqa: E402
from _common import criteo_batches, criteo_rows, free_memory, measure_together, print_table  # noqa: E402
from lookup import ebag_step, make_tables, ours_step  # noqa: E402

import hugeembed  # noqa: E402


def load_as(checkout: str, name: str):
    """The package ``hugeembed`` of `checkout`, imported under `name`."""
    root = Path(checkout).resolve() / "hugeembed"
    if not (root / "__init__.py").exists():
        raise SystemExit(f"--old {checkout}: no hugeembed package there")
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the other checkout (its native library built)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    p.add_argument("--pooling", type=int, nargs="+", default=[1, 20])
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--row-scale", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--instructions", action="store_true",
                   help="count instructions (callgrind, one thread) instead of timing; see above")
    p.add_argument("--count-steps", type=int, default=1, help="with --instructions: steps counted per region")
    p.add_argument("--counted-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.instructions:
        return instructions(args, argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(1 if args.counted_child else args.threads)
    old = load_as(args.old, "hugeembed_old")
    hugeembed._native.tune_malloc()
    rows = criteo_rows(scale=args.row_scale)
    if args.counted_child:
        counted_child(args, old, rows)
        return 0
    print(f"# new: {Path(hugeembed.__file__).parent.parent}, old: {Path(old.__file__).parent.parent}; "
          f"Criteo-26 {sum(rows) / 1e6:.1f} M rows, batch {args.batch}, threads {args.threads}, runs {args.runs}; "
          f"ratios: median over runs of each run's ratio")
    out = []
    for (case, mode), steps in cases(args, rows, old):
        t = measure_together(steps, 0, args.runs, seconds=args.seconds)
        ratio = statistics.median(o / n for n, o in zip(t["new"].runs, t["old"].runs))
        vs = [statistics.median(e / x for x, e in zip(t[k].runs, t["ebag"].runs)) for k in ("new", "old")]
        out.append([case.replace("P", " P"), mode,
                    f"{args.batch / t['new'].median_s / 1e3:.0f} k/s", f"{args.batch / t['old'].median_s / 1e3:.0f} k/s",
                    f"{ratio:.3f}x", f"{vs[0]:.2f}x", f"{vs[1]:.2f}x"])
        del steps, t
    print_table(["case", "mode", "new samples/s", "old samples/s", "new/old", "new/ebag", "old/ebag"], out)
    return 0


def cases(args, rows, old):
    """(label, {impl: step}) for every case of the run, built one case at a time (the tables of one
    dim at a time in memory)."""
    for pooling in args.pooling:
        batches = criteo_batches(rows, args.batch, pooling, n_batches=4)
        for dim in args.dims:
            tables = make_tables(rows, dim)
            for train in (False, True):
                yield (f"d{dim}P{pooling}", "fwd+bwd+SGD" if train else "fwd"), {
                    "new": ours_step(tables, batches, args.batch, pooling, train),
                    "old": ours_step(tables, batches, args.batch, pooling, train, pkg=old),
                    "ebag": ebag_step(tables, batches, args.batch, pooling, train)}
            del tables
            free_memory()


def counted_child(args, old, rows) -> None:
    """Under callgrind: per case, after 4 warm-up steps each, --count-steps steps of each impl as a
    region labelled case.mode.impl.round, in two rounds (the second in the reverse order)."""
    regions = Regions()
    for (case, mode), steps in cases(args, rows, old):
        for fn in steps.values():
            for i in range(4):
                fn(i)
        for r, order in enumerate((["new", "old", "ebag"], ["ebag", "old", "new"])):
            for impl in order:
                regions.start()
                for i in range(args.count_steps):
                    steps[impl](4 + i)
                regions.stop(f"{case}.{mode.replace('+', '_')}.{impl}.{r}")


def instructions(args, argv) -> int:
    if not callgrind_available():
        raise SystemExit("--instructions needs valgrind, a C compiler and valgrind/callgrind.h")
    child = [a for a in argv if a != "--instructions"]
    counts = run_counted([sys.executable, os.path.abspath(__file__), *child, "--counted-child"])
    print(f"# instructions of {args.count_steps} step(s) (callgrind, 1 thread; round 1 / round 2), new: "
          f"{Path(hugeembed.__file__).parent.parent}, old: {Path(args.old).resolve()}; Criteo-26 x{args.row_scale}, "
          f"batch {args.batch}")
    out = []
    for pooling in args.pooling:
        for dim in args.dims:
            for mode in ("fwd", "fwd_bwd_SGD"):
                key = f"d{dim}P{pooling}.{mode}"
                got = {impl: [counts[f"{key}.{impl}.{r}"] for r in (0, 1)] for impl in ("new", "old", "ebag")}
                out.append([f"d{dim} P{pooling}", mode.replace("_", "+")] +
                           [" / ".join(f"{n / 1e6:.2f} M" for n in got[impl]) for impl in ("new", "old")] +
                           [f"{got['new'][1] / got['old'][1]:.4f}x", f"{got['ebag'][1] / 1e6:.2f} M (rounds "
                            f"{got['ebag'][1] / got['ebag'][0]:.4f}x)"])
    print_table(["case", "mode", "new instructions", "old instructions", "new/old", "ebag"], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
