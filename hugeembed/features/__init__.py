"""Sparse input: the jagged SparseFeatures layout and its converters.

Every converter is a classmethod ``SparseFeatures.from_X`` with a method ``to_X``:
dense padded (HugeCTR), COO, CSR, torch sparse COO, Python lists, dicts and TorchRec.
See ``docs/features.md``.
"""

from ._jagged import JaggedFeature
from ._sparse import SparseFeatures

__all__ = ["SparseFeatures", "JaggedFeature"]
