"""Reshaping a SparseFeatures batch: features selected or reordered, the batch split along its
samples, and batches joined (mixin of SparseFeatures, see _sparse.py for the layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .._tensors import concat_ranges
from ..errors import InputError

if TYPE_CHECKING:
    from ._sparse import SparseFeatures

__all__ = ["Reshaping"]


class Reshaping:
    """Mixin of SparseFeatures: select, permute, split and concat_batches."""

    __slots__ = ()

    def select(self, keys: Sequence[str]) -> "SparseFeatures":
        """The features named in `keys`, in that order."""
        return self.permute([self.index_of(k) for k in keys])

    def permute(self, order: Sequence[int]) -> "SparseFeatures":
        """Features reordered (or subset) by position: feature i of the result is ``order[i]``."""
        self._readable(f"permute of SparseFeatures {list(self._keys)}")
        order = list(order)
        for i in order:
            if not 0 <= i < len(self._keys):
                raise IndexError(f"feature position {i} out of range for {len(self._keys)} features")
        b = self._batch_size
        offsets = self._offsets.to(torch.int64)
        lengths = self.lengths_per_feature().to(torch.int64)
        # feature f's ids sit in values[offsets[f*B] : offsets[(f+1)*B]]; with B == 0 both are
        # offsets[0] (slicing offsets[:-1].view(F, B)[:, 0] would find no column there)
        first_bag = torch.arange(len(self._keys) + 1, dtype=torch.int64, device=offsets.device) * b
        bounds = offsets.index_select(0, first_bag)
        starts, totals = bounds[:-1], bounds[1:] - bounds[:-1]
        sel = torch.tensor(order, dtype=torch.int64, device=offsets.device)
        new_lengths = lengths.index_select(0, sel).reshape(-1)
        # gather positions of the selected features' ids, one contiguous range each
        sel_starts, sel_totals = starts.index_select(0, sel), totals.index_select(0, sel)
        pos, _ = concat_ranges(sel_starts, sel_totals)
        values = self._values.index_select(0, pos)
        weights = None if self._weights is None else self._weights.index_select(0, pos)
        new_offsets = torch.zeros(new_lengths.numel() + 1, dtype=self._offsets.dtype, device=offsets.device)
        torch.cumsum(new_lengths, 0, out=new_offsets[1:])
        return type(self)(
            [self._keys[i] for i in order], values, offsets=new_offsets, weights=weights, batch_size=b
        )

    def split(self, batch_sizes: Sequence[int] | int) -> list["SparseFeatures"]:
        """Splits the batch along samples: ``split([2, 3])`` gives batches of 2 and 3 samples.

        An int splits into equal chunks of that size (the last may be smaller).
        """
        self._readable(f"split of SparseFeatures {list(self._keys)}")
        b = self._batch_size
        if isinstance(batch_sizes, int):
            if batch_sizes <= 0:
                raise ValueError(f"split size must be > 0, got {batch_sizes}")
            batch_sizes = [min(batch_sizes, b - s) for s in range(0, b, batch_sizes)] or [0]
        sizes = list(batch_sizes)
        if any(s < 0 for s in sizes) or sum(sizes) != b:
            raise ValueError(f"split sizes {sizes} must be >= 0 and sum to the batch size {b}")
        f = len(self._keys)
        offsets = self._offsets.to(torch.int64)
        lengths = self.lengths_per_feature().to(torch.int64) if f else None
        out: list[SparseFeatures] = []
        start = 0
        for size in sizes:
            if f == 0:
                w = None if self._weights is None else self._weights[:0]
                out.append(type(self)((), self._values[:0], offsets=self._offsets[:1], weights=w, batch_size=size))
                continue
            assert lengths is not None
            sub_lengths = lengths[:, start : start + size]
            bag_starts = offsets[:-1].view(f, b)[:, start] if size else offsets[:f]
            pos, _ = concat_ranges(bag_starts, sub_lengths.sum(dim=1))
            new_offsets = torch.zeros(f * size + 1, dtype=self._offsets.dtype, device=offsets.device)
            torch.cumsum(sub_lengths.reshape(-1), 0, out=new_offsets[1:])
            out.append(
                type(self)(
                    self._keys,
                    self._values.index_select(0, pos),
                    offsets=new_offsets,
                    weights=None if self._weights is None else self._weights.index_select(0, pos),
                    batch_size=size,
                )
            )
            start += size
        return out

    @classmethod
    def concat_batches(cls, batches: Sequence["SparseFeatures"]) -> "SparseFeatures":
        """Joins batches with the same features along samples (the inverse of :meth:`split`)."""
        if not batches:
            raise ValueError("concat_batches needs at least one batch")
        keys = batches[0].keys()
        for i, sf in enumerate(batches):
            if sf.keys() != keys:
                raise InputError(f"concat_batches: batch {i} has features {sf.keys()}, expected {keys}")
        has_w = [sf.weights_or_none() is not None for sf in batches]
        if any(has_w) and not all(has_w):
            raise InputError("concat_batches: either every batch has weights or none has")
        f = len(keys)
        if f == 0:
            w = batches[0].weights()[:0] if all(has_w) else None
            return cls((), batches[0].values()[:0], offsets=batches[0].offsets()[:1], weights=w,
                                  batch_size=sum(sf.batch_size for sf in batches))
        # regroup to feature-major: for each feature, the bags of every batch in turn
        lengths = torch.cat([sf.lengths_per_feature().to(torch.int64) for sf in batches], dim=1)
        for i, sf in enumerate(batches):
            sf._readable(f"concat_batches: batch {i}")
        order = []
        for fi in range(f):
            for sf in batches:
                order.append(sf._feature(keys[fi]))
        values = torch.cat([j.values for j in order])
        weights = torch.cat([j.weights for j in order]) if all(has_w) else None
        return cls(keys, values, lengths=lengths.reshape(-1), weights=weights)
