"""JaggedFeature: the ids of one feature over a batch, as (values, offsets[, weights])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ._sparse import SparseFeatures

__all__ = ["JaggedFeature"]


@dataclass(frozen=True)
class JaggedFeature:
    """The ids of one feature over a batch: ``values[offsets[b]:offsets[b+1]]`` is sample b.

    Args:
        values: int64 ``[n]`` ids.
        offsets: ``[B + 1]`` int32/int64, ``offsets[0] == 0``, ``offsets[-1] == n``.
        weights: optional float ``[n]``, one weight per id.
        name: the feature's name (used in error messages).

    Example::

        >>> jf = JaggedFeature(torch.tensor([1, 5, 7]), torch.tensor([0, 2, 2, 3]), name="user")
        >>> jf.batch_size, jf.lengths().tolist()          # bags: [1, 5] [] [7]
        (3, [2, 0, 1])
    """

    values: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None = None
    name: str = "feature"

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def to_features(self) -> "SparseFeatures":
        """A one-feature SparseFeatures holding these ids."""
        from ._sparse import SparseFeatures  # _sparse imports this module at its top

        return SparseFeatures([self.name], self.values, offsets=self.offsets, weights=self.weights)
