"""Loader-only throughput: Criteo TSV, .gz, converted shards, and the synthetic generator.

    python bench/loader.py [--rows 500000] [--batch 8192] [--repeats 5] [--dir /tmp/hugeembed_bench]
    python bench/loader.py --only-schema [--schema-rows 200000]
    python bench/loader.py --convert-only [--sets wide,lowcard,longbags,wide60,wide.gz,lowcard.tsv]

Schema data (a 20-column CSV: label, 8 numbers, 9 string ids, 2 bags; bench/_schema_sets.py):
``convert`` against ``pyarrow.csv.read_csv`` alone on the same file (target >= 0.5x), and
training DLRM from the CSV file against training from its shards (wall time of the same steps
and evaluation, so waiting for input counts; target >= 0.9x); runs interleaved, medians.

Every figure is rows/s, the median of --repeats runs over all rows (batches are
built and handed through the prefetch queue as in training, then dropped).  References
measured in the same run: a Python per-line parser (what "too slow" means) and, when
installed, pyarrow's multi-threaded CSV reader (parse only, no transform, no batches).
Training runs at roughly 20-100 k samples/s; converted shards should beat 300 k rows/s.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from hugeembed.data import (Loader, SyntheticConfig, SyntheticCriteo, convert, CriteoReader, native_parser_available,
                            write_criteo_tsv)


def median_rate(fn, rows: int, repeats: int) -> tuple[float, float]:
    """(median rows/s, best rows/s) of `repeats` timed calls of fn()."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        got = fn()
        times.append(time.perf_counter() - t)
        if got != rows:
            raise RuntimeError(f"benchmark read {got} rows, expected {rows}")
    return rows / statistics.median(times), rows / min(times)


def count_loader(source, batch: int, **kw) -> int:
    return sum(b.batch_size for b in Loader(source, batch, **kw))


def count_reader(path, native: bool) -> int:
    return sum(len(b) for b in CriteoReader(path, native=native))


def python_per_line(path: Path, limit: int) -> int:
    """The naive reference: split each line, int() / int(x, 16) each field, log1p each count."""
    n = 0
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            _label = float(fields[0])
            _dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]]
            _cats = [int(x, 16) if x else -1 for x in fields[14:]]
            n += 1
            if n == limit:
                break
    return n


def pyarrow_csv(path: Path) -> int | None:
    try:
        from pyarrow import csv
    except ImportError:
        return None
    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    table = csv.read_csv(path, read_options=csv.ReadOptions(column_names=names),
                         parse_options=csv.ParseOptions(delimiter="\t"))
    return table.num_rows


def _write_csv(path: Path, header: list[str], columns: list[list[str]], delimiter: str = ",") -> None:
    """Rows of text cells; quoted where a cell needs it (csv module), gzip for a .gz path."""
    import csv as pycsv
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", newline="") as f:
        w = pycsv.writer(f, delimiter=delimiter, lineterminator="\n")
        w.writerow(header)
        w.writerows(zip(*columns))


def _zipf_ids(rng, n: int, size: int):
    import numpy as np

    return np.minimum((np.exp(rng.random(size) * math.log(n + 1)) - 1).astype(np.int64), n - 1)


class _GeneratedFile:
    """A generated file's cells, header and schema lines, built column by column after a 0/1 label."""

    def __init__(self, rng, rows: int, fmt: str = "csv") -> None:
        self.cols, self.header = [rng.integers(0, 2, rows).astype(str).tolist()], ["label"]
        self.schema = [f'format = "{fmt}"', "[label]", 'column = "label"']

    def add(self, kind: str, name: str, cells: list[str], *options: str) -> None:
        self.header.append(name)
        self.cols.append(cells)
        self.schema += [f"[{kind}.{name}]", *options]

    def written(self, path: Path, delimiter: str = ",") -> tuple[Path, str]:
        if not path.exists():
            _write_csv(path, self.header, self.cols, delimiter)
        return path, "\n".join(self.schema) + "\n"


