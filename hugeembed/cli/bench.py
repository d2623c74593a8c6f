"""hugeembed bench: run the benchmark suite (bench/*.py of a source checkout) and print the ratios."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ..errors import ConfigError

SUITE = ("lookup", "tables", "train", "loader", "snapshot", "distributed", "tiered", "serve")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run the benchmarks", description=__doc__)
    p.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default all): {', '.join(SUITE)}")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a minute or so")
    p.add_argument("--bench-dir", metavar="DIR", help="where the bench/ scripts are (default: beside the package)")


def _bench_dir(given: str | None) -> Path:
    d = Path(given) if given else Path(__file__).resolve().parents[2] / "bench"
    if not d.is_dir():
        raise ConfigError(f"no benchmark scripts at {d}: they ship with the source checkout (pass --bench-dir)")
    return d


def run(args: argparse.Namespace) -> int:
    names = args.names or list(SUITE)
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        raise ConfigError(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(SUITE)}")
    d = _bench_dir(args.bench_dir)
    failed = []
    for name in names:
        script = d / f"{name}.py"
        if not script.exists():
            raise ConfigError(f"benchmark script {script} is missing")
        print(f"== {name} ==", flush=True)
        rc = subprocess.run([sys.executable, str(script)] + (["--quick"] if args.quick else [])).returncode
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"hugeembed bench: {', '.join(failed)} failed", file=sys.stderr)
        return 1
    return 0
