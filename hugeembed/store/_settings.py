"""TableSettings: what a table group needs to know of each of its tables, checked once.

A group (store/_static.py, store/_dynamic.py) holds the rows and the key index of several
tables; what may differ between its tables is kept per table: the name, the initializer and
its seed, the optimizer state a new row starts with, and the kind's own settings (a static
table's rows and shard; a dynamic table's capacity, admission, eviction and hash salt).  What
may not differ (the row layout, the device) decides the groups (store/_grouping.py).
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError
from ._admit import DEFAULT_MAX_PENDING, check_admission
from ._common import check_table_config
from ._index import MAX_SLOTS
from ._init import Constant, Initializer, Normal, TruncatedNormal, Uniform, default_initializer
from ._layout import RowLayout

__all__ = ["TableSettings", "draw_salt"]

_BUILTIN_INITIALIZERS = (Constant, Uniform, Normal, TruncatedNormal)


def draw_salt() -> int:
    """A random int64 hash salt (os randomness: nothing an input can predict)."""
    u = secrets.randbits(64)
    return u - (1 << 64) if u >= 1 << 63 else u


@dataclass(frozen=True)
class TableSettings:
    """One table of a group.

    Args:
        name: the table's name (in every error message).
        layout: how a row (weights + optimizer state) is stored.
        initializer: initial weights per (seed, key, column).
        init_state: fills the state of new rows in place (None: zeros).
        seed: the initializer's seed (and stochastic rounding's).
        num_rows: rows of a static table (None: dynamic).
        shard, num_shards: a static table's share: the keys k with k mod num_shards == shard,
            at row k // num_shards.
        capacity, on_full, eviction_policy, admit_min_count, admit_probability, max_pending,
            initial_rows: a dynamic table's (as for HashStore).
        salt: a dynamic table's hash salt (None: drawn at random when the group is built).
    """

    name: str
    layout: RowLayout
    initializer: Initializer | None = None
    init_state: Callable | None = None
    seed: int = 0
    num_rows: int | None = None
    shard: int = 0
    num_shards: int = 1
    capacity: int | None = None
    on_full: str = "evict"
    eviction_policy: str = "lfu"
    admit_min_count: int = 1
    admit_probability: float | None = None
    max_pending: int | None = None
    initial_rows: int = 0
    salt: int | None = None

    def __post_init__(self) -> None:
        name, lay = self.name, self.layout
        if not isinstance(lay, RowLayout):
            raise ConfigError(f"table {name!r}: layout must be a RowLayout, got {type(lay).__name__}")
        if self.initializer is None:
            object.__setattr__(self, "initializer", default_initializer(lay.dim))
        check_table_config(name, lay.dim, lay.state_width, lay.dtype, self.initializer)
        if self.init_state is not None and not callable(self.init_state):
            raise ConfigError(f"table '{name}': init_state must be callable or None")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"table '{name}': seed must be an int, got {self.seed!r}")
        if self.num_rows is not None:
            self._check_static()
        else:
            self._check_dynamic()

    def _check_static(self) -> None:
        name = self.name
        if isinstance(self.num_rows, bool) or not isinstance(self.num_rows, int) or self.num_rows < 1:
            raise ConfigError(f"table '{name}': num_rows must be a positive int, got {self.num_rows!r}")
        if not (isinstance(self.num_shards, int) and isinstance(self.shard, int) and 0 <= self.shard < self.num_shards):
            raise ConfigError(f"table '{name}': shard {self.shard!r} is outside [0, {self.num_shards!r})")

    def _check_dynamic(self) -> None:
        name, cap = self.name, self.capacity
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_SLOTS):
            raise ConfigError(f"table '{name}': capacity must be an int in [1, {MAX_SLOTS}] or None, got {cap!r}")
        if self.on_full not in ("evict", "error"):
            raise ConfigError(f"table '{name}': on_full must be 'evict' or 'error', got {self.on_full!r}")
        if self.eviction_policy not in ("lfu", "lru"):
            raise ConfigError(f"table '{name}': eviction_policy must be 'lfu' or 'lru', got {self.eviction_policy!r}")
        check_admission(name, self.admit_min_count, self.admit_probability, self.max_pending)
        if isinstance(self.initial_rows, bool) or not isinstance(self.initial_rows, int) or self.initial_rows < 0:
            raise ConfigError(f"table '{name}': initial_rows must be an int >= 0, got {self.initial_rows!r}")
        if self.salt is not None and (isinstance(self.salt, bool) or not isinstance(self.salt, int)
                                      or not -(2**63) <= self.salt < 2**63):
            raise ConfigError(f"table '{name}': salt must be an int64, got {self.salt!r}")

    # ------------------------------------------------------------------ derived
    @property
    def static(self) -> bool:
        return self.num_rows is not None

    @property
    def local_rows(self) -> int:
        """Rows a static table's share holds."""
        return len(range(self.shard, self.num_rows, self.num_shards))

    @property
    def row_limit(self) -> int:
        return self.capacity if self.capacity is not None else MAX_SLOTS

    @property
    def pending_limit(self) -> int:
        return DEFAULT_MAX_PENDING if self.max_pending is None else self.max_pending

    @property
    def samples_admission(self) -> bool:
        """Admission by a draw per sighting (admit_probability < 1)."""
        return self.admit_probability is not None and self.admit_probability < 1.0

    @property
    def initializer_may_fail(self) -> bool:
        """A user-supplied initializer (FromCallable, a subclass): its values are made before a
        find-or-insert changes anything, so that one that raises changes nothing."""
        return type(self.initializer) not in _BUILTIN_INITIALIZERS

    def state_template(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """One row of the state new rows start with (`dtype` [1, S]), or None when init_state does
        not mark itself row-independent (store.row_independent): then it runs on every new block."""
        lay = self.layout
        if not getattr(self.init_state, "row_independent", self.init_state is None):
            return None
        row = torch.zeros(1, lay.state_width, dtype=dtype)
        if self.init_state is not None and lay.state_width:
            self.init_state(row)
        return row

    def replace(self, **changes) -> "TableSettings":
        return dataclasses.replace(self, **changes)