def lowcard_set(workdir: Path, rows: int, suffix: str = ".csv", seed: int = 1) -> tuple[Path, str]:
    """20 columns as public click logs hold them: label, 4 numbers, 15 text columns of 3-300 distinct values,
    some long (user agents, category paths, country names), a few cells empty or quoted (a comma inside)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tsv = ".tsv" in suffix
    f = _GeneratedFile(rng, rows, "tsv" if tsv else "csv")
    for k in range(4):
        f.add("dense", f"n{k}", rng.integers(0, 100, rows).astype(str).tolist(), 'transform = "log1p"')
    stems = ["Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 Chrome/{}", "Electronics > Phones > {}",
             "United States of {}", "ios", "android {}", "web", "{}", "Books, Comics & {}"]
    for k in range(15):
        card = (3, 10, 30, 100, 300)[k % 5]
        stem = stems[k % len(stems)]
        words = np.array([stem.format(i) if "{}" in stem else f"{stem}{i}" for i in range(card)] + [""])
        pick = _zipf_ids(rng, card, rows)
        pick[rng.random(rows) < 0.02] = card  # a few empty cells
        f.add("sparse", f"s{k}", words[pick].tolist())
    return f.written(workdir / f"lowcard-{rows}-s{seed}{suffix}", "\t" if tsv else ",")


def longbags_set(workdir: Path, rows: int, suffix: str = ".csv", seed: int = 2) -> tuple[Path, str]:
    """Sequences: label, 4 numbers, 3 ids, 3 long multi-valued cells (0-200 items, the last 50 kept)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    f = _GeneratedFile(rng, rows)
    for k in range(4):
        f.add("dense", f"n{k}", np.round(rng.lognormal(1, 1.5, rows), 2).astype(str).tolist(), 'transform = "log1p"')
    for k in range(3):
        f.add("sparse", f"c{k}", [f"id{x}" for x in _zipf_ids(rng, 10 ** (3 + k), rows)])
    for k in range(3):
        lens = rng.integers(0, 200 if k == 0 else 60, rows)
        vals = _zipf_ids(rng, 100_000, int(lens.sum()))
        offs = np.concatenate([[0], np.cumsum(lens)])
        f.add("sparse", f"h{k}", [" ".join(f"i{x}" for x in vals[offs[i]:offs[i + 1]]) for i in range(rows)],
              'separator = " "', "max_length = 50")
    return f.written(workdir / f"longbags-{rows}-s{seed}{suffix}")


def wide60_set(workdir: Path, rows: int, suffix: str = ".csv", seed: int = 3) -> tuple[Path, str]:
    """A wide file: label, 20 numbers, 39 text ids of 10 - 1 M distinct values."""
    import numpy as np

    rng = np.random.default_rng(seed)
    f = _GeneratedFile(rng, rows)
    for k in range(20):
        f.add("dense", f"n{k}", rng.integers(0, 1000, rows).astype(str).tolist(),
              'transform = "log1p"' if k % 2 else 'transform = "none"')
    for k in range(39):
        f.add("sparse", f"c{k}", [f"{x:x}" for x in _zipf_ids(rng, 10 ** (1 + k % 6), rows)])
    return f.written(workdir / f"wide60-{rows}-s{seed}{suffix}")


