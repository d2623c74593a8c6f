"""What a fused lookup returns: pooled vectors per feature, and jagged rows for sequence features."""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Iterator

import torch

__all__ = ["PooledEmbeddings", "JaggedEmbeddings"]


@dataclass(frozen=True)
class JaggedEmbeddings:
    """One vector per id of a sequence feature: ``values[offsets[b]:offsets[b+1]]`` is sample b.

    Args:
        values: ``[n, D]`` rows (after cleaning, clipping and weighting).
        offsets: int64 ``[B + 1]``.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def to_padded(self, max_len: int | None = None, padding_value: float = 0.0) -> torch.Tensor:
        """``[B, L, D]`` with rows beyond a sample's length set to `padding_value`."""
        lengths = self.lengths()
        B, D = lengths.numel(), self.values.size(1)
        L = int(lengths.max()) if max_len is None and B else (max_len or 0)
        out = self.values.new_full((B, L, D), padding_value)
        if self.values.numel():
            sample = torch.repeat_interleave(torch.arange(B, device=lengths.device), lengths)
            pos = torch.arange(self.values.size(0), device=lengths.device) - self.offsets[sample]
            keep = pos < L
            if not bool(keep.all()):
                raise ValueError(f"a sequence has {int(lengths.max())} ids, more than max_len={L}")
            out[sample, pos] = self.values
        return out


class PooledEmbeddings:
    """Pooled ``[B, D]`` vectors of several features, stored per dim group as ``[B, F_g, D]``.

    Example::

        >>> out = lookup(tables, batch)
        >>> out["user"].shape          # one feature
        torch.Size([B, 16])
        >>> out.concat().shape         # all pooled features side by side, in plan order
        torch.Size([B, sum_of_dims])
        >>> out.stacked().shape        # [B, F, D] when every feature has the same D (DLRM)
    """

    def __init__(self, names: tuple[str, ...], groups: list[torch.Tensor], where: dict[str, tuple[int, int]],
                 unpooled: dict[str, JaggedEmbeddings] | None = None) -> None:
        self._names = names
        self._groups = groups
        self._where = where  # name -> (group, slot in group)
        self.unpooled: dict[str, JaggedEmbeddings] = unpooled or {}

    def keys(self) -> tuple[str, ...]:
        return self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            g, k = self._where[name]
        except KeyError:
            raise KeyError(f"no pooled feature {name!r}; pooled features: {list(self._names)}") from None
        return self._groups[g][:, k]

    def groups(self) -> list[torch.Tensor]:
        """The ``[B, F_g, D]`` tensors, one per distinct dim, in order of first appearance."""
        return list(self._groups)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {n: self[n] for n in self._names}

    def concat(self) -> torch.Tensor:
        """``[B, sum D]``: the pooled features side by side in plan order (a view when possible)."""
        if len(self._groups) == 1 and \
                list(map(itemgetter(1), map(self._where.__getitem__, self._names))) == list(range(len(self._names))):
            g = self._groups[0]
            return g.reshape(g.size(0), g.size(1) * g.size(2))
        return torch.cat([self[n] for n in self._names], dim=1)

    def stacked(self) -> torch.Tensor:
        """``[B, F, D]`` in plan order; needs one common dim."""
        if len(self._groups) != 1:
            raise ValueError(f"stacked() needs one embedding dim, features have {len(self._groups)} dims")
        order = list(map(itemgetter(1), map(self._where.__getitem__, self._names)))  # (C-level: no Python per feature)
        g = self._groups[0]
        return g if order == list(range(len(order))) else g[:, order]

    def __repr__(self) -> str:
        shapes = {n: tuple(self[n].shape) for n in self._names}
        return f"PooledEmbeddings({shapes}, unpooled={list(self.unpooled)})"
