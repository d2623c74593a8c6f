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
    p.add_argument("--delta-key", metavar="FILE", help="with --delta: sign the delta with this key (the server's "
                   "serve --delta-key): a key file of yours, mode 600")


def run(args: argparse.Namespace) -> int:
    from ..serving import export, export_delta

    started = time.perf_counter()
    if args.delta_key and not args.delta:
        from ..errors import ConfigError

        raise ConfigError("--delta-key signs deltas: give it with --delta")
    if args.delta:
        from ..serving._trust import read_secret

        key = read_secret(args.delta_key, "--delta-key") if args.delta_key else None
        path = export_delta(args.checkpoint, args.out, key=key)
        what = "delta"
    else:
        path = export(args.checkpoint, args.out, dtype=args.dtype)
        what = f"{args.dtype} artifact"
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and "deltas" not in f.relative_to(path).parts)
    print(f"exported {what} {path} ({human_bytes(size).strip()}, {time.perf_counter() - started:.1f} s)")
    return 0
