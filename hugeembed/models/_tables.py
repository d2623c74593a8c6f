"""Table configs the models expect: one embedding table per feature, and dim-1 first-order tables.

::

    features C1 .. C26
      embedding tables  "C1" .. "C26"         dim D     outputs "C1" .. (or "C1@C1" when a
      first-order tables "wide_C1" .. "wide_C26"  dim 1         wide table reads C1 too)
                                                          outputs "C1@wide_C1" ..
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from ..data import Schema
from ..errors import ConfigError
from ..nn import TableConfig
from ..optim import SparseOptimizer
from ..store import Initializer, TruncatedNormal, Zeros, initializer_from_spec
from ..types import Combiner

__all__ = [
    "CRITEO_NUM_DENSE",
    "CRITEO_SPARSE_FEATURES",
    "FIRST_ORDER_PREFIX",
    "embedding_tables",
    "first_order_tables",
    "criteo_tables",
    "deepfm_tables",
    "wide_and_deep_tables",
    "with_rare_id_options",
    "schema_tables",
]

CRITEO_NUM_DENSE = 13
CRITEO_SPARSE_FEATURES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, 27))
FIRST_ORDER_PREFIX = "wide_"

Cardinalities = Sequence[int] | Mapping[str, int] | None


def _rows(features: Sequence[str], cardinalities: Cardinalities, who: str) -> list[int | None]:
    """Rows per feature: None (dynamic) for all, or from a sequence aligned with `features` or a mapping."""
    if cardinalities is None:
        return [None] * len(features)
    if isinstance(cardinalities, Mapping):
        missing = [f for f in features if f not in cardinalities]
        if missing:
            raise ConfigError(f"{who}: cardinalities has no entry for features {missing}")
        return [cardinalities[f] for f in features]
    if isinstance(cardinalities, (str, bytes)) or len(cardinalities) != len(features):
        raise ConfigError(f"{who}: cardinalities must give one row count per feature ({len(features)}: "
                          f"{list(features)}), got {cardinalities!r}")
    return list(cardinalities)


def _features(features: Sequence[str], who: str) -> tuple[str, ...]:
    if isinstance(features, str):
        features = (features,)
    out = tuple(features)
    if not out:
        raise ConfigError(f"{who}: needs at least one feature")
    return out


def _table(name: str, dim: int, feature: str | tuple[str, ...], rows: int | None, combiner: Combiner | str,
           optimizer: SparseOptimizer | None, initializer: Initializer | str | None, capacity: int | None) -> TableConfig:
    if isinstance(initializer, str):  # a spec (hugeembed.store.initializer_from_spec): "uniform" scales by the rows
        initializer = initializer_from_spec(initializer, rows if rows is not None else capacity, table=name)
    return TableConfig(name, dim, num_rows=rows, features=(feature,) if isinstance(feature, str) else feature,
                       combiner=combiner, optimizer=optimizer, initializer=initializer,
                       capacity=capacity if rows is None else None)


def schema_tables(schema: Schema, dim: int, *, first_order: bool = False, optimizer: SparseOptimizer | None = None,
                  first_order_optimizer: SparseOptimizer | None = None, initializer: Initializer | str | None = None,
                  capacity: int | None = None) -> list[TableConfig]:
    """The dynamic tables a schema asks for: one of dim D per table (a feature's own, or the one several
    features share with ``table = ...``), read by its features and pooling their bags as the schema
    says; with `first_order`, a dim-1 table beside each (DeepFM, Wide&Deep), read by the same features.

    Example::

        schema = load_schema("clicks.toml")     # history shares movie_id's table
        [t.features for t in schema_tables(schema, 16)]   # [('user_id',), ('movie_id', 'history'), ...]
    """
    out = [_table(owner, dim, members, None, schema.table_combiner(owner), optimizer, initializer, capacity)
           for owner, members in schema.tables().items()]
    if first_order:
        out += [_table(FIRST_ORDER_PREFIX + owner, 1, members, None, schema.table_combiner(owner),
                       first_order_optimizer, Zeros(), capacity) for owner, members in schema.tables().items()]
    return out


def with_rare_id_options(table: TableConfig, admit_min_count: int = 1, lr_count_scale: int | None = None
                         ) -> TableConfig:
    """`table` with the rare-id options of make_model and the CLI: on a dynamic table,
    ``admit_min_count=k > 1`` gives ids their own row from their k-th hit and has the rarer
    ones read a shared row (TableConfig.shared_row); `lr_count_scale` applies to every table."""
    changes: dict = {"lr_count_scale": lr_count_scale}
    if table.is_dynamic and admit_min_count != 1:
        changes.update(admit_min_count=admit_min_count, shared_row=True)
    return dataclasses.replace(table, **changes)


def embedding_tables(features: Sequence[str], dim: int, *, cardinalities: Cardinalities = None,
                     combiner: Combiner | str = "sum", optimizer: SparseOptimizer | None = None,
                     initializer: Initializer | str | None = None, capacity: int | None = None) -> list[TableConfig]:
    """One embedding table of dim D per feature, named like the feature.

    Args:
        features: sparse feature names.
        dim: embedding dim D of every table.
        cardinalities: rows per feature (a sequence aligned with `features`, or a
            mapping) for static tables, whose ids must lie in ``[0, rows)``; None:
            dynamic hash tables, any int64 id.
        combiner: how a bag of ids is pooled (``"sum"``, ``"mean"``, ``"sqrtn"``).
        optimizer: sparse optimizer of these tables (None: the collection's).
        initializer: initial rows, or a spec (``"uniform:0.01"``, ``"normal:0.01"``,
            ``"truncnormal:0.25"``, ``"uniform"`` = U(+-sqrt(1/n)) for n rows or capacity;
            see hugeembed.store.initializer_from_spec).  None: TF's truncated normal, std
            1/sqrt(D) (``make_model`` passes its own default, docs/quality.md).
        capacity: dynamic tables: most rows kept each (None: unbounded).
    """
    features = _features(features, "embedding_tables")
    rows = _rows(features, cardinalities, "embedding_tables")
    return [_table(f, dim, f, r, combiner, optimizer, initializer, capacity) for f, r in zip(features, rows)]


def first_order_tables(features: Sequence[str], *, cardinalities: Cardinalities = None,
                       combiner: Combiner | str = "sum", optimizer: SparseOptimizer | None = None,
                       initializer: Initializer | str | None = None, capacity: int | None = None,
                       prefix: str = FIRST_ORDER_PREFIX) -> list[TableConfig]:
    """One dim-1 table per feature (a weight per id: the linear / wide / first-order term).

    Named ``prefix + feature``; initialized to zeros by default (a linear model's usual
    start, which also keeps the initial logit at 0).  Arguments as :func:`embedding_tables`.
    """
    features = _features(features, "first_order_tables")
    rows = _rows(features, cardinalities, "first_order_tables")
    init = Zeros() if initializer is None else initializer
    return [_table(prefix + f, 1, f, r, combiner, optimizer, init, capacity) for f, r in zip(features, rows)]


def criteo_tables(dim: int, *, cardinalities: Cardinalities = None, combiner: Combiner | str = "sum",
                  optimizer: SparseOptimizer | None = None, initializer: Initializer | str | None = None,
                  capacity: int | None = None) -> list[TableConfig]:
    """Embedding tables of dim D for Criteo's C1 .. C26 (DLRM, DCN-v2).

    Criteo's raw ids are 32-bit hex values (hugeembed.data keeps them as they are), so
    the default dynamic tables take them directly; static tables (`cardinalities`) need
    ids already mapped into ``[0, rows)`` by preprocessing.

    Example::

        tables = criteo_tables(dim=16)                                     # 26 hash tables
        tables = criteo_tables(dim=16, cardinalities=CRITEO_KAGGLE_CARDINALITIES)  # static
    """
    return embedding_tables(CRITEO_SPARSE_FEATURES, dim, cardinalities=cardinalities, combiner=combiner,
                            optimizer=optimizer, initializer=initializer, capacity=capacity)


def deepfm_tables(features: Sequence[str], dim: int, *, cardinalities: Cardinalities = None,
                  combiner: Combiner | str = "sum", optimizer: SparseOptimizer | None = None,
                  first_order_optimizer: SparseOptimizer | None = None, initializer: Initializer | str | None = None,
                  capacity: int | None = None) -> list[TableConfig]:
    """Embedding tables (dim D) and first-order tables (dim 1) over the same features, for DeepFM.

    Outputs are ``"C1@C1"`` (embedding) and ``"C1@wide_C1"`` (first order), since two
    tables read each feature.  The embeddings start small (truncated normal, std 0.01,
    unless `initializer` is given): the FM term sums F(F-1)/2 dot products straight into
    the logit, which TF's default std 1/sqrt(D) would make of order sqrt(F^2 / 2D).

    Args:
        first_order_optimizer: sparse optimizer of the dim-1 tables (None: the collection's).
        others: as :func:`embedding_tables`.
    """
    features = _features(features, "deepfm_tables")
    init = TruncatedNormal(0.0, 0.01) if initializer is None else initializer
    return (embedding_tables(features, dim, cardinalities=cardinalities, combiner=combiner, optimizer=optimizer,
                             initializer=init, capacity=capacity)
            + first_order_tables(features, cardinalities=cardinalities, combiner=combiner,
                                 optimizer=first_order_optimizer, capacity=capacity))


def wide_and_deep_tables(features: Sequence[str], dim: int, *, wide_features: Sequence[str] | None = None,
                         cardinalities: Cardinalities = None, combiner: Combiner | str = "sum",
                         optimizer: SparseOptimizer | None = None,
                         first_order_optimizer: SparseOptimizer | None = None,
                         initializer: Initializer | str | None = None, capacity: int | None = None) -> list[TableConfig]:
    """Deep embedding tables (dim D) over `features` and wide tables (dim 1) over `wide_features`.

    Args:
        features: features of the deep part.
        wide_features: features of the wide part (default: `features`); may include
            cross-product features the deep part does not read.
        cardinalities: as :func:`embedding_tables`; a sequence is aligned with
            `features`, a mapping must cover the wide features too.
        first_order_optimizer: sparse optimizer of the wide tables (the paper: FTRL).
        others: as :func:`embedding_tables`.
    """
    features = _features(features, "wide_and_deep_tables")
    wide = features if wide_features is None else _features(wide_features, "wide_and_deep_tables wide_features")
    if cardinalities is not None and not isinstance(cardinalities, Mapping):
        cardinalities = dict(zip(features, _rows(features, cardinalities, "wide_and_deep_tables")))
    return (embedding_tables(features, dim, cardinalities=cardinalities, combiner=combiner, optimizer=optimizer,
                             initializer=initializer, capacity=capacity)
            + first_order_tables(wide, cardinalities=cardinalities, combiner=combiner,
                                 optimizer=first_order_optimizer, capacity=capacity))
