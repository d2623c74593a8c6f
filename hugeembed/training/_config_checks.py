"""What each TrainConfig setting may hold, checked on its own: its type, its range, the choices
it names (models, sparse and dense optimizers), and the numeric settings that need or exclude
another.  TrainConfig.__post_init__ runs check_settings first, then its rules for the sharding
entries and the files a run reads and writes.  An error names the key as the command line spells it."""

from __future__ import annotations

import math
import os
import re
from typing import Any

from ..errors import ConfigError
from ..models import MODEL_NAMES
from ..optim._registry import NAMES as _SPARSE_NAMES
from ..store import check_initializer_spec

__all__ = ["check_settings", "DENSE_OPTIMIZER_CLASSES", "DENSE_OPTIMIZERS", "SPARSE_OPTIMIZERS", "ADAM_OPTIMIZERS",
           "MODELS"]

# the torch.optim class of each dense optimizer name (make_dense_optimizer builds them)
DENSE_OPTIMIZER_CLASSES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}
DENSE_OPTIMIZERS = tuple(DENSE_OPTIMIZER_CLASSES)
SPARSE_OPTIMIZERS = tuple(_SPARSE_NAMES)  # every name hugeembed.optim.make_optimizer accepts
# The sparse optimizers with Adam's betas and eps (the ones sparse_betas / sparse_eps apply to).
ADAM_OPTIMIZERS = tuple(n for n, (rule, _) in _SPARSE_NAMES.items() if rule.name == "adam")
MODELS = MODEL_NAMES


