"""Batch: what a training step consumes (dense features, sparse ids, labels)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..errors import InputError
from ..features import SparseFeatures
from ._block import Block
from ._schema import CAT_NAMES, Schema

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
    def from_block(block: Block, keys: Sequence[str] | Schema = CAT_NAMES) -> "Batch":
        """A Batch holding (copies of) the rows of a Block.

        `keys`: the sparse feature names of a block without bags (default Criteo's C1..C26), or
        the block's Schema, whose sparse features (single-valued in ``cats``, bags in ``bags``) give
        the SparseFeatures in schema order.
        """
        dense = torch.from_numpy(np.array(block.dense, dtype=np.float32, copy=True))
        labels = torch.from_numpy(np.array(block.labels, dtype=np.float32, copy=True))
        if isinstance(keys, Schema):
            if not block.bags:
                keys = keys.sparse_names
            else:
                return Batch(dense, _jagged_sparse(block, keys), labels)
        ids = torch.from_numpy(block.cats) if block.cats.flags.writeable else torch.from_numpy(np.array(block.cats))
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


def _jagged_sparse(block: Block, schema: Schema) -> SparseFeatures:
    """SparseFeatures in schema order from a block's single-valued ids (``cats``) and bags."""
    n = len(block)
    values, lengths = [], []
    single = bag = 0
    for spec in schema.sparse:
        if spec.is_bag:
            b = block.bags[bag]
            bag += 1
            values.append(b.values)
            lengths.append(np.diff(b.offsets))
        else:
            values.append(block.cats[:, single])
            single += 1
            lengths.append(np.ones(n, np.int64))
    if single != block.cats.shape[1] or bag != len(block.bags):
        raise InputError(f"Batch: the block holds {block.cats.shape[1]} single-valued features and "
                         f"{len(block.bags)} bags, the schema names {single} and {bag}")
    offsets = np.zeros(n * len(values) + 1, np.int64)
    np.cumsum(np.concatenate(lengths), out=offsets[1:])
    return SparseFeatures(list(schema.sparse_names), torch.from_numpy(np.concatenate(values)),
                          offsets=torch.from_numpy(offsets), batch_size=n)
