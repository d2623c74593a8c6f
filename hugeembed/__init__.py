"""hugeembed: huge sparse embedding tables for recommendation models in PyTorch.

The parts, bottom to top (each imports only from those above it):
``features`` (SparseFeatures), ``functional`` (fused lookup ops), ``store`` (row
storage), ``optim`` (sparse optimizers), ``nn`` (EmbeddingCollection),
``distributed``, ``checkpoint``, ``data``, ``models``, ``metrics``, ``training``, ``cli``.
"""

from . import errors, types
from .errors import (ArtifactError, CapacityError, CheckpointError, ConfigError, HugeEmbedError, InputError,
                     ShardingError, StoreError)
from .features import JaggedFeature, SparseFeatures
from .types import Combiner, OutOfRange, ShardKind, Tier

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "errors",
    "types",
    "HugeEmbedError",
    "ConfigError",
    "InputError",
    "CapacityError",
    "StoreError",
    "ShardingError",
    "CheckpointError",
    "ArtifactError",
    "Combiner",
    "OutOfRange",
    "Tier",
    "ShardKind",
    "SparseFeatures",
    "JaggedFeature",
]
