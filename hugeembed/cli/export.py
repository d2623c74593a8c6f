"""hugeembed export: a snapshot -> a frozen serving artifact (or, with --delta, an increment of one)."""

from __future__ import annotations

import argparse
import time

from .._format import human_bytes


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a snapshot for serving", description=__doc__)
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="snapshot or checkpoint directory (newest)")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="artifact directory to create; with --delta, the artifact to add the delta to")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "int8", "int4"),
                   help="rows as served: int8/int4 are row-wise quantized (scale and bias per row)")
    p.add_argument("--delta", action="store_true",
                   help="write the rows changed since the snapshot the artifact serves into OUT/deltas/")


def run(args: argparse.Namespace) -> int:
    from ..serving import export, export_delta

    started = time.perf_counter()
    if args.delta:
        path = export_delta(args.checkpoint, args.out)
        what = "delta"
    else:
        path = export(args.checkpoint, args.out, dtype=args.dtype)
        what = f"{args.dtype} artifact"
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and "deltas" not in f.relative_to(path).parts)
    print(f"exported {what} {path} ({human_bytes(size).strip()}, {time.perf_counter() - started:.1f} s)")
    return 0
