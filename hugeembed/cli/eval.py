"""hugeembed eval: score a saved model (no training, no insertion of new ids)."""

from __future__ import annotations

import argparse

from ..training import evaluate_snapshot
from ._output import check_output_paths, print_summary, write_json


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="score a snapshot", description=__doc__)
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="snapshot or checkpoint directory (newest)")
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help="data files in the run's format (its schema is in the snapshot) or shards "
                        "(default: the run's own held-out set)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--device", default="auto")
    p.add_argument("--summary-json", metavar="PATH")
    p.add_argument("--predictions", metavar="PATH",
                   help="write one click probability per scored row, in input order (the reference a served "
                        "model is compared with)")


def run(args: argparse.Namespace) -> int:
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive, got {args.batch_size}")
    check_output_paths(summary_json=args.summary_json, predictions=args.predictions)
    m = evaluate_snapshot(args.checkpoint, data=args.data or (), batch_size=args.batch_size, device=args.device,
                          predictions=args.predictions)
    print_summary(f"{m['model']} at step {m['step']} on {m['data']}",
                  [("AUC", m["auc"]), ("log loss", m["logloss"]), ("CTR", m["ctr"]), ("PCTR", m["pctr"]),
                   ("COPC", m["copc"]), ("rows scored", m["count"]), ("snapshot", m["snapshot"])]
                  + ([("predictions", args.predictions)] if args.predictions else []))
    if args.summary_json:
        write_json(args.summary_json, m)
    return 0
