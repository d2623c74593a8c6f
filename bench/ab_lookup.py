"""bench/lookup.py's cases, this checkout against another one (an older commit's worktree), in ONE process.

Between processes this VM's figures vary by up to 2x even when it is quiet (the EmbeddingBag reference
too), so an A/B of two processes needs many pairs to say 0.95x.  Here both versions' FusedEmbeddingLookup
(each with its own native library) and the EmbeddingBag loop run on the same tables and batches, their runs
interleaved (_common.measure_together); each run's new/old ratio is taken, and the median of those.

    git worktree add /tmp/old 78baa67 && (cd /tmp/old && python setup.py -q build_ext --inplace)
    python bench/ab_lookup.py --old /tmp/old --dims 16 64 --pooling 1 20 --runs 7

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
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    old = load_as(args.old, "hugeembed_old")
    hugeembed._native.tune_malloc()
    rows = criteo_rows(scale=args.row_scale)
    print(f"# new: {Path(hugeembed.__file__).parent.parent}, old: {Path(old.__file__).parent.parent}; "
          f"Criteo-26 {sum(rows) / 1e6:.1f} M rows, batch {args.batch}, threads {args.threads}, runs {args.runs}; "
          f"ratios: median over runs of each run's ratio")
    out = []
    for pooling in args.pooling:
        batches = criteo_batches(rows, args.batch, pooling, n_batches=4)
        for dim in args.dims:
            tables = make_tables(rows, dim)
            for train in (False, True):
                steps = {"new": ours_step(tables, batches, args.batch, pooling, train),
                         "old": ours_step(tables, batches, args.batch, pooling, train, pkg=old),
                         "ebag": ebag_step(tables, batches, args.batch, pooling, train)}
                t = measure_together(steps, 0, args.runs, seconds=args.seconds)
                ratio = statistics.median(o / n for n, o in zip(t["new"].runs, t["old"].runs))
                vs = [statistics.median(e / x for x, e in zip(t[k].runs, t["ebag"].runs)) for k in ("new", "old")]
                out.append([f"d{dim} P{pooling}", "fwd+bwd+SGD" if train else "fwd",
                            f"{args.batch / t['new'].median_s / 1e3:.0f} k/s", f"{args.batch / t['old'].median_s / 1e3:.0f} k/s",
                            f"{ratio:.3f}x", f"{vs[0]:.2f}x", f"{vs[1]:.2f}x"])
                del steps
            del tables
            free_memory()
    print_table(["case", "mode", "new samples/s", "old samples/s", "new/old", "new/ebag", "old/ebag"], out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
