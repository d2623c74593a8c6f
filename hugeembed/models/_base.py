"""What every model shares: the collection it reads, input checks, field selection, dense parameters."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from ..errors import ConfigError, InputError
from ..features import SparseFeatures
from ..functional import PooledEmbeddings
from ..nn import EmbeddingCollection
from ..types import Combiner
from ._layers import check_positive_int

__all__ = ["RecModel", "Fields"]



def check_model_inputs(who: str, dense, num_dense: int, sparse) -> None:
    """InputError (prefixed by `who`) unless `dense` is a floating [B, num_dense] tensor and `sparse`
    a SparseFeatures of B samples: what every model (and the served one) takes."""
    if not isinstance(dense, torch.Tensor) or dense.dim() != 2 or dense.shape[1] != num_dense:
        got = tuple(dense.shape) if isinstance(dense, torch.Tensor) else type(dense).__name__
        raise InputError(f"{who}: dense features must be a [B, {num_dense}] tensor, got {got}")
    if not dense.is_floating_point():
        raise InputError(f"{who}: dense features must be floating point, got {dense.dtype}")
    if not isinstance(sparse, SparseFeatures):
        raise InputError(f"{who}: sparse features must be a SparseFeatures, got {type(sparse).__name__}")
    if sparse.batch_size != dense.shape[0]:
        raise InputError(f"{who}: dense has {dense.shape[0]} samples but the sparse batch has {sparse.batch_size}")

class Fields:
    """The pooled outputs of some tables of a collection, read as one block.

    A model part (DLRM's interaction, DeepFM's first-order term) reads the outputs of
    chosen tables; this resolves their output names once and, per batch, returns them
    ``[B, F, D]`` (`stacked`) or ``[B, sum D]`` (`concat`) -- without a copy when they
    are exactly one dim group of the lookup, in order (the common case: one dim per part).

    Args:
        collection: the EmbeddingCollection.
        tables: names of the tables whose outputs are read, or None for every table.
    """

    def __init__(self, collection: EmbeddingCollection, tables: Iterable[str] | None = None) -> None:
        chosen = None if tables is None else set(tables)
        dims = {t.name: t.dim for t in collection.tables}
        self.names: tuple[str, ...] = tuple(o for o, _, t in collection.outputs if chosen is None or t in chosen)
        self.tables: tuple[str, ...] = tuple(t for _, _, t in collection.outputs if chosen is None or t in chosen)
        self.dims: tuple[int, ...] = tuple(dims[t] for t in self.tables)
        plan = collection.lookup.plan
        self._group: int | None = None
        for g, group in enumerate(plan.groups):
            if tuple(plan.features[f].name for f in group.pooled) == self.names:
                self._group = g

    def __len__(self) -> int:
        return len(self.names)

    @property
    def total_dim(self) -> int:
        return sum(self.dims)

    def common_dim(self, who: str) -> int:
        """The one embedding dim of these outputs, or ConfigError naming each table's dim."""
        if len(set(self.dims)) > 1:
            by_table = dict(zip(self.tables, self.dims))
            raise ConfigError(f"{who} needs one embedding dim for all its tables, got "
                              + ", ".join(f"{t!r}: {d}" for t, d in by_table.items()))
        if not self.dims:
            raise ConfigError(f"{who} reads no embedding table")
        return self.dims[0]

    def stacked(self, out: PooledEmbeddings) -> torch.Tensor:
        """``[B, F, D]`` (one common dim)."""
        if self._group is not None:
            return out.groups()[self._group]
        return torch.stack([out[n] for n in self.names], dim=1)

    def concat(self, out: PooledEmbeddings) -> torch.Tensor:
        """``[B, sum D]`` in output order."""
        if self._group is not None:
            g = out.groups()[self._group]
            return g.reshape(g.size(0), g.size(1) * g.size(2))
        return torch.cat([out[n] for n in self.names], dim=1)


class RecModel(nn.Module):
    """Base of the models: an EmbeddingCollection (``self.embeddings``) and a dense part.

    Subclasses build their dense layers and implement ``forward_pooled(dense, pooled) -> logits [B]``;
    ``forward(dense, sparse)`` is :meth:`lookup` (checks inputs, runs the collection) then
    ``forward_pooled``.  The split lets a frozen export run the same dense part on pooled
    embeddings looked up elsewhere (hugeembed.serving).

    The tables train themselves in backward (their sparse optimizers); the rest of the
    model is returned by :meth:`dense_parameters` for a ``torch.optim`` optimizer.
    """

    def __init__(self, collection: EmbeddingCollection, num_dense: int, who: str) -> None:
        super().__init__()
        if not isinstance(collection, EmbeddingCollection):
            raise ConfigError(f"{who} takes a hugeembed.nn.EmbeddingCollection, got {type(collection).__name__}")
        sequence = [t.name for t in collection.tables if t.combiner is Combiner.NONE]
        if sequence:
            raise ConfigError(f"{who} reads pooled features only; tables {sequence} have combiner 'none' "
                              f"(sequence features): give them combiner 'sum', 'mean' or 'sqrtn'")
        self.num_dense = check_positive_int(num_dense, f"{who}: num_dense", minimum=0)
        self.embeddings = collection
        self._who = who

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every parameter except the embedding tables' (which update in backward)."""
        tables = {id(p) for p in self.embeddings.parameters()}
        return [p for p in self.parameters() if id(p) not in tables]

    def forward(self, dense: torch.Tensor, sparse: SparseFeatures) -> torch.Tensor:
        """Logits ``[B]`` (apply a sigmoid for probabilities).

        Args:
            dense: float ``[B, num_dense]``.
            sparse: the batch's sparse features (on the collection's device).
        """
        return self.forward_pooled(dense, self.lookup(dense, sparse))

    def forward_pooled(self, dense: torch.Tensor, out: PooledEmbeddings) -> torch.Tensor:
        """The dense part: logits ``[B]`` from dense features and the batch's pooled embeddings."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_pooled(dense, pooled)")

    def lookup(self, dense: torch.Tensor, sparse: SparseFeatures) -> PooledEmbeddings:
        """Checks ``dense [B, num_dense]`` against the sparse batch, then looks up the embeddings."""
        check_model_inputs(self._who, dense, self.num_dense, sparse)
        return self.embeddings(sparse)

    @staticmethod
    def on(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`x` on the device and dtype of `like`: tables may live on another device than
        the dense layers (host tables, GPU MLP); ``.to`` keeps the gradient path."""
        return x.to(device=like.device, dtype=like.dtype)


def resolve_first_order(collection: EmbeddingCollection, first_order: Sequence[str] | None,
                        who: str) -> tuple[set[str], set[str]]:
    """(first-order tables, embedding tables): given by name, or by default every table of dim 1."""
    names = [t.name for t in collection.tables]
    if first_order is None:
        wide = {t.name for t in collection.tables if t.dim == 1}
    else:
        if isinstance(first_order, str):
            first_order = (first_order,)
        wide = set(first_order)
        unknown = sorted(wide - set(names))
        if unknown:
            raise ConfigError(f"{who}: first-order tables {unknown} are not in the collection; tables: {names}")
        not_scalar = {t.name: t.dim for t in collection.tables if t.name in wide and t.dim != 1}
        if not_scalar:
            raise ConfigError(f"{who}: first-order tables hold one weight per id (dim 1), got dims {not_scalar}")
    deep = set(names) - wide
    if not deep:
        raise ConfigError(f"{who}: every table is a first-order (dim 1) table; add embedding tables "
                          f"(see hugeembed.models.deepfm_tables)")
    return wide, deep
