"""``hugeembed convert``: data files (Criteo TSV/.gz, or CSV/TSV/Parquet under a schema) -> binary shards.

    hugeembed convert day_0.gz day_1.gz --out shards/ [--skip-bad-lines] [--rows-per-shard N]
    hugeembed convert --schema clicks.toml clicks.csv --out shards/
"""

from __future__ import annotations

import argparse
import sys
import time

from ..data import ConvertProgress, convert, load_schema

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert data files into memory-mappable binary shards",
        description="Convert data files -- Criteo display-advertising TSV (plain or .gz), or CSV/TSV/Parquet "
        "under --schema -- into a directory of .npy shards with a manifest.json (and the schema), written "
        "atomically. Read it back with hugeembed.data.Loader or `hugeembed train --data DIR`.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="data files, converted in order")
    p.add_argument("--schema", metavar="FILE.toml", help="the files' schema (default: Criteo's)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed lines instead of stopping at the first one")
    p.add_argument("--rows-per-shard", type=_positive_int, default=1 << 20, metavar="N",
                   help="rows per shard (default 1048576)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists (after the new one is complete)")
    p.add_argument("--no-progress", action="store_true", help="do not show a progress bar")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


class _Progress:
    """tqdm bar over input bytes when tqdm is installed, else a line on stderr redrawn at most 4x/s."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar = None
        self._last = 0.0
        self._t0 = time.perf_counter()
        self._shown = False

    def __call__(self, p: ConvertProgress) -> None:
        if not self.enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            if self._bar is None:
                self._bar = tqdm(total=p.bytes_total, unit="B", unit_scale=True, desc="convert", file=sys.stderr)
            self._bar.update(p.bytes_done - self._bar.n)
            self._bar.set_postfix(rows=f"{p.rows:,}", skipped=f"{p.skipped:,}", refresh=False)
            return
        now = time.perf_counter()
        if now - self._last < 0.25 and p.bytes_done < p.bytes_total:
            return
        self._last = now
        pct = 100.0 * p.bytes_done / p.bytes_total if p.bytes_total else 100.0
        mb_s = p.bytes_done / 1e6 / max(now - self._t0, 1e-9)
        print(f"\rconvert: {pct:5.1f}%  {p.rows:,} rows  {p.skipped:,} skipped  {mb_s:.1f} MB/s",
              end="", file=sys.stderr, flush=True)
        self._shown = True

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._shown:
            print(file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    progress = _Progress(enabled=not args.no_progress)
    try:
        schema = load_schema(args.schema) if args.schema else None
        summary = convert(args.inputs, args.out, schema=schema, rows_per_shard=args.rows_per_shard,
                          on_error="skip" if args.skip_bad_lines else "raise", overwrite=args.overwrite,
                          progress=progress)
    finally:
        progress.close()
    print(f"converted {summary.rows:,} rows into {summary.shards} shard(s) in {summary.out_dir}: "
          f"{summary.skipped:,} malformed line(s) skipped, {summary.bytes_in / 1e6:.1f} MB in "
          f"{summary.seconds:.1f} s ({summary.mb_per_s:.1f} MB/s)")
    for example in summary.skipped_examples[:5]:
        print(f"  skipped {example}")
    return 0
