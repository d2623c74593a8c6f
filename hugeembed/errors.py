"""Exceptions raised by hugeembed.

Every error on user input names what it is about (feature, table, rank, file) and the
offending value, so that the message alone says what to fix.
"""

from __future__ import annotations

__all__ = [
    "HugeEmbedError",
    "ConfigError",
    "InputError",
    "CapacityError",
    "StoreError",
    "ShardingError",
    "CheckpointError",
    "ArtifactError",
]


class HugeEmbedError(Exception):
    """Base class of every error hugeembed raises on purpose."""


class ConfigError(HugeEmbedError, ValueError):
    """A configuration (table, optimizer, plan, command-line option) is invalid."""


class InputError(HugeEmbedError, ValueError):
    """A batch or a data file is invalid: bad dtype, offsets, id, weight or line."""


class CapacityError(HugeEmbedError, RuntimeError):
    """A table reached its capacity limit and no eviction policy could make room."""


class StoreError(HugeEmbedError, RuntimeError):
    """A row store is in a state it cannot serve (closed, wrong device, corrupted)."""


class ShardingError(HugeEmbedError, RuntimeError):
    """A sharding plan does not fit, or ranks disagree, or a peer failed."""


class CheckpointError(HugeEmbedError, RuntimeError):
    """A snapshot is missing, corrupted, or does not match the model it is loaded into."""


class ArtifactError(HugeEmbedError, RuntimeError):
    """A serving artifact is missing, damaged or foreign, or a delta does not follow the served version."""
