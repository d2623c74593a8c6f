"""Block: a run of parsed rows as NumPy arrays (the unit readers yield, shards hold and batches are cut from).

::

    dense   float32 [n, n_dense]      the schema's dense columns, transformed
    cats    int64   [n, n_single]     one id per row of each single-valued sparse feature
    labels  float32 [n]               0.0 / 1.0
    bags    one Bag per bag feature   values int64 [nnz], offsets int64 [n + 1] (row i: values[o[i]:o[i+1]])

Criteo's rows have no bags (``CriteoBlock`` is this class).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ..errors import InputError
from ._schema import N_CAT, N_DENSE

__all__ = ["Block", "Bag", "CriteoBlock", "rebatch"]


@dataclass(frozen=True, eq=False)
class Bag:
    """The ids of one bag feature over n rows, jagged: row i holds ``values[offsets[i]:offsets[i + 1]]``."""

    values: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        o = self.offsets
        if self.values.dtype != np.int64 or self.values.ndim != 1 or o.dtype != np.int64 or o.ndim != 1 or \
                o.size < 1 or o[0] != 0 or o[-1] != self.values.size:
            raise InputError(f"Bag: values must be int64 [nnz] and offsets int64 [n + 1] from 0 to nnz, got "
                             f"{self.values.dtype} {self.values.shape} / {o.dtype} {o.shape}")

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def slice(self, start: int, stop: int) -> "Bag":
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Bag(self.values[lo:hi], self.offsets[start: stop + 1] - lo)

    def take(self, index: np.ndarray) -> "Bag":
        lengths = self.lengths()[index]
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        shift = np.repeat(self.offsets[:-1][index] - offsets[:-1], lengths)
        return Bag(self.values[np.arange(offsets[-1], dtype=np.int64) + shift], offsets)

    @staticmethod
    def concat(bags: Sequence["Bag"]) -> "Bag":
        if len(bags) == 1:
            return bags[0]
        offsets = [np.zeros(1, np.int64)]
        base = 0
        for b in bags:
            offsets.append(b.offsets[1:] + base)
            base += int(b.offsets[-1])
        return Bag(np.concatenate([b.values for b in bags]), np.concatenate(offsets))

    @staticmethod
    def empty() -> "Bag":
        return Bag(np.zeros(0, np.int64), np.zeros(1, np.int64))


@dataclass(frozen=True, eq=False)
class Block:
    """Parsed rows, sample-major, on the host.

    Args:
        dense: float32 ``[n, n_dense]``, transformed as the schema says (Criteo: ``log1p(max(x, 0))``).
        cats: int64 ``[n, n_single]`` ids of the single-valued sparse features (missing -> their missing id).
        labels: float32 ``[n]``, 0.0 or 1.0.
        bags: the bag features' ids (a :class:`Bag` each, n rows), in schema order.

    Example::

        >>> blk = Block.empty()
        >>> len(blk), blk.dense.shape, blk.cats.shape
        (0, (0, 13), (0, 26))
    """

    dense: np.ndarray
    cats: np.ndarray
    labels: np.ndarray
    bags: tuple[Bag, ...] = ()

    def __post_init__(self) -> None:
        n = self.labels.shape[0] if self.labels.ndim == 1 else -1
        if self.dense.dtype != np.float32 or self.dense.ndim != 2:
            raise InputError(f"Block: dense must be float32 [n, n_dense], got {self.dense.dtype} {self.dense.shape}")
        if self.cats.dtype != np.int64 or self.cats.ndim != 2:
            raise InputError(f"Block: cats must be int64 [n, n_single], got {self.cats.dtype} {self.cats.shape}")
        if self.labels.dtype != np.float32 or n < 0:
            raise InputError(f"Block: labels must be float32 [n], got {self.labels.dtype} {self.labels.shape}")
        if self.dense.shape[0] != n or self.cats.shape[0] != n or any(len(b) != n for b in self.bags):
            raise InputError(f"Block: row counts differ: dense {self.dense.shape[0]}, cats {self.cats.shape[0]}, "
                             f"bags {[len(b) for b in self.bags]}, labels {n}")
        object.__setattr__(self, "bags", tuple(self.bags))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @staticmethod
    def empty(n_dense: int = N_DENSE, n_single: int = N_CAT, n_bags: int = 0) -> "Block":
        return Block(np.zeros((0, n_dense), np.float32), np.zeros((0, n_single), np.int64), np.zeros(0, np.float32),
                     tuple(Bag.empty() for _ in range(n_bags)))

    def slice(self, start: int, stop: int) -> "Block":
        """Rows ``start:stop`` (views, no copy, but for the bags' offsets)."""
        return Block(self.dense[start:stop], self.cats[start:stop], self.labels[start:stop],
                     tuple(b.slice(start, stop) for b in self.bags))

    def take(self, index: np.ndarray) -> "Block":
        """Rows at positions `index` (a copy), e.g. a permutation."""
        return Block(self.dense[index], self.cats[index], self.labels[index], tuple(b.take(index) for b in self.bags))

    @staticmethod
    def concat(blocks: Sequence["Block"]) -> "Block":
        """Rows of every block in turn (a copy; an empty list gives an empty Criteo block)."""
        kept = [b for b in blocks if len(b)]
        if not kept:
            return blocks[0] if blocks else Block.empty()
        if len(kept) == 1:
            return kept[0]
        return Block(np.concatenate([b.dense for b in kept]), np.concatenate([b.cats for b in kept]),
                     np.concatenate([b.labels for b in kept]),
                     tuple(Bag.concat([b.bags[k] for b in kept]) for k in range(len(kept[0].bags))))

    def equals(self, other: "Block") -> bool:
        """Bitwise equality of every array (what a lossless round trip must give)."""
        return (
            len(self) == len(other) and len(self.bags) == len(other.bags)
            and self.dense.shape == other.dense.shape
            and np.array_equal(np.ascontiguousarray(self.dense).view(np.uint32),
                               np.ascontiguousarray(other.dense).view(np.uint32))
            and np.array_equal(self.cats, other.cats)
            and np.array_equal(self.labels, other.labels)
            and all(np.array_equal(a.values, b.values) and np.array_equal(a.offsets, b.offsets)
                    for a, b in zip(self.bags, other.bags))
        )


CriteoBlock = Block  # the name of the days when every row was Criteo's


def rebatch(blocks: Iterator[Block], batch_size: int, drop_last: bool) -> Iterator[Block]:
    """Re-cuts a stream of blocks of any sizes into blocks of exactly `batch_size` rows.

    The last, shorter one is yielded unless `drop_last`.  Batches inside one block are
    views (no copy); only a batch straddling two blocks is copied together.
    """
    pending: list[Block] = []
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
            yield Block.concat(pending)
            pending, have = [], 0
        while len(block) - pos >= batch_size:
            yield block.slice(pos, pos + batch_size)
            pos += batch_size
        if pos < len(block):
            pending, have = [block.slice(pos, len(block))], len(block) - pos
    if pending and not drop_last:
        yield Block.concat(pending)
