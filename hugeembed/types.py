"""Small enums shared by every part of hugeembed (one axis each: never mixed)."""

from __future__ import annotations

from enum import Enum

__all__ = ["Combiner", "OutOfRange", "Tier", "ShardKind"]


class _StrEnum(str, Enum):
    """An enum that also accepts its plain string value: ``Combiner("mean")``."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | _StrEnum", what: str = ""):
        """Returns the member for `value`, or raises ValueError listing the choices."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            label = f"{what}: " if what else ""
            raise ValueError(f"{label}unknown {cls.__name__} {value!r}; expected one of: {choices}") from None


class Combiner(_StrEnum):
    """How the ids of one bag (one sample of one feature) are reduced to a vector.

    ``SUM``:   sum_i w_i e_i
    ``MEAN``:  sum_i w_i e_i / sum_i w_i
    ``SQRTN``: sum_i w_i e_i / sqrt(sum_i w_i^2)
    ``NONE``:  no pooling: one vector per id (sequence features)
    """

    SUM = "sum"
    MEAN = "mean"
    SQRTN = "sqrtn"
    NONE = "none"


class OutOfRange(_StrEnum):
    """What a static table does with an id >= its number of rows."""

    ERROR = "error"  # raise InputError naming feature, table, id and size
    PRUNE = "prune"  # drop the id, as ids < 0 are dropped
    DEFAULT = "default"  # look up the feature's default_id instead


class Tier(_StrEnum):
    """Where the rows of a table live."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class ShardKind(_StrEnum):
    """How a table is spread over the ranks of a process group."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    DATA_PARALLEL = "data_parallel"
