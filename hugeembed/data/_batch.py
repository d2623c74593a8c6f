"""Batch: what a training step consumes (dense features, sparse ids, labels)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..errors import InputError
from ..features import SparseFeatures
from ._block import CriteoBlock
from ._schema import CAT_NAMES

__all__ = ["Batch", "sparse_from_ids"]


def sparse_from_ids(ids: torch.Tensor, keys: Sequence[str] = CAT_NAMES) -> SparseFeatures:
    """One id per (sample, feature) ``[B, F]`` -> SparseFeatures with every bag of length 1.

    Vectorised: ``values = ids.t().reshape(-1)`` (feature-major) and ``offsets = arange(F*B + 1)``.

    Example::

        ids [B=2, F=3]         values  = [10, 13, 11, 14, 12, 15]   (f0 b0, f0 b1, f1 b0, ...)
          [[10, 11, 12],       offsets = [0, 1, 2, 3, 4, 5, 6]
           [13, 14, 15]]

        >>> sf = sparse_from_ids(torch.tensor([[10, 11, 12], [13, 14, 15]]), ["a", "b", "c"])
        >>> sf.values().tolist(), sf.batch_size
        ([10, 13, 11, 14, 12, 15], 2)
    """
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise InputError(f"sparse_from_ids: ids must be int64 [B, F], got {ids.dtype} {tuple(ids.shape)}")
    b, f = ids.shape
    if f != len(keys):
        raise InputError(f"sparse_from_ids: {f} id columns but {len(keys)} feature names")
    values = ids.t().contiguous().view(-1)
    if ids.device.type == "cpu":  # numpy's arange is ~20x faster than torch's on a busy 2-core host
        offsets = torch.from_numpy(np.arange(f * b + 1, dtype=np.int64))
    else:
        offsets = torch.arange(f * b + 1, dtype=torch.int64, device=ids.device)
    return SparseFeatures(keys, values, offsets=offsets, batch_size=b)


@dataclass(frozen=True)
class Batch:
    """One training batch.

    Args:
        dense: float32 ``[B, n_dense]`` (Criteo: 13, already log-transformed).
        sparse: SparseFeatures over B samples (Criteo: C1..C26, one id per bag; any
            jagged layout, e.g. multi-hot, is allowed).
        labels: float32 ``[B]``.

    Example::

        batch = next(iter(Loader("shards/", batch_size=4096)))
        batch = batch.to("cuda", non_blocking=True)
        logits = model(batch.dense, batch.sparse)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
    """

    dense: torch.Tensor
    sparse: SparseFeatures
    labels: torch.Tensor

    def __post_init__(self) -> None:
        b = self.labels.shape[0] if self.labels.dim() == 1 else -1
        if b < 0 or self.dense.dim() != 2 or self.dense.shape[0] != b or self.sparse.batch_size != b:
            raise InputError(
                f"Batch: dense {tuple(self.dense.shape)}, sparse batch_size {self.sparse.batch_size} and "
                f"labels {tuple(self.labels.shape)} must agree on B"
            )

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def __len__(self) -> int:
        return self.batch_size

    @staticmethod
    def from_block(block: CriteoBlock, keys: Sequence[str] = CAT_NAMES) -> "Batch":
        """A Batch holding (copies of) the rows of a CriteoBlock."""
        dense = torch.from_numpy(np.array(block.dense, dtype=np.float32, copy=True))
        ids = torch.from_numpy(block.cats) if block.cats.flags.writeable else torch.from_numpy(np.array(block.cats))
        labels = torch.from_numpy(np.array(block.labels, dtype=np.float32, copy=True))
        return Batch(dense, sparse_from_ids(ids, keys), labels)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        """A copy in page-locked memory (needs CUDA), so ``.to("cuda", non_blocking=True)`` overlaps."""
        return Batch(self.dense.pin_memory(), self.sparse.pin_memory(), self.labels.pin_memory())

    def is_pinned(self) -> bool:
        return self.dense.is_pinned() and self.sparse.is_pinned() and self.labels.is_pinned()
