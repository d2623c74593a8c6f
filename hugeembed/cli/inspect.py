"""hugeembed inspect: what a snapshot holds (tables, rows, bytes, optimizer, id frequencies).

A delta is described as written: the rows seen since its parent and the keys removed since
(``removed``), with its parent and base named; inspect the base for whole tables.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .. import checkpoint as ckpt
from ..checkpoint._columns import key_shards
from ._output import check_output_paths, human_bytes, write_json


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a snapshot", description=__doc__)
    p.add_argument("snapshot", metavar="SNAPSHOT", help="snapshot or checkpoint directory (newest)")
    p.add_argument("--histogram", metavar="PATH.png", help="save the id-frequency histogram as a picture")
    p.add_argument("--json", metavar="PATH", help="write the description as JSON")


def _frequency_bins(counts: torch.Tensor) -> list[tuple[str, int]]:
    """Rows by hit count in powers of two: 1, 2-3, 4-7, ..."""
    if counts.numel() == 0:
        return []
    c = counts.clamp(min=1).to(torch.float64)
    exp = torch.floor(torch.log2(c)).to(torch.int64)
    hist = torch.bincount(exp)
    return [(f"{1 << k}" if k == 0 else f"{1 << k}-{(1 << (k + 1)) - 1}", int(n)) for k, n in enumerate(hist.tolist())]


def run(args: argparse.Namespace) -> int:
    check_output_paths(json=args.json, histogram=args.histogram)
    manifest = ckpt.read_manifest(args.snapshot)
    snap = Path(manifest["_path"])
    delta = manifest.get("kind") == "delta"
    files = sum(r["bytes"] for r in manifest["files"].values())
    tables, all_counts = [], []
    for t in manifest["tables"]:
        ex = ckpt.read_table(snap, t)
        shard_bytes = sum(rec["bytes"] for s in t["shards"] for rec in s["files"].values())
        files += shard_bytes
        all_counts.append(ex.counts)
        tables.append({"name": t["name"], "dim": t["dim"], "rows": int(ex.keys.numel()),
                       "pending": int(ex.pending_keys.numel()), "bytes": shard_bytes,
                       "optimizer": (t["optimizer"] or {}).get("name", "frozen"), "state_width": t["state_width"],
                       "dtype": t.get("dtype"), "state_dtype": t.get("state_dtype", t.get("dtype")),
                       "static_rows": t["num_rows"], "hits": int(ex.counts.sum()), "tier": t.get("tier")})
        if delta:
            tables[-1]["removed"] = sum(s["removed"] for s in key_shards(t))  # column blocks: one's
    print(f"snapshot {snap}  (step {manifest['step']}, format {manifest['format_version']}, "
          f"hugeembed {manifest.get('hugeembed_version', '?')}, {manifest['world_size']} process(es))")
    schema = _run_schema(snap)
    if schema is not None and schema.is_criteo():
        print("data schema: Criteo's (built in)")
    elif schema is not None:
        print("data schema:\n  " + "\n  ".join(schema.describe()))
    if delta:
        print(f"delta {manifest['depth']} of the chain from the full snapshot {manifest['base']}, parent "
              f"{manifest['parent']['name']}: rows and pending are the keys seen since the parent, removed those gone")
    header = f"{'table':<12} {'dim':>4} {'rows':>10} {'pending':>8} {'bytes':>11} {'optimizer':<16} {'state':>5} {'hits':>12}"
    header += f" {'removed':>8}" if delta else ""
    print(header)
    print("-" * len(header))
    for t in tables:
        removed = f" {t['removed']:>8,}" if delta else ""
        print(f"{t['name']:<12} {t['dim']:>4} {t['rows']:>10,} {t['pending']:>8,} {human_bytes(t['bytes']):>11} "
              f"{t['optimizer']:<16} {t['state_width']:>5} {t['hits']:>12,}{removed}")
    print(f"total: {sum(t['rows'] for t in tables):,} rows, {human_bytes(files)} on disk")
    tiered = [t for t in tables if t["tier"]]
    if tiered:  # figures of the disk tier when the snapshot was written
        print(f"\n{'tiered table':<12} {'resident rows':>14} {'stored rows':>12} {'hit rate':>9} {'rows read':>11} "
              f"{'rows written':>13}")
        for t in tiered:
            s = t["tier"]
            print(f"{t['name']:<12} {s['resident_rows']:>14,} {s['stored_rows']:>12,} {s['hit_rate']:>9.1%} "
                  f"{s['rows_read']:>11,} {s['rows_written']:>13,}")
    counts = torch.cat(all_counts) if all_counts else torch.zeros(0, dtype=torch.int64)
    bins = _frequency_bins(counts)
    if bins:
        print("\nrows by number of hits (all tables)")
        top = max(n for _, n in bins)
        for label, n in bins:
            print(f"{label:>13}  {n:>10,}  {'#' * max(1 if n else 0, round(40 * n / top))}")
    if args.histogram:
        _plot(args.histogram, bins, snap)
        print(f"histogram saved to {args.histogram}")
    if args.json:
        links = {k: manifest[k] for k in ("parent", "base", "depth") if delta}
        write_json(args.json, {"snapshot": str(snap), "step": manifest["step"], "kind": manifest.get("kind", "full"),
                               **links, "tables": tables, "bytes_on_disk": files, "frequency_bins": bins,
                               "schema": None if schema is None else schema.to_dict()})
    return 0


def _run_schema(snap: Path):
    """The data schema of a snapshot written by `hugeembed train` (None for one of the library API)."""
    from ..data import criteo_schema
    from ..errors import CheckpointError
    from ..training import RunRecord

    try:
        record = RunRecord.from_dict(ckpt.read_extra(snap), str(snap))
    except CheckpointError:
        return None
    return record.schema or criteo_schema()


def _plot(path: str, bins: list[tuple[str, int]], snap: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError('--histogram needs matplotlib: pip install "hugeembed[plot]"') from None
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([b for b, _ in bins], [n for _, n in bins])
    ax.set_yscale("log")
    ax.set_xlabel("hits per id")
    ax.set_ylabel("ids")
    ax.set_title(f"id frequencies in {snap.name}")
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
