"""What a lookup is asked to do: the tables it reads (`TableSpec`) and the outputs it makes
(`FeatureSpec`), each validated once when built (functional/_plan.py indexes them into a plan)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..types import Combiner, OutOfRange

__all__ = ["TableSpec", "FeatureSpec"]


@dataclass(frozen=True)
class TableSpec:
    """An embedding table as the lookup sees it.

    Args:
        name: table name (appears in error messages).
        dim: embedding dimension D (> 0).
        num_rows: rows of a static table (ids must be in ``[0, num_rows)``), or None
            for a dynamic (hash) table that accepts any int64 key.
        max_norm: if set, each looked-up row is clipped to this L2 norm before
            combining, exactly as TF's ``clip_by_norm``; the gradient flows through
            the clip.  A table-level setting: every feature reading the table uses it.
    """

    name: str
    dim: int
    num_rows: int | None = None
    max_norm: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"table name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.dim, int) or self.dim <= 0:
            raise ConfigError(f"table {self.name!r}: dim must be a positive int, got {self.dim!r}")
        if self.num_rows is not None and (not isinstance(self.num_rows, int) or self.num_rows < 0):
            raise ConfigError(f"table {self.name!r}: num_rows must be an int >= 0 or None, got {self.num_rows!r}")
        if self.max_norm is not None and not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            raise ConfigError(f"table {self.name!r}: max_norm must be a positive finite number, got {self.max_norm!r}")


@dataclass(frozen=True)
class FeatureSpec:
    """One output of a fused lookup: an input feature looked up in a table.

    Args:
        name: output name (also the input feature's name unless `source` is given).
        table: name of the table it reads.
        source: input feature name in the SparseFeatures batch (default: `name`);
            lets one input feature feed several tables (e.g. wide and deep).
        combiner: ``"sum" | "mean" | "sqrtn"`` pool a bag into one vector,
            ``"none"`` returns one vector per id (sequence features).
        default_id: row looked up, with weight 1, for a bag left empty after
            cleaning (TF's ``default_id``); None gives a zero vector.
        out_of_range: what an id >= num_rows of a static table does:
            ``"error"`` (InputError naming feature, table, id, size), ``"prune"``
            (dropped like ids < 0), ``"default"`` (replaced by `default_id`).
        prune_negative: drop ids < 0 (TF semantics, HugeCTR's -1 padding).  Set
            False for dynamic tables that use the full int64 key range.
    """

    name: str
    table: str
    source: str | None = None
    combiner: Combiner | str = Combiner.MEAN
    default_id: int | None = None
    out_of_range: OutOfRange | str = OutOfRange.ERROR
    prune_negative: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"feature name must be a non-empty string, got {self.name!r}")
        try:
            object.__setattr__(self, "combiner", Combiner.parse(self.combiner, f"feature {self.name!r}"))
            object.__setattr__(self, "out_of_range", OutOfRange.parse(self.out_of_range, f"feature {self.name!r}"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.out_of_range is OutOfRange.DEFAULT and self.default_id is None:
            raise ConfigError(f"feature {self.name!r}: out_of_range='default' needs a default_id")
        if self.default_id is not None and not isinstance(self.default_id, int):
            raise ConfigError(f"feature {self.name!r}: default_id must be an int, got {self.default_id!r}")

    @property
    def source_name(self) -> str:
        return self.source if self.source is not None else self.name
