"""Stateless lookup and pooling ops with TensorFlow's semantics, fused over many tables.

Stages (see docs/architecture.md): ``prepare`` (clean + dedup), fetch (slots), pool, and a
row-sparse backward that hands each table's touched rows and their summed
gradients to a hook (or returns a sparse gradient).
"""

from ._lookup import FusedEmbeddingLookup, RowGradHook
from ._outputs import JaggedEmbeddings, PooledEmbeddings
from ._plan import LookupPlan, Prepared
from ._specs import FeatureSpec, TableSpec
from ._clip import clip_rows
from ._safe import embedding_lookup_unpooled, fused_embedding_lookup, safe_embedding_lookup_sparse

__all__ = [
    "safe_embedding_lookup_sparse",
    "embedding_lookup_unpooled",
    "fused_embedding_lookup",
    "FusedEmbeddingLookup",
    "RowGradHook",
    "TableSpec",
    "FeatureSpec",
    "LookupPlan",
    "Prepared",
    "PooledEmbeddings",
    "JaggedEmbeddings",
    "clip_rows",
]
