"""TableConfig: one frozen, validated description per embedding table."""

from __future__ import annotations

import dataclasses
import enum
import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..optim import SparseOptimizer
from ..store import Initializer, RowLayout, check_admission
from ._rare import check_count_scalable
from ..types import Combiner, OutOfRange

__all__ = ["TableConfig"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TableConfig:
    """An embedding table: its size, the features that read it, how it pools, learns and grows.

    Args:
        name: table name (unique in a collection; appears in every error message).
        dim: embedding dimension D.
        num_rows: rows of a static table (ids in ``[0, num_rows)``), or None for a
            dynamic hash table that creates a row the first time it sees an id.
        features: input features that read this table (default: ``(name,)``).  A
            feature read by one table is output under its own name; a feature read by
            several tables (wide and deep) is output as ``"feature@table"``.
        combiner: ``"sum" | "mean" | "sqrtn"`` (pooled ``[B, D]`` per feature) or
            ``"none"`` (one vector per id: sequence features).
        initializer: initial rows (default TF's: truncated normal, std 1/sqrt(D)),
            deterministic per (seed, id).
        optimizer: sparse optimizer applied in backward (default: the collection's).
        trainable: False freezes the table (no optimizer, no update).
        max_norm: clip each looked-up row to this L2 norm (TF's max_norm).
        default_id: id looked up for a bag left empty (TF's default_id); None: zeros.
        out_of_range: static tables only: ``"error" | "prune" | "default"``.
        prune_negative: drop ids < 0 (TF/HugeCTR padding).  Set False on a dynamic
            table to use the whole int64 range as keys.
        dtype: dtype of the embedding weights.
        state_dtype: dtype of the optimizer state kept beside each row (None: float32 for
            float16/bfloat16 weights, whose 16-bit state would overflow or stall, else the
            weight dtype).  16-bit weights with float32 state are packed into the float32
            row (see hugeembed.store.RowLayout).
        stochastic_rounding: round updated float16/bfloat16 weights stochastically
            (unbiased, deterministic per seed, step, row and column) instead of to nearest.
        capacity: dynamic tables: most rows kept (None: unbounded; nothing is
            allocated up front either way).
        on_full: dynamic tables at capacity: ``"evict"`` (by eviction_policy, never
            the ids of the current batch) or ``"error"`` (CapacityError).
        eviction_policy: ``"lfu"`` or ``"lru"``.
        admit_min_count: dynamic tables: an id gets a trainable row once seen this
            many times (DeepRec's counter filter); until then it reads zeros.
        shared_row: dynamic tables: ids without a row of their own (waiting for admission
            in training, unknown in eval) read one shared, trainable row instead of zeros,
            as a reference model's "unknown id" row does (its key is -1, which no id reaches:
            needs prune_negative).  With ``admit_min_count=k`` the ids seen fewer than k times
            train this row together; eval reads it for every unseen id, so train and eval
            see rare ids the same way (docs/quality.md).
        lr_count_scale: per-row learning rate by the row's hit count n (ids seen so far,
            this batch included): ``lr * min(1, n / lr_count_scale)``, so a row seen once
            moves 1/lr_count_scale of a full step (None: every row the full lr).  The scale
            applies to the row's weight change, so it needs a rule whose step is linear in
            lr (every rule but FTRL and global Adam).
        admit_probability: dynamic tables: instead of counting, each sighting of an id
            without a row admits it with this probability (DeepRec's probability filter;
            reproducible per seed, id and step); an id not admitted reads zeros and
            leaves no trace.
        max_pending: dynamic tables: ids waiting for admission kept at most (default
            2**20, ~40 MiB of index); past it the least seen are forgotten.
        ttl: dynamic tables: rows not seen for more than `ttl` training steps are
            evicted, checked every `evict_interval` steps.
        evict_norm_below: dynamic tables: rows whose weight L2 norm is below this are
            evicted, checked every `evict_interval` steps (DeepRec's L2-weight eviction).
        evict_interval: steps between ttl and norm checks.
        seed: initializer seed (default: derived from the collection seed and the
            table name, so it does not depend on the order of tables).
        storage_dir: put the table's rows on disk under this directory (a subdirectory per
            table), with at most `memory_budget` bytes of them cached in memory: a table larger
            than memory (see hugeembed.store.TieredStore).  CPU tables only.
        memory_budget: bytes of rows (and 37 B of cache metadata per row) kept in memory for a
            tiered table; the key index is beside it (``store.memory_breakdown()``).
        cache_policy: what the cache of a tiered table keeps: ``"lfu"`` (the most used rows)
            or ``"lru"`` (the most recently used).

    Example::

        TableConfig("user", dim=16, features=("user_id",), combiner="sum",
                    admit_min_count=2, ttl=10_000, optimizer=Adagrad(lr=0.05))
    """

    name: str
    dim: int
    num_rows: int | None = None
    features: tuple[str, ...] = ()
    combiner: Combiner | str = Combiner.MEAN
    initializer: Initializer | None = None
    optimizer: SparseOptimizer | None = None
    trainable: bool = True
    max_norm: float | None = None
    default_id: int | None = None
    out_of_range: OutOfRange | str = OutOfRange.ERROR
    prune_negative: bool = True
    dtype: torch.dtype = torch.float32
    capacity: int | None = None
    on_full: str = "evict"
    eviction_policy: str = "lfu"
    admit_min_count: int = 1
    admit_probability: float | None = None
    shared_row: bool = False
    lr_count_scale: int | None = None
    max_pending: int | None = None
    ttl: int | None = None
    evict_norm_below: float | None = None
    evict_interval: int = 1000
    seed: int | None = None
    state_dtype: torch.dtype | None = None
    stochastic_rounding: bool = False
    storage_dir: str | None = None
    memory_budget: int | None = None
    cache_policy: str = "lfu"

    def __post_init__(self) -> None:
        who = f"table {self.name!r}"
        # the name is part of file names (snapshots, artifacts): '/', '\\' and NUL would leave their directory
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "@./\\\0"):
            raise ConfigError(f"table name must be a non-empty string without '@', '.', '/', '\\' or NUL, "
                              f"got {self.name!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim <= 0:
            raise ConfigError(f"{who}: dim must be a positive int, got {self.dim!r}")
        if self.num_rows is not None and (isinstance(self.num_rows, bool) or not isinstance(self.num_rows, int)
                                          or self.num_rows <= 0):
            raise ConfigError(f"{who}: num_rows must be a positive int or None (dynamic), got {self.num_rows!r}")
        feats = (self.name,) if not self.features else self.features
        if isinstance(feats, str):
            feats = (feats,)
        feats = tuple(feats)
        if not all(isinstance(f, str) and f for f in feats) or len(set(feats)) != len(feats):
            raise ConfigError(f"{who}: features must be distinct non-empty strings, got {feats!r}")
        object.__setattr__(self, "features", feats)
        try:
            object.__setattr__(self, "combiner", Combiner.parse(self.combiner, who))
            object.__setattr__(self, "out_of_range", OutOfRange.parse(self.out_of_range, who))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.optimizer is not None and not isinstance(self.optimizer, SparseOptimizer):
            raise ConfigError(f"{who}: optimizer must be a hugeembed.optim rule, got {type(self.optimizer).__name__}")
        if self.initializer is not None and not isinstance(self.initializer, Initializer):
            raise ConfigError(f"{who}: initializer must be a hugeembed.store initializer, "
                              f"got {type(self.initializer).__name__}")
        if self.max_norm is not None and not (isinstance(self.max_norm, (int, float)) and self.max_norm > 0
                                              and math.isfinite(self.max_norm)):
            raise ConfigError(f"{who}: max_norm must be a positive finite number, got {self.max_norm!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"{who}: dtype must be one of {_DTYPES}, got {self.dtype}")
        if self.default_id is not None and (not isinstance(self.default_id, int) or
                                            (self.num_rows is not None and not 0 <= self.default_id < self.num_rows)):
            raise ConfigError(f"{who}: default_id {self.default_id!r} is not a row of this table")
        if self.out_of_range is OutOfRange.DEFAULT and self.default_id is None:
            raise ConfigError(f"{who}: out_of_range='default' needs a default_id")
        if self.num_rows is not None:
            dynamic_only = {"capacity": self.capacity is not None, "admit_min_count": self.admit_min_count != 1,
                            "admit_probability": self.admit_probability is not None,
                            "max_pending": self.max_pending is not None, "ttl": self.ttl is not None,
                            "evict_norm_below": self.evict_norm_below is not None}
            bad = [k for k, v in dynamic_only.items() if v]
            if bad:
                raise ConfigError(f"{who}: {', '.join(bad)} apply to dynamic tables (num_rows=None) only")
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity <= 0):
            raise ConfigError(f"{who}: capacity must be a positive int or None, got {self.capacity!r}")
        if self.on_full not in ("evict", "error"):
            raise ConfigError(f"{who}: on_full must be 'evict' or 'error', got {self.on_full!r}")
        if self.eviction_policy not in ("lfu", "lru"):
            raise ConfigError(f"{who}: eviction_policy must be 'lfu' or 'lru', got {self.eviction_policy!r}")
        check_admission(self.name, self.admit_min_count, self.admit_probability, self.max_pending)
        if not isinstance(self.shared_row, bool):
            raise ConfigError(f"{who}: shared_row must be True or False, got {self.shared_row!r}")
        if self.shared_row:
            if self.num_rows is not None:
                raise ConfigError(f"{who}: shared_row applies to dynamic tables (num_rows=None) only; a static "
                                  f"table maps unknown ids with out_of_range='default' and default_id")
            if not self.prune_negative:
                raise ConfigError(f"{who}: shared_row keeps its row under key -1, which a table with "
                                  f"prune_negative=False could receive as an id: keep prune_negative=True")
            if self.admit_probability is not None:
                raise ConfigError(f"{who}: shared_row goes with the counter filter (admit_min_count), not "
                                  f"admit_probability={self.admit_probability!r}")
        if self.lr_count_scale is not None and (isinstance(self.lr_count_scale, bool) or not isinstance(
                self.lr_count_scale, int) or self.lr_count_scale < 1):
            raise ConfigError(f"{who}: lr_count_scale must be a positive int (hits) or None, got "
                              f"{self.lr_count_scale!r}")
        if self.lr_count_scale is not None:
            if self.optimizer is not None:
                check_count_scalable(self.optimizer, self.name)
            if self.dtype not in (torch.float32, torch.float64) or self.stochastic_rounding:
                raise ConfigError(f"{who}: lr_count_scale works on float32 / float64 tables without stochastic "
                                  f"rounding, got dtype {self.dtype}"
                                  + (" with stochastic_rounding" if self.stochastic_rounding else ""))
        if self.evict_norm_below is not None and (isinstance(self.evict_norm_below, bool) or not isinstance(
                self.evict_norm_below, (int, float)) or not math.isfinite(self.evict_norm_below)
                or self.evict_norm_below <= 0):
            raise ConfigError(f"{who}: evict_norm_below must be a positive finite number or None, "
                              f"got {self.evict_norm_below!r}")
        if self.ttl is not None and (not isinstance(self.ttl, int) or self.ttl < 1):
            raise ConfigError(f"{who}: ttl must be a positive int (steps) or None, got {self.ttl!r}")
        if not isinstance(self.evict_interval, int) or self.evict_interval < 1:
            raise ConfigError(f"{who}: evict_interval must be a positive int, got {self.evict_interval!r}")
        if not self.trainable and self.optimizer is not None:
            raise ConfigError(f"{who}: a frozen table (trainable=False) takes no optimizer")
        if self.state_dtype is not None and self.state_dtype not in _DTYPES:
            raise ConfigError(f"{who}: state_dtype must be None or one of {_DTYPES}, got {self.state_dtype!r}")
        if (self.storage_dir is None) != (self.memory_budget is None):
            raise ConfigError(f"{who}: storage_dir and memory_budget go together (a tiered table needs both), "
                              f"got storage_dir={self.storage_dir!r}, memory_budget={self.memory_budget!r}")
        if self.storage_dir is not None:
            if not isinstance(self.storage_dir, str) or not self.storage_dir:
                raise ConfigError(f"{who}: storage_dir must be a non-empty path string, got {self.storage_dir!r}")
            if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) \
                    or self.memory_budget < 1:
                raise ConfigError(f"{who}: memory_budget must be a positive int (bytes), got {self.memory_budget!r}")
        if self.cache_policy not in ("lfu", "lru"):
            raise ConfigError(f"{who}: cache_policy must be 'lfu' or 'lru', got {self.cache_policy!r}")
        self.row_layout(self.optimizer)  # validates dtype / state_dtype / stochastic_rounding (and the rule)

    def row_layout(self, rule: SparseOptimizer | None) -> RowLayout:
        """How this table's rows are stored when trained by `rule` (None: frozen, no state).

        ConfigError naming the table when the rule cannot keep its state in that layout
        (global / per-row Adam's integer counter in 16-bit state)."""
        layout = RowLayout(self.dim, self.dtype, 0 if rule is None else rule.state_width(self.dim), self.state_dtype,
                           stochastic_rounding=self.stochastic_rounding, table=self.name)
        if rule is not None:
            rule.check_layout(layout)
        return layout

    @property
    def tiered(self) -> bool:
        """True when the rows live on disk with a memory cache (storage_dir and memory_budget set)."""
        return self.storage_dir is not None

    @property
    def is_dynamic(self) -> bool:
        return self.num_rows is None

    def resolved_seed(self, collection_seed: int) -> int:
        """The initializer seed: explicit, or from the collection seed and the table name."""
        if self.seed is not None:
            return int(self.seed)
        return (int(collection_seed) * 1_000_003 + zlib.crc32(self.name.encode())) & 0x7FFF_FFFF_FFFF_FFFF

    def describe(self) -> dict[str, Any]:
        """Every field as plain data (manifests, summaries, and ranks agreeing on their tables)."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["state_dtype"] = _plain(self.row_layout(None).state_dtype)  # the effective one: None means a default
        return out


def _plain(value: Any) -> Any:
    """A field's value as JSON-able data that is equal across processes for equal configs."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, SparseOptimizer):
        return value.to_dict()
    if dataclasses.is_dataclass(value):  # an initializer: its kind and fields (a callable by its name)
        return {"kind": type(value).__name__, **{f.name: _plain(getattr(value, f.name))
                                                 for f in dataclasses.fields(value)}}
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return value