def check_settings(cfg) -> None:
    """Checks (and normalises: paths to strings, tuples) the settings of TrainConfig `cfg` one by
    one; ConfigError naming the first bad one."""
    # types first: a value of the wrong type must fail here, naming its key, not later
    # (e.g. a numeric checkpoint_dir only when the first snapshot is written)
    for name in ("data", "eval_data", "sharding"):
        object.__setattr__(cfg, name, _paths(name, getattr(cfg, name)))
    for name in ("model", "sparse_optimizer", "dense_optimizer", "device", "init"):
        if not isinstance(getattr(cfg, name), str):
            raise ConfigError(f"{_key(name)} must be a string, got {getattr(cfg, name)!r}")
    if cfg.schema is not None:
        if isinstance(cfg.schema, os.PathLike):
            object.__setattr__(cfg, "schema", os.fspath(cfg.schema))
        if not isinstance(cfg.schema, str) or not cfg.schema:
            raise ConfigError(f"schema must be the path of a schema file (TOML), got {cfg.schema!r}")
    if cfg.checkpoint_dir is not None:
        if isinstance(cfg.checkpoint_dir, os.PathLike):
            object.__setattr__(cfg, "checkpoint_dir", os.fspath(cfg.checkpoint_dir))
        if not isinstance(cfg.checkpoint_dir, str) or not cfg.checkpoint_dir:
            raise ConfigError(f"checkpoint-dir must be a directory path (a non-empty string), "
                              f"got {cfg.checkpoint_dir!r}")
    for name in ("resume", "overwrite", "average_dense", "first_order", "stale_scale", "click_counts",
                 "size_from_data"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{_key(name)} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.first_order and cfg.model != "dlrm":
        raise ConfigError(f"first-order adds per-id biases to DLRM; model {cfg.model!r} has its own terms "
                          f"(deepfm and widedeep: first-order tables always)")
    if cfg.click_counts and cfg.model != "dlrm":
        raise ConfigError(f"click-counts adds counted click log-odds to DLRM; model {cfg.model!r} does not take them")
    if cfg.click_counts and cfg.memory_budget is not None:
        raise ConfigError("click-counts writes its count tables in memory: not with --memory-budget (tiered tables)")
    if cfg.click_counts and cfg.staleness:  # the exchange thread reads rows while a step writes its counts
        raise ConfigError(f"click-counts writes its count tables after each step: not with --staleness "
                          f"{cfg.staleness} (only the synchronous --staleness 0)")
    if cfg.click_counts and cfg.data_queue is not None:  # the end-of-run calibration reads the training rows again
        raise ConfigError("click-counts calibrates the model on its training rows at the run's end, which "
                          "--data-queue hands out once: not with --data-queue")
    if cfg.first_order_lr is not None:
        if not (_real(cfg.first_order_lr) and cfg.first_order_lr > 0):
            raise ConfigError(f"first-order-lr must be a positive number, got {cfg.first_order_lr!r}")
        if not cfg.first_order:
            raise ConfigError("first-order-lr is the per-id biases' learning rate: it needs first-order")
    if cfg.dropout is not None and not (_real(cfg.dropout) and 0.0 <= cfg.dropout < 1.0):
        raise ConfigError(f"dropout must be a probability in [0, 1), got {cfg.dropout!r}")
    for name in ("seed", "init_seed"):
        v = getattr(cfg, name)
        if (v is not None or name == "seed") and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63):
            raise ConfigError(f"{name.replace('_', '-')} must be a non-negative integer, got {v!r}")

    def positive(name: str, allow_none: bool = False, allow_zero: bool = False) -> None:
        v = getattr(cfg, name)
        if v is None and allow_none:
            return
        ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
        if not ok:
            raise ConfigError(f"{name.replace('_', '-')} must be a {'non-negative' if allow_zero else 'positive'} "
                              f"integer, got {v!r}")

    if cfg.model not in MODELS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of {', '.join(MODELS)}")
    for name in ("embedding_dim", "batch_size", "epochs", "eval_rows", "synthetic_rows", "prefetch", "log_every"):
        positive(name, allow_zero=name == "prefetch")
    positive("full_checkpoint_every")  # >= 1: 1 writes every snapshot in full
    positive("admit_min_count", allow_none=True)
    positive("lr_count_scale", allow_none=True)
    for name in ("first_order_admit_min_count", "first_order_lr_count_scale"):
        positive(name, allow_none=True)
        if getattr(cfg, name) is not None and not cfg.first_order:
            raise ConfigError(f"{name.replace('_', '-')} sets the per-id bias tables' rare-id rule: it needs "
                              f"first-order")
    positive("choose_epochs", allow_none=True)
    if isinstance(cfg.choose_holdout, bool) or not (isinstance(cfg.choose_holdout, (int, float))
                                                     and 0.0 < cfg.choose_holdout < 1.0):
        raise ConfigError(f"choose-holdout must be a fraction of the training rows in (0, 1), "
                          f"got {cfg.choose_holdout!r}")
    if cfg.choose_epochs is not None and cfg.steps is not None:
        raise ConfigError(f"choose-epochs chooses the run's length in passes over the data: leave steps out "
                          f"(got steps={cfg.steps})")
    if cfg.choose_epochs is not None and not cfg.data:
        raise ConfigError("choose-epochs holds out the last rows of --data: give --data (the synthetic "
                          "generator is endless; give --steps)")
    check_initializer_spec(cfg.init, "init")
    for name in ("steps", "capacity", "threads", "synthetic_max_cardinality", "keep_checkpoints"):
        positive(name, allow_none=True)
    positive("eval_every", allow_zero=True, allow_none=True)
    positive("memory_budget", allow_none=True)
    if cfg.storage_dir is not None:
        if isinstance(cfg.storage_dir, os.PathLike):
            object.__setattr__(cfg, "storage_dir", os.fspath(cfg.storage_dir))
        if not isinstance(cfg.storage_dir, str) or not cfg.storage_dir:
            raise ConfigError(f"storage-dir must be a directory path, got {cfg.storage_dir!r}")
    if (cfg.storage_dir is None) != (cfg.memory_budget is None):
        raise ConfigError("memory-budget and storage-dir go together: the tables' rows live under storage-dir "
                          "with memory-budget bytes of them in memory")
    if cfg.memory_budget is not None and cfg.memory_per_rank is not None:
        raise ConfigError("memory-per-rank sizes a plan of tables held in memory; with memory-budget the tables "
                          "live on disk and memory-budget is what each process keeps in memory: give one of them")
    if cfg.cache_policy not in ("lfu", "lru"):
        raise ConfigError(f"cache-policy must be 'lfu' or 'lru', got {cfg.cache_policy!r}")
    positive("checkpoint_every", allow_zero=True)
    if cfg.sparse_optimizer not in SPARSE_OPTIMIZERS:
        raise ConfigError(f"unknown sparse optimizer {cfg.sparse_optimizer!r}; "
                          f"choose one of {', '.join(SPARSE_OPTIMIZERS)}")
    if cfg.dense_optimizer not in DENSE_OPTIMIZERS:
        raise ConfigError(f"unknown dense optimizer {cfg.dense_optimizer!r}; "
                          f"choose one of {', '.join(DENSE_OPTIMIZERS)}")
    for name in ("sparse_lr", "dense_lr"):
        v = getattr(cfg, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"{name.replace('_', '-')} must be a positive number, got {v!r}")
    cfg._check_adam_settings()
    if isinstance(cfg.lr_decay, bool) or not (isinstance(cfg.lr_decay, (int, float))
                                               and 0.0 <= cfg.lr_decay <= 1.0):
        raise ConfigError(f"lr-decay must be a fraction of the run in [0, 1], got {cfg.lr_decay!r}")
    if isinstance(cfg.eval_fraction, bool) or not (isinstance(cfg.eval_fraction, (int, float))
                                                    and 0.0 < cfg.eval_fraction < 1.0):
        raise ConfigError(f"eval-fraction must be in (0, 1), got {cfg.eval_fraction!r}")
    if cfg.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:[0-9]+", cfg.device):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N (N a GPU number), got {cfg.device!r}")
    positive("memory_per_rank", allow_none=True)
    if isinstance(cfg.dist_timeout, bool) or not isinstance(cfg.dist_timeout, (int, float)) or \
            not (cfg.dist_timeout > 0 and math.isfinite(cfg.dist_timeout)):
        raise ConfigError(f"dist-timeout must be a positive number of seconds, got {cfg.dist_timeout!r}")
    positive("staleness", allow_zero=True)
    positive("dense_staleness", allow_zero=True)
    if not (_real(cfg.stale_compensation) and 0.0 <= cfg.stale_compensation < float("inf")):
        raise ConfigError(f"stale-compensation must be a number >= 0 (lambda), got {cfg.stale_compensation!r}")
    positive("data_queue", allow_none=True)
    positive("servers", allow_zero=True)
    cfg.jitter_spec()


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _key(name: str) -> str:
    return name.replace("_", "-")


def _paths(name: str, value: Any) -> tuple[str, ...]:
    """A path (or sharding entry), or a list of them, as a tuple of strings; ConfigError otherwise."""
    if isinstance(value, (str, os.PathLike)):
        value = (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike)) for v in value):
        return tuple(os.fspath(v) for v in value)
    what = "TABLE=KIND entry" if name == "sharding" else "path"
    raise ConfigError(f"{_key(name)} must be a {what} or a list of them (strings), got {value!r}")
