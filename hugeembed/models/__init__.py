"""Recommendation models on an EmbeddingCollection: DLRM, DeepFM, Wide & Deep, DCN-v2.

Each model takes ``(dense [B, n_dense], sparse: SparseFeatures)`` and returns logits ``[B]``;
its tables update themselves in backward, and ``model.dense_parameters()`` go to a
``torch.optim`` optimizer.  ``make_model(name, ...)`` builds one with Criteo tables.
See docs/models.md.
"""

from ._base import Fields, RecModel
from ._counts import COUNT_PREFIX, DEFAULT_COUNT_PRIOR, ClickCountUpdater, click_count_tables, count_log_odds
from ._dcn import DCNv2
from ._deepfm import DeepFM
from ._dlrm import DLRM
from ._factory import DEFAULT_ADMIT_MIN_COUNT, DEFAULT_INITIALIZER, MODEL_NAMES, make_model
from ._layers import MLP, CrossNetworkV2, DotInteraction, FactorizationMachine
from ._tables import (
    CRITEO_NUM_DENSE,
    CRITEO_SPARSE_FEATURES,
    FIRST_ORDER_PREFIX,
    criteo_tables,
    deepfm_tables,
    embedding_tables,
    first_order_tables,
    wide_and_deep_tables,
    with_rare_id_options,
    schema_tables,
)
from ._widedeep import WIDE_AND_DEEP_PAPER_DEEP, WideAndDeep

__all__ = [
    "RecModel",
    "Fields",
    "DLRM",
    "DeepFM",
    "WideAndDeep",
    "WIDE_AND_DEEP_PAPER_DEEP",
    "DCNv2",
    "MLP",
    "DotInteraction",
    "FactorizationMachine",
    "CrossNetworkV2",
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
    "MODEL_NAMES",
    "DEFAULT_INITIALIZER",
    "DEFAULT_ADMIT_MIN_COUNT",
    "make_model",
    "COUNT_PREFIX",
    "DEFAULT_COUNT_PRIOR",
    "ClickCountUpdater",
    "click_count_tables",
    "count_log_odds",
]
