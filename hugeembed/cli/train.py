"""hugeembed train: train a CTR model (synthetic Criteo-like data unless --data is given; files of your own with
--schema)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..models import DEFAULT_ADMIT_MIN_COUNT, DEFAULT_INITIALIZER
from ..training import DENSE_OPTIMIZERS, MODELS, SPARSE_OPTIMIZERS, TrainConfig, Trainer, default_epochs
from ._output import Progress, check_output_paths, human_bytes, plot_history, print_summary, write_json

# flag -> TrainConfig field, for flags that map one to one
_FIELDS = ("model", "data", "schema", "eval_data", "embedding_dim", "batch_size", "steps", "epochs", "sparse_optimizer",
           "sparse_lr", "dense_optimizer", "dense_lr", "eval_every", "eval_rows", "checkpoint_dir",
           "checkpoint_every", "full_checkpoint_every",
           "keep_checkpoints", "resume", "overwrite", "seed", "init_seed", "capacity", "device", "threads", "eval_fraction",
           "synthetic_rows", "sharding", "size_from_data", "memory_per_rank", "dist_timeout", "staleness", "dense_staleness",
           "stale_scale", "stale_compensation",
           "jitter", "data_queue", "servers", "memory_budget",
           "storage_dir",
           "cache_policy", "init", "admit_min_count", "lr_count_scale", "lr_decay", "sparse_betas",
           "sparse_eps", "average_dense", "first_order", "first_order_lr", "first_order_betas",
           "first_order_eps", "first_order_admit_min_count", "first_order_lr_count_scale", "dropout", "click_counts", "choose_epochs",
           "choose_holdout")

# DLRM on data of a schema of its own: per-id biases (first_order) at lr 0.02 with Adam settings of their own (when the
# run's sparse optimizer is an Adam one): torch's beta1 0.9 and eps 1e-8, not the run's measured beta1 0 and eps 1e-5.
# Measured by bench/quality.py --schema --quick (docs/quality.md, fifth round): against the biases at lr 0.01 under the
# run's settings (the defaults before), NYC flights +0.0126 AUC, MovieLens +0.0020, the set without dense columns
# +0.0005, movies +0.0003, shifted movies -0.0013 (the spread of a run ~0.003); the flights' log loss +0.0083.
# Criteo's runs keep the plain DLRM.
SCHEMA_FIRST_ORDER_LR = 0.02
SCHEMA_FIRST_ORDER_BETAS = (0.9, 0.999)
SCHEMA_FIRST_ORDER_EPS = 1e-8
# DLRM on data of a schema of its own, tables in memory: click counts (each feature's smoothed click log-odds counted
# from earlier rows, weighted by Newton's method), measured in docs/quality.md (eighth round); one process or several
# alike.  Not with --memory-budget, --staleness K > 0 or --data-queue, which the counts do not support: those keep
# the biases alone.

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"6GiB"`` -> 6442450944; plain integers are bytes (argparse type: a bad value is a usage error)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with KB, MB, GB, "
                                         "KiB, MiB, GiB, TiB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model", description=__doc__)
    p.add_argument("--config", metavar="FILE.toml", help="settings file (flags given here override it)")
    p.add_argument("--data", nargs="+", metavar="PATH", help="data files (Criteo TSV/.gz, or CSV/TSV/Parquet with "
                   "--schema) or a converted shard directory (default: the built-in synthetic generator)")
    p.add_argument("--schema", metavar="FILE.toml", help="the data's schema (label, dense and sparse columns; "
                   "`hugeembed schema FILE` writes a first one); default: the shards' own, or Criteo's")
    p.add_argument("--eval-data", nargs="+", metavar="PATH", help="held-out data (default: hold out --eval-rows rows)")
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--embedding-dim", type=int)
    p.add_argument("--batch-size", type=int, help="per process")
    p.add_argument("--steps", type=int, help="training steps (default 200; with --epochs: until the epochs end; "
                   "on data of a --schema: 2 passes under 1 M rows, else 1)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--choose-epochs", type=int, metavar="MAX", help="choose the passes over --data: a trial run "
                   "trains on all but the last --choose-holdout of the rows, scoring them after each pass (up to MAX; "
                   "it stops after 2 passes without a better AUC), then the run makes the best trial's passes over "
                   "all rows")
    p.add_argument("--choose-holdout", type=float, metavar="FRACTION", help="the last share of the training rows "
                   "--choose-epochs holds out (default 0.1)")
    p.add_argument("--sparse-optimizer", choices=SPARSE_OPTIMIZERS)
    p.add_argument("--sparse-lr", type=float)
    p.add_argument("--sparse-betas", type=float, nargs=2, metavar=("BETA1", "BETA2"), help="Adam optimizers' betas "
                   "(default 0 0.999: measured, docs/quality.md)")
    p.add_argument("--sparse-eps", type=float, metavar="EPS", help="Adam optimizers' eps (default 1e-5: measured)")
    r = p.add_argument_group("initial rows and rare ids", "defaults measured against a plain-PyTorch DLRM: "
                             "docs/quality.md")
    r.add_argument("--init", metavar="SPEC", help="initial rows: uniform:SCALE, normal:STD, truncnormal:STD, or "
                   f"uniform (U(+-sqrt(1/n)) for n rows: needs --capacity); default {DEFAULT_INITIALIZER}")
    r.add_argument("--admit-min-count", type=int, metavar="K", help="an id gets its own row at its K-th hit; rarer "
                   "and unseen ids read one shared trainable row per table (1: a row at first sight; "
                   f"default {DEFAULT_ADMIT_MIN_COUNT}, with any number of processes)")
    r.add_argument("--lr-count-scale", type=int, metavar="N", help="per-row learning rate lr * min(1, hits / N): "
                   "rows seen less than N times take smaller steps (default off)")
    p.add_argument("--first-order", action=argparse.BooleanOptionalAction, default=None,
                   help="DLRM: add a per-id bias (a dim-1 table beside each table) to the logit (default off: "
                   "docs/quality.md)")
    p.add_argument("--first-order-lr", type=float, metavar="LR", help="the per-id biases' learning rate "
                   "(default: --sparse-lr; data of a schema of its own: 0.02)")
    p.add_argument("--first-order-betas", type=float, nargs=2, metavar=("BETA1", "BETA2"), help="the per-id biases' "
                   "own Adam betas (default: --sparse-betas; data of a schema of its own: 0.9 0.999)")
    p.add_argument("--first-order-eps", type=float, metavar="EPS", help="the per-id biases' own Adam eps "
                   "(default: --sparse-eps; data of a schema of its own: 1e-8)")
    p.add_argument("--first-order-admit-min-count", type=int, metavar="K", help="the per-id biases' own "
                   "--admit-min-count (1: every id its own bias at first sight; default: --admit-min-count)")
    p.add_argument("--first-order-lr-count-scale", type=int, metavar="N", help="the per-id biases' own "
                   "--lr-count-scale (a bias seen n < N times steps at n/N of its lr; default: --lr-count-scale)")
    p.add_argument("--click-counts", action=argparse.BooleanOptionalAction, default=None,
                   help="DLRM: add each feature's smoothed click log-odds, counted online from earlier rows only, to "
                   "the logit with a weight per feature fitted by Newton's method; tables in memory, synchronous steps "
                   "(default: on for data of a schema of its own without --memory-budget, --staleness or --data-queue, "
                   "with any number of processes, else off; docs/quality.md, eighth round)")
    p.add_argument("--dropout", type=float, metavar="P", help="dropout after each hidden layer of the model's MLP "
                   "(DLRM: its top MLP; default: the model's own, none for DLRM)")
    p.add_argument("--dense-optimizer", choices=DENSE_OPTIMIZERS)
    p.add_argument("--dense-lr", type=float)
    p.add_argument("--lr-decay", type=float, metavar="FRACTION", help="both learning rates fall linearly to 0 over "
                   "this last fraction of the run (default 0.2; 0: constant)")
    p.add_argument("--average-dense", action=argparse.BooleanOptionalAction, default=None,
                   help="end the run with the dense parameters' mean over the --lr-decay phase (default on)")
    p.add_argument("--eval-every", type=int, help="steps between evaluations (0: only at the end)")
    p.add_argument("--eval-rows", type=int, help="rows of the held-out set when no --eval-data is given")
    p.add_argument("--eval-fraction", type=float, help="share of a file smaller than --eval-rows that is held out "
                   "(default 0.05)")
    p.add_argument("--checkpoint-dir", metavar="DIR")
    p.add_argument("--checkpoint-every", type=int, help="steps between snapshots (0: only at the end)")
    p.add_argument("--full-checkpoint-every", type=int, metavar="K", help="every K-th snapshot is full, the others "
                   "are deltas holding only the table rows seen since the previous one (default 1: all full)")
    p.add_argument("--keep-checkpoints", type=int, help="snapshots kept (and any a kept delta needs)")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the newest snapshot "
                   "(without it, a --checkpoint-dir holding snapshots is refused: they are another run's)")
    p.add_argument("--overwrite", action="store_true", default=None, help="delete the snapshots in --checkpoint-dir "
                   "(another run's) before starting afresh there")
    p.add_argument("--seed", type=int)
    p.add_argument("--init-seed", type=int, metavar="SEED", help="seed the tables, the dense init and torch's RNG "
                   "with SEED instead of --seed, the data staying --seed's (another trajectory on the same samples: "
                   "a comparison's noise floor)")
    p.add_argument("--capacity", type=int, help="most rows per embedding table (default unbounded)")
    p.add_argument("--synthetic-rows", type=int, help="rows per epoch of the synthetic data")
    t = p.add_argument_group("tables larger than memory", "every table's rows on disk under --storage-dir, at most "
                             "--memory-budget of them cached in memory (split between tables by their traffic)")
    t.add_argument("--memory-budget", type=parse_bytes, metavar="BYTES", help="bytes of rows in memory, all tables "
                   "together (e.g. 6GiB; with --nproc, each process's); the key index is beside it")
    t.add_argument("--storage-dir", metavar="DIR", help="where the rows live (one directory per run; a crashed run's "
                   "is reused by its --resume only)")
    t.add_argument("--cache-policy", choices=("lfu", "lru"), help="what the memory cache keeps (default lfu)")
    p.add_argument("--device", help="auto, cpu or cuda[:N]")
    p.add_argument("--threads", type=int)
    d = p.add_argument_group("distributed", "several processes (tables sharded over them, dense part under DDP); "
                             "also works under `torchrun --nproc_per_node N -m hugeembed train ...`")
    d.add_argument("--nproc", type=int, metavar="N", help="launch N processes on this machine, their rendezvous on "
                   "127.0.0.1 only (gloo on CPU, NCCL on GPU); --batch-size stays per process")
    d.add_argument("--shard", dest="sharding", action="append", metavar="TABLE=KIND",
                   help="place a table: row_wise, column_wise, data_parallel or table_wise@RANK (repeatable; the "
                        "rest is planned)")
    d.add_argument("--no-size-from-data", dest="size_from_data", action="store_const", const=False,
                   help="leave the dynamic tables unsized for the planner (row-wise unless placed) instead of "
                        "sizing them from the synthetic cardinalities or the shards' distinct ids (replicating "
                        "the small ones)")
    d.add_argument("--memory-per-rank", type=parse_bytes, metavar="BYTES", help="table bytes each process may hold")
    d.add_argument("--dist-timeout", type=float, metavar="SECONDS",
                   help="how long a collective waits for a dead or hung peer before the run stops (default 300)")
    d.add_argument("--staleness", type=int, metavar="K", help="run the table exchanges K steps ahead: a rank stalled "
                   "for a few steps no longer stalls everyone at the tables; batch t reads the updates of batches up "
                   "to t-K-1, exactly (default 0: synchronous; the dense gradients and the data-parallel tables: "
                   "--dense-staleness)")
    d.add_argument("--dense-staleness", type=int, metavar="D", help="all-reduce the dense gradients in the background "
                   "and apply those of step t at step t+D (default 0: at their own step, as DDP does); with --staleness K, the "
                   "data-parallel tables' rows read min(K, D) steps stale too")
    d.add_argument("--stale-scale", action=argparse.BooleanOptionalAction, default=None, help="under staleness: "
                   "each row's step scaled by 1/(1+n), n its updates in flight, and delayed dense steps at 1/(1+D) of "
                   "the dense lr (default on; --no-stale-scale: plain steps)")
    d.add_argument("--stale-compensation", type=float, metavar="LAMBDA", help="under staleness: delay-compensated "
                   "row gradients g + LAMBDA*g*g*(w_now - w_read) (DC-ASGD; default 0: off)")
    d.add_argument("--jitter", metavar="P:F", help="simulated stragglers: with probability P a step sleeps F-1 times "
                   "its compute (benchmarks; default off)")
    d.add_argument("--data-queue", type=int, nargs="?", const=65536, metavar="ROWS", help="ranks take the next "
                   "chunk of ROWS rows (default 65536) of the epoch from a shared queue as they finish one, instead of "
                   "slice r of every global batch: every row trained once per epoch, equal in distribution (not bit "
                   "for bit) to the run without it; synthetic data or converted shards")
    d.add_argument("--servers", type=int, metavar="M", help="M of the processes (the last M ranks) hold the tables' "
                   "shards and read no data, like parameter servers; the others read the data and train the dense "
                   "part (default 0: every process does both)")
    p.add_argument("--summary-json", metavar="PATH", help="write the final figures as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="save the curves: training and held-out log loss, held-out "
                   "AUC (with the best possible one on synthetic data), COPC")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    given: dict[str, Any] = {f: getattr(args, f) for f in _FIELDS if getattr(args, f, None) is not None}
    if ("epochs" in given or "choose_epochs" in given) and "steps" not in given:
        given["steps"] = None  # train for the epochs, not for a step count
    cfg = TrainConfig.from_toml(args.config, **given) if args.config else \
        TrainConfig.from_dict(given, source="command line")
    if not cfg.data or not _schema_data(cfg):
        return cfg
    if not _given(args, given, ("steps", "epochs", "choose_epochs")):
        # data of a schema of its own, and no run length: passes over it by its size (training.default_epochs)
        cfg = cfg.replace(steps=None, epochs=default_epochs(cfg))
    if cfg.model == "dlrm" and not _given(args, given, ("first_order", "first_order_lr")):
        cfg = cfg.replace(first_order=True, first_order_lr=SCHEMA_FIRST_ORDER_LR)
        if "betas" in cfg.sparse_optimizer_options() and \
                not _given(args, given, ("first_order_betas", "first_order_eps")):  # an Adam rule: its settings
            cfg = cfg.replace(first_order_betas=SCHEMA_FIRST_ORDER_BETAS, first_order_eps=SCHEMA_FIRST_ORDER_EPS)
    # click counts need the tables in memory, synchronous steps and fixed slices of the data (any number of processes)
    if cfg.model == "dlrm" and not _given(args, given, ("click_counts",)) and cfg.memory_budget is None \
            and not cfg.staleness and cfg.data_queue is None:
        cfg = cfg.replace(click_counts=True)
    return cfg


def _given(args: argparse.Namespace, given: dict[str, Any], keys: tuple[str, ...]) -> bool:
    """Whether the flags or the config file set any of `keys`."""
    if any(k in given for k in keys):
        return True
    if not args.config:
        return False
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    data = tomllib.loads(Path(args.config).read_text())
    section = data.get("train", data)
    return any(k in section or k.replace("_", "-") in section for k in keys)


def _schema_data(cfg: TrainConfig) -> bool:
    """True for data under a schema other than Criteo's (whose runs keep their 200 steps)."""
    from ..training import run_schema

    if cfg.schema:
        return True
    paths = list(cfg.data)
    return len(paths) == 1 and Path(paths[0]).is_dir() and not run_schema(cfg).is_criteo()


