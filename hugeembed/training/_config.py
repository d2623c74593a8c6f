"""TrainConfig: everything a training run needs, validated, loadable from TOML, saved with snapshots."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError
from ..models import DEFAULT_INITIALIZER
from ._config_checks import ADAM_OPTIMIZERS, _key, _real, check_settings

__all__ = ["TrainConfig"]

# A training run's Adam settings when sparse_betas / sparse_eps are not given, measured by
# bench/quality.py against a plain-PyTorch DLRM (docs/quality.md): no first moment (beta1 0) and
# eps 1e-5 gave +0.004 to +0.007 AUC at 200 k rows (three seeds) and +0.0014 / +0.005 at 1 M rows
# over torch's (0.9, 0.999) / 1e-8.  A row is updated only in the steps that hit it, so its first
# moment mixes gradients of far-apart steps; eps 1e-5, against gradients of ~1e-5 to 1e-3 per
# coordinate, makes a row's step smaller when its gradients are small.
TRAIN_ADAM_BETAS = (0.0, 0.999)
TRAIN_ADAM_EPS = 1e-5
# Evaluations over a run by default (eval_every None): 10 points draw the held-out curves and the
# COPC drift; each costs one pass over eval_rows (32 k rows: ~0.5 s on 2 cores for DLRM).
EVAL_POINTS = 10


@dataclass(frozen=True)
class TrainConfig:
    """A training run.  Defaults give the README's main job: DLRM on synthetic Criteo data.

    Args:
        model: ``dlrm | deepfm | widedeep | dcn``.
        data: data files (Criteo TSV / .gz, or CSV / TSV / Parquet under `schema`) or a converted
            shard directory; None trains on the built-in synthetic Criteo-like generator (labels
            from a known model).
        schema: the TOML schema of `data` (hugeembed.data.load_schema): its columns, features, shared
            tables; None: the shards' own schema, or the built-in Criteo one.  The run keeps the schema
            (with the statistics fitted on `data`) in its snapshots: eval, export and serve read it there.
        eval_data: held-out data (only with `data`: the synthetic generator holds out its own
            rows); None holds out `eval_rows` rows (synthetic: a disjoint range of the generator;
            files: the first `eval_rows` rows, or the first `eval_fraction` of a file too small
            for that).
        embedding_dim, batch_size: as named.
        steps: training steps (None: `epochs` passes over the data; the synthetic data
            is endless, so it then uses `synthetic_rows` rows per epoch).
        sparse_optimizer, sparse_lr: the tables' optimizer (applied in backward).
        sparse_betas, sparse_eps: Adam's betas and eps for the Adam optimizers (``adam``,
            ``lazy_adam``, ``adam_per_row``, ``global_adam``); None: TRAIN_ADAM_BETAS (0, 0.999)
            and TRAIN_ADAM_EPS 1e-5, measured (not torch's (0.9, 0.999), 1e-8).  Other
            optimizers take neither.
        init: initial rows of the embedding tables: ``uniform:SCALE``, ``normal:STD``,
            ``truncnormal:STD``, or ``uniform`` (U(+-sqrt(1/n)) for n rows: needs `capacity`).
        admit_min_count: an id gets its own row at its k-th hit; rarer ids, and ids unseen
            in training, read one shared trainable row per table (1: a row at first sight).
            None: 3 (make_model's default), with any number of processes.
        lr_count_scale: per-row lr ``lr * min(1, hits / lr_count_scale)``; None: off.
        first_order: DLRM: a dim-1 table beside each table, its weights added to the logit (a
            per-id bias, as Wide&Deep's wide part).  Off here; `hugeembed train` turns it on (with
            first_order_lr 0.02, first_order_betas (0.9, 0.999), first_order_eps 1e-8) for data of a
            schema of its own: measured in docs/quality.md.
        dropout: dropout after each hidden layer of the model's MLP (DLRM: its top MLP); None: the model's
            default (DLRM: none).
        click_counts: DLRM: each sparse feature's smoothed click log-odds, counted online from earlier rows
            only (every pass starts from zero counts), added to the logit with a weight per feature and an
            intercept fitted by Newton's method on each batch (hugeembed/models/_counts.py, _count_fit.py);
            tables in memory, synchronous steps (one process, or sharded: the same counts, docs/distributed.md).
            Off here; `hugeembed train` turns it on for data of a schema of its own without a memory budget or
            staleness: measured in docs/quality.md (eighth round).
        first_order_lr: the per-id biases' learning rate (their tables' rule is `sparse_optimizer` with
            this lr, scheduled as `sparse_lr` is); None: `sparse_lr`.  Needs `first_order`.
        first_order_betas, first_order_eps: the per-id biases' own Adam betas and eps (Adam optimizers
            only); None: the run's (`sparse_betas`, `sparse_eps`).  Needs `first_order`.
        first_order_admit_min_count: the per-id bias tables' admission threshold (`admit_min_count` for
            them alone: 1 gives every id its own bias at first sight, as counting gives every value its rate);
            None: the run's.  Needs `first_order`.
        first_order_lr_count_scale: the per-id bias tables' `lr_count_scale` (a bias seen n < N times steps
            at n / N of its lr, as counting shrinks a rare value's rate towards the mean); None: the run's.
            Needs `first_order`.
        choose_epochs: the run's passes over `data`, chosen: a trial run (constant learning rates) trains
            on all but the last `choose_holdout` of the training batches, scoring that tail after each pass,
            for up to this many passes (it stops after 2 without a better tail AUC); the run then makes the
            best trial's passes over all the data.  None: `epochs` passes (or `steps`).  Needs `data` and no
            `steps`; one process; a resumed run chooses again (the trial is seeded: the same count).
            Off by default: measured in docs/quality.md, the tail chose worse counts on time-split data.
        choose_holdout: the share of the training batches (the last ones) `choose_epochs` holds out.
        dense_optimizer, dense_lr: torch optimizer of the MLPs.
        lr_decay: the last fraction of the run over which both learning rates fall linearly
            to 0 (0: constant).  The run's length is its steps, or its epochs of data (a text
            file's counted from its lines); with neither known the rates stay constant.
        eval_every: evaluate every this many steps (0: only at the end; None: about
            EVAL_POINTS times over a run of known length, every 100 steps otherwise), so
            the curves of a short run (``--plot``) still show a trend.
        average_dense: over the lr-decay phase, keep the mean of the dense parameters after each
            step; the run's last step replaces the dense parameters by that mean (Polyak
            averaging).  The end-of-run calibration then follows the whole phase, not its last
            few batches.  Needs lr_decay > 0 and a run whose length is known (steps, or epochs of
            data whose rows are counted or estimated); else it does nothing.
        checkpoint_dir, checkpoint_every, keep_checkpoints: snapshots (atomic, resumable);
            pruning keeps every snapshot a kept delta needs.
        full_checkpoint_every: every this many snapshots one is full and the others are
            deltas (the table rows seen since the previous snapshot, the dense state in full);
            counted along the chain, so a resumed run keeps the rhythm.  1: every snapshot full.
        resume: continue from the newest snapshot in `checkpoint_dir`.  Without it, a run into a
            `checkpoint_dir` that holds snapshots is refused (they are another run's).
        overwrite: a run without `resume` first deletes every snapshot (and LATEST) in
            `checkpoint_dir`, then starts afresh there.
        seed: seeds data order, tables, dense init and everything random.
        init_seed: seeds the tables, the dense init and torch's RNG instead of `seed`, the data
            (synthetic rows, file order) staying `seed`'s: another trajectory on the same samples, to
            measure a comparison's noise floor (None: `seed`).
        capacity: most rows per dynamic table (None: unbounded).
        device: ``auto | cpu | cuda``.
        threads: torch/kernel threads (None: torch's default).
        sharding: distributed runs: per-table placements overriding the proposed plan, as
            ``"TABLE=KIND"`` (``row_wise``, ``column_wise``, ``data_parallel``) or ``"TABLE=table_wise@RANK"``.
        size_from_data: distributed runs: give the planner the rows of the dynamic tables the data
            shows small (the synthetic cardinalities, converted shards' distinct_ids), which it
            replicates; False: they stay unsized (row-wise unless placed), as before 2026-11-28.
        memory_per_rank: distributed runs: bytes of tables each rank may hold (the planner
            refuses a plan that does not fit); None: no limit.
        dist_timeout: distributed runs: seconds any collective may wait before a peer counts
            as dead or hung (the run then stops with a ShardingError naming step and stage).
        staleness: distributed runs: K >= 1 pipelines the table exchanges K steps ahead (batch t
            reads the rows holding the updates of batches up to t-K-1 exactly; docs/distributed.md);
            0: synchronous.
        dense_staleness: distributed runs: D >= 1 all-reduces the dense gradients in the background
            and applies those of step t at step t+D (instead of DDP); 0: at their own step.  With
            staleness K the data-parallel (small, hot) tables' rows are read min(K, D) steps stale
            (with stale_compensation too: their drift counts from that read).
        stale_scale: under staleness, staleness-aware steps: each row's step scaled by 1 / (1 + the
            batches in flight that updated it since its fetch), a delayed dense step (D >= 1) at
            1 / (1 + D) of the dense lr (docs/distributed.md); False: plain steps.
        stale_compensation: under staleness, lambda of the delay-compensated row gradients
            ``g + lambda * g * g * (w_now - w_read)`` (DC-ASGD; docs/distributed.md); 0: off.
        jitter: ``"P:F"``: with probability P a step sleeps F-1 times its compute (simulated
            stragglers, for benchmarks); None: off.
        data_queue: ROWS: ranks take chunks of at most ROWS rows of the epoch from a shared queue as
            they finish one (synthetic data or converted shards; every row trained once per epoch,
            runs equal in distribution, not bit for bit); None: rank r reads slice r of every global batch.
        servers: distributed runs: M of the N processes (the last M ranks) hold the tables' shards and
            read no data (TensorNet / PERSIA parameter servers); the other N - M read the data, run the
            dense model and all-reduce its gradients among themselves; 0: every process does both.
        memory_budget, storage_dir, cache_policy: tables larger than memory: every table's rows
            live on disk under `storage_dir`, `memory_budget` bytes of them (all tables
            together, split by each table's traffic; with several processes, each process's
            budget over the shards it holds) cached in memory by `cache_policy`.
    """

    model: str = "dlrm"
    data: tuple[str, ...] = ()
    schema: str | None = None
    eval_data: tuple[str, ...] = ()
    embedding_dim: int = 16
    # batch, sparse optimizer and lr: measured by bench/quality.py against a plain-PyTorch DLRM
    # (SparseAdam 1e-2, batch 2048) on synthetic Criteo files (docs/quality.md).  Adam with per-row
    # bias correction: a new row's first step is lr, where global-step correction (SparseAdam's)
    # gives a late-born row ~3 lr; +0.001 AUC over it and +0.003 over Adagrad 0.05 at 500 k rows.
    # lr 0.05 (with the Adam settings and the decay below) against 0.04: on 14 data sets (100 k to 2 M
    # rows, CTR 3-25%) within +-0.001 AUC on 10, +0.0041 / +0.0023 at 500 k rows seeds 5 and 9 (the
    # latter with every id frequent), -0.0041 at 1 M rows seed 1; the only setting that met
    # issue 14's targets on all of them (docs/quality.md).  (0.04 had beaten 0.02 by +0.0047 mean AUC
    # at 1 M rows under torch's Adam settings.)  Batch 2048, the reference's:
    # the "batch1024" variant of bench/quality.py measures the alternative (docs/quality.md).
    batch_size: int = 2048
    steps: int | None = 200  # the README's main job: 200 x 2048 rows, about a minute on 2 cores
    epochs: int = 1
    sparse_optimizer: str = "adam_per_row"
    sparse_lr: float = 0.05
    sparse_betas: tuple[float, float] | None = None
    sparse_eps: float | None = None
    init: str = DEFAULT_INITIALIZER
    admit_min_count: int | None = None
    lr_count_scale: int | None = None
    first_order: bool = False
    first_order_lr: float | None = None
    first_order_betas: tuple[float, float] | None = None
    first_order_eps: float | None = None
    first_order_admit_min_count: int | None = None
    first_order_lr_count_scale: int | None = None
    dropout: float | None = None
    click_counts: bool = False
    choose_epochs: int | None = None
    choose_holdout: float = 0.1
    dense_optimizer: str = "adam"
    dense_lr: float = 1e-3
    # both learning rates fall linearly to 0 over the last 20% of the run: measured by
    # bench/quality.py, a constant lr ends with COPC 0.94-1.18 at equal AUC (the end of a
    # constant-lr run is as noisy as its middle); at lr 0.04, 1 M rows, seed 0 the last 10%, 20%,
    # 30% gave COPC 1.058, 0.999, 1.033 (docs/quality.md)
    lr_decay: float = 0.2
    # measured by bench/quality.py: the held-out COPC of the last step's model was 0.977 / 1.034 /
    # 1.029 (200 k rows seeds 0 and 1, 1 M rows seed 0) where the training batches scored before
    # their update gave 1.008 / 0.989 / 1.004 over the decay phase; the averaged model gave
    # 1.011 / 1.017 / 1.010 at the same AUC (docs/quality.md)
    average_dense: bool = True
    eval_every: int | None = None
    eval_rows: int = 32768
    eval_fraction: float = 0.05
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int | None = 3
    full_checkpoint_every: int = 1
    resume: bool = False
    overwrite: bool = False
    seed: int = 0
    init_seed: int | None = None
    capacity: int | None = None
    synthetic_rows: int = 1 << 22
    synthetic_max_cardinality: int | None = 1_000_000
    device: str = "auto"
    threads: int | None = None
    prefetch: int = 2
    log_every: int = 10
    sharding: tuple[str, ...] = ()
    size_from_data: bool = True
    memory_per_rank: int | None = None
    dist_timeout: float = 300.0
    staleness: int = 0
    dense_staleness: int = 0
    stale_scale: bool = True
    stale_compensation: float = 0.0
    jitter: str | None = None
    data_queue: int | None = None
    servers: int = 0
    memory_budget: int | None = None
    storage_dir: str | None = None
    cache_policy: str = "lfu"

    def __post_init__(self) -> None:
        check_settings(self)
        seen = set()
        for item in self.sharding:
            table, eq, kind = item.partition("=")
            if not eq or not table or not kind:
                raise ConfigError(f"sharding entries look like TABLE=KIND (e.g. C3=row_wise, C1=data_parallel, "
                                  f"C9=table_wise@1), got {item!r}")
            if table in seen:  # a dict would silently keep the last one
                raise ConfigError(f"sharding: table {table!r} is placed twice")
            seen.add(table)
        if self.schema is not None and not self.data:
            raise ConfigError("schema describes --data files: give --data too (the synthetic generator has Criteo's "
                              "layout)")
        if self.eval_data and not self.data:
            raise ConfigError("eval-data needs data: training on the synthetic generator evaluates on its own "
                              "held-out rows (give --data too, or leave --eval-data out)")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir (where the snapshots are)")
        if self.overwrite and not self.checkpoint_dir:
            raise ConfigError("--overwrite needs --checkpoint-dir (whose snapshots it deletes)")
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues the snapshots in --checkpoint-dir, --overwrite deletes them: "
                              "give one of them")

    def _check_adam_settings(self) -> None:
        for prefix in ("sparse", "first_order"):
            betas, eps = f"{prefix}_betas", f"{prefix}_eps"
            b = getattr(self, betas)
            if b is not None:  # a TOML file gives a list
                if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(_real(x) and 0.0 <= x < 1.0 for x in b)):
                    raise ConfigError(f"{_key(betas)} must be two numbers in [0, 1) (beta1 beta2), got {b!r}")
                object.__setattr__(self, betas, (float(b[0]), float(b[1])))
            e = getattr(self, eps)
            if e is not None and not (_real(e) and e > 0):
                raise ConfigError(f"{_key(eps)} must be a positive number, got {e!r}")
        given = [_key(n) for n in ("sparse_betas", "sparse_eps", "first_order_betas", "first_order_eps")
                 if getattr(self, n) is not None]
        if given and self.sparse_optimizer not in ADAM_OPTIMIZERS:
            verb = "apply" if len(given) > 1 else "applies"
            raise ConfigError(f"{' and '.join(given)} {verb} to the Adam optimizers ({', '.join(ADAM_OPTIMIZERS)}), "
                              f"not to sparse optimizer {self.sparse_optimizer!r}")
        own = [_key(n) for n in ("first_order_betas", "first_order_eps") if getattr(self, n) is not None]
        if own and not self.first_order:
            raise ConfigError(f"{' and '.join(own)}: the per-id biases' Adam settings need first-order")

    @property
    def model_seed(self) -> int:
        """The seed of the tables, the dense init and torch's RNG: init_seed, or seed."""
        return self.seed if self.init_seed is None else self.init_seed

    def jitter_spec(self) -> tuple[float, float] | None:
        """(P, F) of ``jitter`` "P:F" (0 <= P <= 1, F >= 1), or None."""
        if self.jitter is None:
            return None
        text = str(self.jitter)
        p, sep, f = text.partition(":")
        try:
            prob, factor = float(p), float(f)
        except ValueError:
            prob = factor = float("nan")
        if not sep or not (0.0 <= prob <= 1.0) or not (factor >= 1.0 and math.isfinite(factor)):
            raise ConfigError(f"jitter must be P:F (a probability 0..1, a slowdown factor >= 1), e.g. 0.2:3; "
                              f"got {text!r}")
        return prob, factor

    def sparse_optimizer_options(self) -> dict[str, Any]:
        """The sparse optimizer's settings: its lr, and for Adam its betas and eps (the measured
        training defaults where not given)."""
        out: dict[str, Any] = {"lr": self.sparse_lr}
        if self.sparse_optimizer in ADAM_OPTIMIZERS:
            out["betas"] = self.sparse_betas if self.sparse_betas is not None else TRAIN_ADAM_BETAS
            out["eps"] = self.sparse_eps if self.sparse_eps is not None else TRAIN_ADAM_EPS
        return out

    def first_order_optimizer_options(self) -> dict[str, Any] | None:
        """The per-id bias tables' settings where any differs from the other tables' (their lr, betas,
        eps); None: the run's sparse optimizer as it is."""
        own = {"lr": self.first_order_lr, "betas": self.first_order_betas, "eps": self.first_order_eps}
        own = {k: v for k, v in own.items() if v is not None}
        return {**self.sparse_optimizer_options(), **own} if own else None

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        """A config from a TOML file (keys as the fields, e.g. ``batch_size = 4096``), then `overrides`."""
        from ..data._schema import read_toml

        path = Path(path)
        data = read_toml(path, "config")
        if "train" in data:  # the settings under [train]: nothing else may sit beside it (a typo is never ignored)
            section = data["train"]
            if not isinstance(section, dict):
                raise ConfigError(f"config file {path}: train must be a table of settings ([train]), got {section!r}")
            others = [k for k in data if k != "train"]
            if others:
                what = ", ".join(f"section [{k}]" if isinstance(data[k], dict) else f"key {k}" for k in others)
                raise ConfigError(f"config file {path}: unknown {what} beside [train] (the only section; the "
                                  f"settings go under it)")
        else:  # the settings at the top level: a table there is a section we do not know
            section = data
            tables = [k for k, v in data.items() if isinstance(v, dict)]
            if tables:
                raise ConfigError(f"config file {path}: unknown section [{tables[0]}]; the only section is [train] "
                                  f"(or put the settings at the top level)")
        return cls.from_dict({**section, **overrides}, source=f"config file {path}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        norm = {str(k).replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(norm) - names)
        if unknown:
            raise ConfigError(f"{source}: unknown settings {unknown}; known: {sorted(names)}")
        try:
            return cls(**norm)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # what a run does to its directory when it starts, not a setting of the run: a resume never
        # overwrites, and snapshots stay readable by a hugeembed that does not know the key
        del d["overwrite"]
        if self.init_seed is None:  # likewise: a run without it writes what older code reads
            del d["init_seed"]
        d["data"], d["eval_data"], d["sharding"] = list(self.data), list(self.eval_data), list(self.sharding)
        for name in ("sparse_betas", "first_order_betas"):
            if getattr(self, name) is not None:
                d[name] = list(getattr(self, name))
        return d

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)
