"""TF-style single-table entry points: safe_embedding_lookup_sparse and its unpooled twin."""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import torch

from ..errors import ConfigError, InputError
from ..features import JaggedFeature, SparseFeatures
from ._lookup import FusedEmbeddingLookup, RowGradHook
from ._outputs import JaggedEmbeddings, PooledEmbeddings
from ._specs import FeatureSpec, TableSpec

__all__ = ["safe_embedding_lookup_sparse", "embedding_lookup_unpooled", "fused_embedding_lookup"]


@functools.lru_cache(maxsize=128)
def _cached_lookup(tables: tuple[TableSpec, ...], features: tuple[FeatureSpec, ...], backend: str) -> FusedEmbeddingLookup:
    return FusedEmbeddingLookup(tables, features, backend=backend)


def _as_features(ids, weights: torch.Tensor | None, name: str | None) -> SparseFeatures:
    """One-feature SparseFeatures from the accepted id containers (the lookup checks it)."""
    if isinstance(ids, SparseFeatures):
        if name is None:
            if ids.num_features != 1:
                raise InputError(f"ids has features {list(ids.keys())}: pass name= to pick one")
            name = ids.keys()[0]
        if ids.keys() == (name,) and weights is None:
            return ids  # as given: the lookup checks its offsets (slicing would hide bad ones)
        # slicing out one feature rebases its offsets, which would make bad offsets look
        # good: check the whole batch first (a convenience path, not the fused hot path)
        ids.index_of(name)
        jf = ids.validate().feature(name)
    elif isinstance(ids, JaggedFeature):
        jf = ids
    elif isinstance(ids, (tuple, list)) and len(ids) in (2, 3):
        jf = JaggedFeature(ids[0], ids[1], ids[2] if len(ids) == 3 else None, name=name or "ids")
    else:
        raise InputError(
            "ids must be a SparseFeatures, a JaggedFeature or a (values, offsets[, weights]) tuple, "
            f"got {type(ids).__name__}"
        )
    w = jf.weights if weights is None else weights
    return SparseFeatures([name or jf.name], jf.values, offsets=jf.offsets, weights=w)


def _single(weight: torch.Tensor, ids, weights, name, table, combiner, default_id, max_norm, out_of_range,
            prune_negative, backend):
    sf = _as_features(ids, weights, name)
    fname = sf.keys()[0]
    tname = table or f"{fname}_table"
    if not isinstance(weight, torch.Tensor):
        raise ConfigError(f"table {tname!r}: weight must be one [num_rows, D] tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ConfigError(f"table {tname!r}: weight must be 2-D [num_rows, D], got shape {tuple(weight.shape)}")
    if not weight.dtype.is_floating_point:  # an integer mean would truncate silently
        raise ConfigError(f"table {tname!r}: weight must be floating point, got {weight.dtype}")
    tspec = TableSpec(tname, weight.size(1), num_rows=weight.size(0), max_norm=max_norm)
    fspec = FeatureSpec(fname, tspec.name, combiner=combiner, default_id=default_id, out_of_range=out_of_range,
                        prune_negative=prune_negative)
    return _cached_lookup((tspec,), (fspec,), backend), sf, fname


def safe_embedding_lookup_sparse(
    weight: torch.Tensor,
    ids,
    weights: torch.Tensor | None = None,
    combiner: str = "mean",
    default_id: int | None = None,
    max_norm: float | None = None,
    *,
    out_of_range: str = "error",
    prune_negative: bool = True,
    name: str | None = None,
    table: str | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Pooled lookup of one sparse feature with TensorFlow's ``safe_embedding_lookup_sparse`` semantics.

    Ids < 0 and ids whose weight is <= 0 are dropped; a bag left empty gets the
    ``default_id`` row (zeros when None); ``max_norm`` clips each row's L2 norm
    before combining; ``combiner`` is ``"sum"``, ``"mean"`` (divide by the sum of
    weights) or ``"sqrtn"`` (divide by the square root of the sum of squared weights).
    An id >= ``num_rows`` raises InputError naming the feature, table, id and size,
    unless ``out_of_range`` is ``"prune"`` or ``"default"``.

    Args:
        weight: ``[num_rows, D]`` table.
        ids: a one-feature ``SparseFeatures`` (or pick one with ``name=``), a
            ``JaggedFeature``, or ``(values, offsets[, weights])``.
        weights: optional per-id weights ``[n]``, overriding those of `ids`.

    Returns:
        ``[B, D]``.  Gradients reach `weight` as a sparse (row-wise) gradient.

    Example::

        ids    = ([3, -1, 3, 7], offsets [0, 2, 2, 4])      bags: [3, -1]  []  [3, 7]
        out    = safe_embedding_lookup_sparse(W, (values, offsets), combiner="mean")
        out[0] = W[3]; out[1] = 0; out[2] = (W[3] + W[7]) / 2
    """
    lookup, sf, fname = _single(weight, ids, weights, name, table, combiner, default_id, max_norm, out_of_range,
                                prune_negative, backend)
    if lookup.plan.features[0].combiner.value == "none":
        raise ConfigError(f"feature {fname!r}: safe_embedding_lookup_sparse pools; use embedding_lookup_unpooled "
                          "for combiner='none'")
    return lookup([weight], sf)[fname]


def embedding_lookup_unpooled(
    weight: torch.Tensor,
    ids,
    weights: torch.Tensor | None = None,
    max_norm: float | None = None,
    *,
    out_of_range: str = "error",
    prune_negative: bool = True,
    name: str | None = None,
    table: str | None = None,
    backend: str = "auto",
) -> JaggedEmbeddings:
    """One vector per id (sequence features): the rows of the ids kept by the same cleaning
    rules as :func:`safe_embedding_lookup_sparse`, clipped to `max_norm` and multiplied by
    their weight.  Empty bags stay empty.  Returns ``JaggedEmbeddings(values [n, D], offsets [B+1])``.
    """
    lookup, sf, fname = _single(weight, ids, weights, name, table, "none", None, max_norm, out_of_range,
                                prune_negative, backend)
    return lookup([weight], sf).unpooled[fname]


def fused_embedding_lookup(
    tables: Mapping[str, torch.Tensor],
    features: SparseFeatures,
    specs: Sequence[FeatureSpec],
    *,
    max_norm: Mapping[str, float] | None = None,
    row_grad_hook: RowGradHook | None = None,
    backend: str = "auto",
) -> PooledEmbeddings:
    """One call for many features over many static tables (different dims allowed).

    Ids are deduplicated once per table and each dim group is pooled by one segment
    reduction.  For repeated calls build a :class:`FusedEmbeddingLookup` once instead.

    Args:
        tables: table name -> ``[num_rows, D]`` weight.
        features: the batch.
        specs: one :class:`FeatureSpec` per output (several may share a table).
        max_norm: optional per-table max norm.
        row_grad_hook: see :class:`FusedEmbeddingLookup.lookup`.
    """
    max_norm = max_norm or {}
    unknown = set(max_norm) - set(tables)
    if unknown:
        raise ConfigError(f"max_norm given for unknown tables {sorted(unknown)}")
    for n, w in tables.items():  # the specs below read the shape of each
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ConfigError(f"table {n!r}: weight must be one [num_rows, D] tensor, got "
                              f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    tspecs = tuple(TableSpec(n, w.size(1), num_rows=w.size(0), max_norm=max_norm.get(n)) for n, w in tables.items())
    lookup = _cached_lookup(tspecs, tuple(specs), backend)
    return lookup(tables, features, row_grad_hook=row_grad_hook)