def _named_set(workdir: Path, name: str, rows: int) -> tuple[Path, str]:
    """A set by name: wide (the bench's 20 columns), lowcard, longbags, wide60; a suffix .gz or .tsv (lowcard)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _schema_sets import wide_set

    base, _, ext = name.partition(".")
    if base == "wide":
        path, text = wide_set(workdir, rows)
        if ext == "gz":
            import gzip

            gz = path.with_suffix(".csv.gz")
            if not gz.exists():
                with open(path, "rb") as f, gzip.open(gz, "wb", compresslevel=6) as out:
                    shutil.copyfileobj(f, out)
            path = gz
        return path, text
    make = {"lowcard": lowcard_set, "longbags": longbags_set, "wide60": wide60_set}[base]
    return make(workdir, rows, {"": ".csv", "gz": ".csv.gz", "tsv": ".tsv"}[ext])


def convert_figures(workdir: Path, names: list[str], rows: int, repeats: int) -> None:
    """convert against pyarrow.csv.read_csv alone on each set, interleaved, medians (no training)."""
    from pyarrow import csv

    from hugeembed.data import load_schema

    for name in names:
        path, text = _named_set(workdir, name, rows)
        toml = workdir / f"{name}.toml"
        toml.write_text(text)
        schema = load_schema(toml)
        shards = workdir / f"{name}-shards"
        opts = csv.ParseOptions(delimiter="\t") if ".tsv" in path.name else None
        arrow, ours = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            csv.read_csv(path, parse_options=opts)
            arrow.append(time.perf_counter() - t)
            shutil.rmtree(shards, ignore_errors=True)
            t = time.perf_counter()
            convert(path, shards, schema=schema)
            ours.append(time.perf_counter() - t)
        a, o = statistics.median(arrow), statistics.median(ours)
        runs = " ".join(f"{x / y:.2f}" for x, y in zip(arrow, ours))
        print(f"  {name:12s} {path.stat().st_size / 1e6:5.0f} MB  read_csv {a * 1e3:6.0f} ms  convert {o * 1e3:6.0f} ms"
              f"  -> {a / o:.2f}x  (per run {runs}; load {os.getloadavg()[0]:.1f})", flush=True)


def schema_figures(workdir: Path, rows: int, repeats: int, steps: int) -> None:
    """Convert vs pyarrow.csv.read_csv, and training from the CSV vs from its shards (interleaved, medians)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _schema_sets import wide_set
    from pyarrow import csv

    from hugeembed.data import convert, load_schema
    from hugeembed.training import TrainConfig, Trainer

    path, text = wide_set(workdir, rows)
    (workdir / "wide.toml").write_text(text)
    schema = load_schema(workdir / "wide.toml")
    shards = workdir / f"wide-{rows}-shards"
    print(f"\nschema data: {path.name}, {rows:,} rows, 20 columns, {path.stat().st_size / 1e6:.0f} MB")
    arrow, ours, arrow_cpu, ours_cpu = [], [], [], []

    def timed(fn, wall: list, cpu: list) -> None:  # CPU time of all threads too: the machine may be shared
        c, t = os.times(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(sum(os.times()[:2]) - sum(c[:2]))

    for _ in range(repeats):
        timed(lambda: csv.read_csv(path), arrow, arrow_cpu)
        shutil.rmtree(shards, ignore_errors=True)
        timed(lambda: convert(path, shards, schema=schema), ours, ours_cpu)
    a, o = statistics.median(arrow), statistics.median(ours)
    ac, oc = statistics.median(arrow_cpu), statistics.median(ours_cpu)
    print(f"  pyarrow.csv.read_csv alone      {rows / a / 1e3:7.0f} k rows/s median   CPU {ac * 1e3:4.0f} ms")
    print(f"  hugeembed convert --schema      {rows / o / 1e3:7.0f} k rows/s median   CPU {oc * 1e3:4.0f} ms   "
          f"-> {a / o:.2f}x pyarrow's reader (target >= 0.5x); CPU time {ac / oc:.2f}x")
    runs = " ".join(f"{x / y:.2f}" for x, y in zip(arrow, ours))
    print(f"  per run (convert's speed / read_csv's, in run order): {runs}; load average {os.getloadavg()[0]:.1f}")

    held_out = workdir / "wide-eval.csv"  # both runs end with the same evaluation on a small file
    with open(path) as f, open(held_out, "w") as out:
        out.writelines(line for _, line in zip(range(2049), f))

    def train(data: str) -> float:
        cfg = TrainConfig(schema=str(workdir / "wide.toml") if data == str(path) else None, data=(data,),
                          eval_data=(str(held_out),), steps=steps, batch_size=2048, eval_every=0, threads=2)
        trainer = Trainer(cfg)
        t = time.perf_counter()
        trainer.fit()
        return steps * 2048 / (time.perf_counter() - t)

    from_csv, from_shards = [], []
    for _ in range(max(2, repeats // 2)):
        from_csv.append(train(str(path)))
        from_shards.append(train(str(shards)))
    c, sh = statistics.median(from_csv), statistics.median(from_shards)
    print(f"  training DLRM from its shards   {sh / 1e3:7.1f} k samples/s median (wall time of {steps} steps)")
    print(f"  training DLRM from the CSV file {c / 1e3:7.1f} k samples/s median   -> {c / sh:.2f}x the shards' "
          f"(target >= 0.9x)")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hugeembed_bench"))
    ap.add_argument("--schema-rows", type=int, default=200_000, help="rows of the 20-column CSV")
    ap.add_argument("--schema-steps", type=int, default=60, help="training steps of each schema-data run")
    ap.add_argument("--only-schema", action="store_true", help="only the schema-data figures")
    ap.add_argument("--convert-only", action="store_true", help="only convert vs read_csv, on --sets")
    ap.add_argument("--sets", default="wide,lowcard,longbags,wide60,wide.gz,lowcard.tsv",
                    help="files for --convert-only: wide, lowcard, longbags, wide60 (+ .gz; lowcard also .tsv)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.convert_only:
        convert_figures(args.dir, args.sets.split(","), args.schema_rows, args.repeats)
        return
    if args.only_schema:
        schema_figures(args.dir, args.schema_rows, args.repeats, args.schema_steps)
        return
    n, bs, r = args.rows, args.batch, args.repeats
    cfg = SyntheticConfig(seed=0, max_cardinality=10_000_000)
    args.dir.mkdir(parents=True, exist_ok=True)
    tsv, gz, shards = args.dir / f"criteo_{n}.txt", args.dir / f"criteo_{n}.txt.gz", args.dir / f"shards_{n}"
    if not tsv.exists():
        print(f"writing {n:,} synthetic rows as Criteo TSV ...", flush=True)
        write_criteo_tsv(tsv, n, config=cfg)
    if not gz.exists():
        write_criteo_tsv(gz, n, config=cfg)
    if not shards.exists():
        convert(tsv, shards, rows_per_shard=1 << 18)
    mb = tsv.stat().st_size / 1e6
    print(f"{n:,} rows, TSV {mb:.0f} MB ({tsv.stat().st_size / n:.0f} B/row), .gz {gz.stat().st_size / 1e6:.0f} MB; "
          f"batch {bs}; median of {r}; torch threads {args.threads}\n")

    results: list[tuple[str, float, float]] = []

    def run(name, fn, rows=n, repeats=r):
        rate, best = median_rate(fn, rows, repeats)
        results.append((name, rate, best))
        print(f"  {name:52s} {rate / 1e3:7.0f} k rows/s median  {best / 1e3:7.0f} k best", flush=True)

    print("parse only (CriteoReader, blocks of ~35k rows):")
    if native_parser_available():
        run("TSV, native C++ parser", lambda: count_reader(tsv, True))
    run("TSV, NumPy twin parser", lambda: count_reader(tsv, False), repeats=max(3, r // 2))
    if native_parser_available():
        run(".gz, native C++ parser", lambda: count_reader(gz, True))
    py_rows = min(n, 50_000)
    run("reference: Python per-line parser", lambda: python_per_line(tsv, py_rows), rows=py_rows, repeats=3)
    if pyarrow_csv(tsv) is not None:
        run("reference: pyarrow.csv.read_csv (parse only, threads)", lambda: pyarrow_csv(tsv), repeats=3)

    print(f"\nLoader -> Batch (prefetch thread, batch {bs}):")
    run("TSV", lambda: count_loader(tsv, bs))
    run(".gz", lambda: count_loader(gz, bs))
    run("converted shards (sha256 of each shard on first map)", lambda: count_loader(shards, bs))
    run("converted shards, verify='none' (no checksums)", lambda: count_loader(shards, bs, verify="none"))
    run("converted shards, shuffle=True", lambda: count_loader(shards, bs, shuffle=True))
    run("converted shards, rank 0 of 2 (half the rows)", lambda: count_loader(shards, bs, rank=0, world_size=2),
        rows=(n + 1) // 2)

    print("\nsynthetic generator:")
    gen = SyntheticCriteo(cfg)
    run("SyntheticCriteo.rows (2048-row calls)", lambda: sum(len(gen.rows(a, min(2048, n - a))) for a in range(0, n, 2048)))
    run("SyntheticCriteo.rows (8192-row calls)", lambda: sum(len(gen.rows(a, min(8192, n - a))) for a in range(0, n, 8192)))
    run(f"SyntheticCriteo.batches({bs}) -> Batch", lambda: sum(b.batch_size for b in gen.batches(bs, -(-n // bs)))
        , rows=-(-n // bs) * bs)
    run("write_criteo_tsv (text formatting)", lambda: _write_count(args.dir / "w.txt", 100_000, cfg), rows=100_000,
        repeats=3)

    rate = dict((name, rate) for name, rate, _ in results)
    checked, unchecked = rate["converted shards (sha256 of each shard on first map)"], \
        rate["converted shards, verify='none' (no checksums)"]
    print(f"\nconverted shards / 100 k samples/s training: {checked / 1e5:.1f}x (need >= 3x)")
    print(f"checksum verification on first map costs {100 * (unchecked / checked - 1):.0f}% of a first epoch "
          f"over shards (later epochs of one Loader: nothing)")
    schema_figures(args.dir, args.schema_rows, args.repeats, args.schema_steps)
    if native_parser_available():
        print(f"native parser / NumPy twin: {rate['TSV, native C++ parser'] / rate['TSV, NumPy twin parser']:.1f}x; "
              f"native / Python per-line: {rate['TSV, native C++ parser'] / rate['reference: Python per-line parser']:.0f}x")


def _write_count(path: Path, rows: int, cfg: SyntheticConfig) -> int:
    write_criteo_tsv(path, rows, config=cfg)
    return rows


if __name__ == "__main__":
    main()
