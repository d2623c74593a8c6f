"""Sparse input: the jagged SparseFeatures layout and its converters."""

from ._sparse import JaggedFeature, SparseFeatures

__all__ = ["SparseFeatures", "JaggedFeature"]
