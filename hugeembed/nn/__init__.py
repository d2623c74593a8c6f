"""Embedding tables as nn.Modules: TableConfig, EmbeddingCollection, and its optimizer."""

from ._collection import EmbeddingCollection
from ._config import TableConfig
from ._optimizer import EmbeddingOptimizer

__all__ = ["TableConfig", "EmbeddingCollection", "EmbeddingOptimizer"]
