"""CriteoBlock: a run of parsed Criteo rows as three NumPy arrays (the unit the reader yields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ..errors import InputError
from ._schema import N_CAT, N_DENSE

__all__ = ["CriteoBlock", "rebatch"]


@dataclass(frozen=True, eq=False)
class CriteoBlock:
    """Parsed rows, sample-major, on the host.

    Args:
        dense: float32 ``[n, 13]``, already ``log1p(max(x, 0))`` (missing -> 0).
        cats: int64 ``[n, 26]`` categorical ids (missing -> ``MISSING_IDS[j]``).
        labels: float32 ``[n]``, 0.0 or 1.0.

    Example::

        >>> blk = CriteoBlock.empty()
        >>> len(blk), blk.dense.shape, blk.cats.shape
        (0, (0, 13), (0, 26))
    """

    dense: np.ndarray
    cats: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        n = self.labels.shape[0] if self.labels.ndim == 1 else -1
        if self.dense.dtype != np.float32 or self.dense.ndim != 2 or self.dense.shape[1] != N_DENSE:
            raise InputError(f"CriteoBlock: dense must be float32 [n, {N_DENSE}], got {self.dense.dtype} {self.dense.shape}")
        if self.cats.dtype != np.int64 or self.cats.ndim != 2 or self.cats.shape[1] != N_CAT:
            raise InputError(f"CriteoBlock: cats must be int64 [n, {N_CAT}], got {self.cats.dtype} {self.cats.shape}")
        if self.labels.dtype != np.float32 or n < 0:
            raise InputError(f"CriteoBlock: labels must be float32 [n], got {self.labels.dtype} {self.labels.shape}")
        if self.dense.shape[0] != n or self.cats.shape[0] != n:
            raise InputError(
                f"CriteoBlock: row counts differ: dense {self.dense.shape[0]}, cats {self.cats.shape[0]}, labels {n}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def empty() -> "CriteoBlock":
        return CriteoBlock(
            np.zeros((0, N_DENSE), np.float32), np.zeros((0, N_CAT), np.int64), np.zeros(0, np.float32)
        )

    def slice(self, start: int, stop: int) -> "CriteoBlock":
        """Rows ``start:stop`` (views, no copy)."""
        return CriteoBlock(self.dense[start:stop], self.cats[start:stop], self.labels[start:stop])

    def take(self, index: np.ndarray) -> "CriteoBlock":
        """Rows at positions `index` (a copy), e.g. a permutation."""
        return CriteoBlock(self.dense[index], self.cats[index], self.labels[index])

    @staticmethod
    def concat(blocks: Sequence["CriteoBlock"]) -> "CriteoBlock":
        """Rows of every block in turn (a copy; an empty list gives an empty block)."""
        blocks = [b for b in blocks if len(b)]
        if not blocks:
            return CriteoBlock.empty()
        if len(blocks) == 1:
            return blocks[0]
        return CriteoBlock(
            np.concatenate([b.dense for b in blocks]),
            np.concatenate([b.cats for b in blocks]),
            np.concatenate([b.labels for b in blocks]),
        )

    def equals(self, other: "CriteoBlock") -> bool:
        """Bitwise equality of all three arrays (what a lossless round trip must give)."""
        return (
            len(self) == len(other)
            and np.array_equal(np.ascontiguousarray(self.dense).view(np.uint32), np.ascontiguousarray(other.dense).view(np.uint32))
            and np.array_equal(self.cats, other.cats)
            and np.array_equal(self.labels, other.labels)
        )


def rebatch(blocks: Iterator[CriteoBlock], batch_size: int, drop_last: bool) -> Iterator[CriteoBlock]:
    """Re-cuts a stream of blocks of any sizes into blocks of exactly `batch_size` rows.

    The last, shorter one is yielded unless `drop_last`.  Batches inside one block are
    views (no copy); only a batch straddling two blocks is copied together.
    """
    pending: list[CriteoBlock] = []
    have = 0
    for block in blocks:
        pos = 0
        if pending:  # finish the batch begun in earlier blocks
            take = min(batch_size - have, len(block))
            pending.append(block.slice(0, take))
            have += take
            pos = take
            if have < batch_size:
                continue
            yield CriteoBlock.concat(pending)
            pending, have = [], 0
        while len(block) - pos >= batch_size:
            yield block.slice(pos, pos + batch_size)
            pos += batch_size
        if pos < len(block):
            pending, have = [block.slice(pos, len(block))], len(block) - pos
    if pending and not drop_last:
        yield CriteoBlock.concat(pending)
