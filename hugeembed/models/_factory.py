"""make_model: a Criteo model by name, with its tables (the CLI's ``--model``)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .._device import canonical_device
from ..data import Schema
from ..errors import ConfigError
from ..nn import EmbeddingCollection, TableConfig
from ..optim import SparseOptimizer
from ..store import Initializer, TruncatedNormal, check_initializer_spec
from ..types import Combiner
from ._base import RecModel
from ._dcn import DCNv2
from ._deepfm import DeepFM
from ._counts import COUNT_PREFIX, click_count_tables
from ._dlrm import DLRM
from ._tables import CRITEO_NUM_DENSE, CRITEO_SPARSE_FEATURES, FIRST_ORDER_PREFIX, Cardinalities, deepfm_tables, \
    embedding_tables, first_order_tables, schema_tables, wide_and_deep_tables, with_rare_id_options
from ._widedeep import WideAndDeep

__all__ = ["MODEL_NAMES", "DEFAULT_INITIALIZER", "DEFAULT_ADMIT_MIN_COUNT", "make_model"]

MODEL_NAMES: tuple[str, ...] = ("dlrm", "deepfm", "widedeep", "dcn")

# make_model's (and so the CLI's) rare-id defaults, measured by bench/quality.py against a
# plain-PyTorch DLRM (nn.Embedding + SparseAdam) on synthetic Criteo files: see docs/quality.md.
# Rows start small: TF's truncated normal with std 1/sqrt(D) = 0.25 gave every rare id a large
# random vector (-0.01 AUC at 100 k rows); U(+-0.01) and U(+-0.05) tie at 200 k rows, and at 1 M
# rows U(+-0.05) leads by 0.003 AUC (the dot interactions of near-zero rows start slowly).
DEFAULT_INITIALIZER = "uniform:0.05"
# Ids seen fewer than 3 times share one trainable row (TableConfig.shared_row), as the
# reference's "unknown id" row: ids seen once or twice in an epoch get no row of their own
# (fewer rows: less memory, less init work) at no loss of AUC, and unseen ids at eval read a
# row trained on rare ids instead of zeros.
DEFAULT_ADMIT_MIN_COUNT = 3

# options each model takes beyond the common ones (anything else given is an error, not ignored)
_OPTIONS = {
    "dlrm": {"bottom_mlp", "top_mlp", "dropout", "first_order", "first_order_optimizer", "click_counts"},
    "deepfm": {"deep", "dropout", "first_order_optimizer"},
    "widedeep": {"deep", "dropout", "first_order_optimizer"},
    "dcn": {"deep", "dropout", "num_cross", "low_rank", "num_experts", "structure"},
}


def make_model(name: str, *, embedding_dim: int, sparse_optimizer: SparseOptimizer,
               device: torch.device | str = "cpu", seed: int = 0, dynamic: bool = True,
               cardinalities: Cardinalities = None, features: Sequence[str] = CRITEO_SPARSE_FEATURES,
               num_dense: int = CRITEO_NUM_DENSE, combiner: Combiner | str = "sum", capacity: int | None = None,
               bottom_mlp: Sequence[int] | None = None, top_mlp: Sequence[int] | None = None,
               deep: Sequence[int] | None = None, dropout: float | None = None, num_cross: int | None = None,
               low_rank: int | None = None, num_experts: int | None = None, structure: str | None = None,
               first_order_optimizer: SparseOptimizer | None = None, first_order: bool | None = None,
               initializer: Initializer | str | None = DEFAULT_INITIALIZER,
               admit_min_count: int = DEFAULT_ADMIT_MIN_COUNT, lr_count_scale: int | None = None,
               first_order_admit_min_count: int | None = None, first_order_lr_count_scale: int | None = None,
               backend: str = "auto", schema: Schema | None = None, click_counts: bool | None = None,
               collection_factory: Callable[..., EmbeddingCollection] | None = None
               ) -> tuple[RecModel, list[nn.Parameter]]:
    """Builds a model and its embedding tables for Criteo-like data; returns ``(model, dense_parameters)``.

    Args:
        name: ``"dlrm" | "deepfm" | "widedeep" | "dcn"`` (:data:`MODEL_NAMES`).
        embedding_dim: D of every embedding table.
        sparse_optimizer: optimizer of the tables, applied in backward.
        device: where tables and dense layers live (``"meta"`` for shape checks).
        seed: seeds the tables' initial rows and the dense layers' initial weights
            (the global RNG is left as it was).
        dynamic: hash tables that grow on first sight of an id (default); False: static
            tables of `cardinalities` rows, whose ids must lie in ``[0, rows)``.
        cardinalities: rows per feature of static tables (only with ``dynamic=False``).
        features: sparse features (default Criteo's C1 .. C26).
        num_dense: dense features (default Criteo's 13).
        combiner: pooling of multi-id bags.
        capacity: dynamic tables: most rows kept per table.
        bottom_mlp, top_mlp: DLRM's MLPs (None: the model's defaults).
        first_order: DLRM: a dim-1 table beside each embedding table (``wide_<table>``, zeros at
            first), its weights added to the logit: a per-id bias (None / False: none).
        deep, dropout: the MLP of DeepFM, Wide&Deep and DCN-v2 (None: the model's defaults); DLRM: `dropout`
            after each hidden layer of its top MLP (None: none).
        num_cross, low_rank, num_experts, structure: DCN-v2's cross network.
        first_order_optimizer: DeepFM / Wide&Deep / DLRM with `first_order`: optimizer of the dim-1 tables
            (None: `sparse_optimizer`; the Wide&Deep paper uses FTRL).
        initializer: initial rows of the embedding tables (the first-order tables of DeepFM
            and Wide&Deep start at zeros): an Initializer or a spec, ``"uniform:SCALE"``,
            ``"normal:STD"``, ``"truncnormal:STD"`` or ``"uniform"`` (U(+-sqrt(1/n)) for a table
            of n rows: static tables, or dynamic ones with a capacity); None: each table
            helper's own default.  Default :data:`DEFAULT_INITIALIZER`.
        admit_min_count: dynamic tables: an id gets its own row at its k-th hit; rarer ids
            (and ids unknown at eval) read one shared trainable row per table.  1: every id
            gets a row at first sight.  Default :data:`DEFAULT_ADMIT_MIN_COUNT`.
        lr_count_scale: per-row learning rate ``lr * min(1, hits / lr_count_scale)``
            (TableConfig.lr_count_scale); None: the full lr for every row.
        first_order_admit_min_count, first_order_lr_count_scale: the dim-1 (per-id bias) tables' own
            admit_min_count / lr_count_scale; None: the other tables'.
        backend: the collection's lookup backend.
        click_counts: DLRM: a frozen table ``count_<feature>`` per sparse feature whose ids' smoothed click
            log-odds, counted from earlier rows, are added to the logit (hugeembed/models/_counts.py; a
            training run keeps them with :class:`~hugeembed.models.ClickCountUpdater`).  None / False: none.
        schema: build the tables a data schema asks for (hugeembed.data.Schema): its sparse features,
            shared tables and combiners, and its dense columns (`features`, `num_dense` and
            `combiner` are then taken from it); dynamic tables only.
        collection_factory: builds the collection from ``(tables, optimizer=, device=, seed=,
            backend=)`` instead of :class:`EmbeddingCollection` -- e.g. a
            ``hugeembed.distributed.ShardedEmbeddingCollection`` with its plan bound
            (``functools.partial(ShardedEmbeddingCollection, plan=plan)``).

    An option the chosen model does not take raises ConfigError (it is never ignored).

    Example::

        model, dense_params = make_model("dlrm", embedding_dim=16, sparse_optimizer=RowWiseAdagrad(lr=0.05))
        opt = torch.optim.Adam(dense_params, lr=1e-3)
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        loss.backward()      # tables updated here
        opt.step(); opt.zero_grad()
    """
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if not isinstance(sparse_optimizer, SparseOptimizer):
        raise ConfigError(f"make_model: sparse_optimizer must be a hugeembed.optim rule, "
                          f"got {type(sparse_optimizer).__name__}")
    given = {k for k, v in dict(bottom_mlp=bottom_mlp, top_mlp=top_mlp, deep=deep, dropout=dropout,
                                num_cross=num_cross, low_rank=low_rank, num_experts=num_experts,
                                structure=structure, first_order_optimizer=first_order_optimizer,
                                first_order=first_order or None, click_counts=click_counts or None).items()
             if v is not None}
    foreign = sorted(given - _OPTIONS[name])
    if foreign:
        raise ConfigError(f"model {name!r} does not take {', '.join(foreign)}; "
                          f"its options: {', '.join(sorted(_OPTIONS[name]))}")
    if name == "dlrm" and first_order_optimizer is not None and not first_order:
        raise ConfigError("model 'dlrm' takes first_order_optimizer only with first_order=True (its dim-1 tables)")
    if dynamic and cardinalities is not None:
        raise ConfigError("cardinalities size static tables: pass dynamic=False with them")
    if not dynamic and cardinalities is None:
        raise ConfigError("static tables (dynamic=False) need cardinalities: rows per feature")
    if capacity is not None and not dynamic:
        raise ConfigError("capacity bounds dynamic tables; static tables have cardinalities")

    if isinstance(initializer, str):
        check_initializer_spec(initializer, "make_model: initializer")
    elif initializer is not None and not isinstance(initializer, Initializer):
        raise ConfigError(f"make_model: initializer must be a hugeembed.store initializer or a spec like "
                          f"'uniform:0.01', got {type(initializer).__name__}")
    common = dict(cardinalities=cardinalities, combiner=combiner, capacity=capacity, initializer=initializer)
    tables: list[TableConfig]
    if schema is not None:
        if not dynamic:
            raise ConfigError("make_model: a schema's tables are dynamic (its ids are hashes or raw values)")
        num_dense = schema.num_dense
        init = TruncatedNormal(0.0, 0.01) if initializer is None and name == "deepfm" else initializer
        tables = schema_tables(schema, embedding_dim, first_order=name in ("deepfm", "widedeep") or bool(first_order),
                               first_order_optimizer=first_order_optimizer, initializer=init, capacity=capacity)
    elif name == "deepfm":
        tables = deepfm_tables(features, embedding_dim, first_order_optimizer=first_order_optimizer, **common)
    elif name == "widedeep":
        tables = wide_and_deep_tables(features, embedding_dim, first_order_optimizer=first_order_optimizer, **common)
    else:
        tables = embedding_tables(features, embedding_dim, **common)
        if first_order:
            tables += first_order_tables(features, cardinalities=cardinalities, combiner=combiner, capacity=capacity,
                                         optimizer=first_order_optimizer)
    tables = [with_rare_id_options(t, admit_min_count, lr_count_scale) if not _is_bias(t) else
              with_rare_id_options(t, _either(first_order_admit_min_count, admit_min_count),
                                   _either(first_order_lr_count_scale, lr_count_scale)) for t in tables]
    if click_counts:  # every id its own row at first sight, unseen ids zeros: no rare-id options
        tables += click_count_tables(list(dict.fromkeys(f for t in tables for f in t.features)))
    device = canonical_device(device)
    factory = EmbeddingCollection if collection_factory is None else collection_factory
    collection = factory(tables, optimizer=sparse_optimizer, device=device, seed=seed, backend=backend)
    if not isinstance(collection, EmbeddingCollection):
        raise ConfigError(f"collection_factory must build an EmbeddingCollection (or a subclass), "
                          f"got {type(collection).__name__}")
    # Dense weights from `seed`, without disturbing the caller's random state, drawn on the
    # CPU and then moved: the same seed gives the same model on every device (the tables'
    # rows already are a function of seed and id).
    init_on = device if device.type == "meta" else torch.device("cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: RecModel
        if name == "dlrm":
            wide = [t.name for t in tables if first_order and t.name.startswith(FIRST_ORDER_PREFIX) and t.dim == 1]
            counts = [t.name for t in tables if click_counts and t.name.startswith(COUNT_PREFIX) and not t.trainable]
            model = DLRM(collection, num_dense, device=init_on, first_order=wide, counts=counts,
                         **_given(bottom_mlp=bottom_mlp, top_mlp=top_mlp, dropout=dropout))
        elif name == "deepfm":
            model = DeepFM(collection, num_dense, device=init_on, **_given(deep=deep, dropout=dropout))
        elif name == "widedeep":
            model = WideAndDeep(collection, num_dense, device=init_on, **_given(deep=deep, dropout=dropout))
        else:
            model = DCNv2(collection, num_dense, device=init_on,
                          **_given(deep=deep, dropout=dropout, num_cross=num_cross, low_rank=low_rank,
                                   num_experts=num_experts, structure=structure))
    if init_on != device:
        model.to(device)  # the dense layers only: the collection is there already
    return model, model.dense_parameters()


def _is_bias(table) -> bool:
    """A first-order (per-id bias) table: dim 1, named with FIRST_ORDER_PREFIX."""
    return table.dim == 1 and table.name.startswith(FIRST_ORDER_PREFIX)


def _either(own, run):
    return run if own is None else own


def _given(**options):
    """The options that were set (not None), so that each model keeps its own defaults for the rest."""
    return {k: v for k, v in options.items() if v is not None}
