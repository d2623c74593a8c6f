"""hugeembed schema: print a starting schema (TOML) for a data file, to edit and pass to --schema.

    hugeembed schema clicks.csv > clicks.toml
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("schema", help="print a starting schema for a CSV/TSV/Parquet file", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", help="a .csv, .tsv or .parquet file (optionally .gz)")
    p.add_argument("--rows", type=int, default=10_000, help="rows looked at (default 10000)")


def run(args: argparse.Namespace) -> int:
    from ..data import infer_schema

    if args.rows < 1:
        raise ValueError(f"--rows must be positive, got {args.rows}")
    print(infer_schema(args.file, sample_rows=args.rows), end="")
    return 0
