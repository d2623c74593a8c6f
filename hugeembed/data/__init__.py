"""Data: Criteo TSV reading, conversion to binary shards, batching, synthetic data.

::

    Criteo TSV/.gz --CriteoReader--> CriteoBlock (numpy) --Loader--> Batch(dense, sparse, labels)
          |                               ^
          +--convert--> shards/ (.npy + manifest.json) --ShardSet
    SyntheticCriteo (planted logistic model) --rows()/batches()--> CriteoBlock / Batch

Conventions: dense = log(1 + max(x, 0)) (empty -> 0); categorical id = hex value of the
field; an empty categorical field of feature C{j+1} -> ``MISSING_IDS[j] = 2**32 + j``.
"""

from ._batch import Batch, sparse_from_ids
from ._block import CriteoBlock, rebatch
from ._convert import ConvertProgress, ConvertSummary, convert
from ._criteo import CriteoReader, FileSummary, ReadSummary, count_lines, read_criteo
from ._loader import Loader, rank_range
from ._parse import native_parser_available, parse_buffer
from ._schema import CAT_NAMES, DENSE_NAMES, MISSING_ID_BASE, MISSING_IDS, N_CAT, N_DENSE, missing_id
from ._shards import ShardInfo, ShardSet
from ._synthetic import CRITEO_KAGGLE_CARDINALITIES, BayesMetrics, RawRows, SyntheticConfig, SyntheticCriteo
from ._tsv import format_criteo_lines, write_criteo_tsv

__all__ = [
    "Batch",
    "sparse_from_ids",
    "CriteoBlock",
    "CriteoReader",
    "ReadSummary",
    "FileSummary",
    "read_criteo",
    "count_lines",
    "native_parser_available",
    "parse_buffer",
    "convert",
    "ConvertProgress",
    "ConvertSummary",
    "ShardSet",
    "ShardInfo",
    "Loader",
    "rebatch",
    "rank_range",
    "SyntheticConfig",
    "SyntheticCriteo",
    "BayesMetrics",
    "RawRows",
    "CRITEO_KAGGLE_CARDINALITIES",
    "write_criteo_tsv",
    "format_criteo_lines",
    "N_DENSE",
    "N_CAT",
    "DENSE_NAMES",
    "CAT_NAMES",
    "MISSING_ID_BASE",
    "MISSING_IDS",
    "missing_id",
]