def summary_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    rows = [("model", s["model"]), ("steps", s["steps"]), ("samples", s["samples"]),
            ("samples/s (training)", s["samples_per_s"]), ("held-out AUC", s.get("auc", float("nan"))),
            ("held-out log loss", s.get("logloss", float("nan"))), ("CTR", s.get("ctr", float("nan"))),
            ("PCTR", s.get("pctr", float("nan"))), ("COPC", s.get("copc", float("nan")))]
    if "bayes_auc" in s:
        rows.append(("best possible AUC (true model)", s["bayes_auc"]))
    rows += [("final training loss", s["final_train_loss"]), ("embedding rows", s["table_rows"]),
             ("embedding memory", human_bytes(s["table_bytes"])), ("dense parameters", human_bytes(s["dense_bytes"])),
             *([("cache hit rate", f"{s['cache_hit_rate']:.1%}"),
                ("table bytes in memory / on disk",
                 f"{human_bytes(s['table_bytes_resident'])} / {human_bytes(s['table_bytes_stored'])}")]
               if "cache_hit_rate" in s else []),
             ("processes", f"{s['world_size']} ({s['servers']} of them servers)" if s.get("servers") else s["world_size"]),
             ("device", s["device"]), ("training time", f"{s['train_seconds']:.1f} s")]
    return rows


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def run(args: argparse.Namespace) -> int:
    from ..distributed import DistEnv, init_from_env
    from ..training import launch_local

    cfg = config_from_args(args)
    check_output_paths(summary_json=args.summary_json, plot=args.plot)
    env = DistEnv.from_environ(os.environ)
    if args.nproc is not None:
        if env is not None:
            raise ValueError("--nproc launches the processes itself: under torchrun (or --nproc), leave it out")
        if cfg.servers or cfg.sharding:  # bad counts, plans that fit no server, --shard placements the tables
            # refuse (a column-wise dim the ranks do not divide): one line here, before any process starts
            from ..training import check_server_plan

            check_server_plan(cfg, args.nproc)
        # the processes inherit this terminal; each parses the same flags (without --nproc); their
        # rendezvous listens on the loopback interface only
        return launch_local(args.nproc, _without_nproc(list(args.argv)))
    if args.plot:  # fail on a missing matplotlib before training, not after it
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError('--plot needs matplotlib: pip install "hugeembed[plot]"')
    if (env is None or env.world_size == 1) and (cfg.sharding or cfg.memory_per_rank is not None or cfg.staleness
                                                  or cfg.dense_staleness or cfg.servers):
        raise ConfigError("--shard / --memory-per-rank / --staleness / --dense-staleness / --servers are about several "
                          "processes; with one process they would be ignored: add --nproc N (or run under torchrun "
                          "with N > 1)")
    rank, world = 0, 1
    if env is not None:
        device = init_from_env(env, cfg.device, cfg.dist_timeout)
        cfg = cfg.replace(device=str(device))
        rank, world = env.rank, env.world_size
    summary = Trainer(cfg, progress=Progress(enabled=not args.quiet and rank == 0, notes=rank == 0), rank=rank,
                      world_size=world).fit()
    if env is not None:  # on failure the process just exits: a dead peer cannot take part in teardown
        _leave_group()
    if rank != 0:
        return 0  # rank 0 prints for everyone
    print_summary("summary", summary_rows(summary))
    if args.summary_json:
        write_json(args.summary_json, {k: v for k, v in summary.items()})
    if args.plot:
        plot_history(args.plot, summary["history"], f"{cfg.model}, {summary['steps']} steps",
                     best_auc=summary.get("bayes_auc"))
        print(f"curves saved to {Path(args.plot)}")
    return 0


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
