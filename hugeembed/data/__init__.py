"""Data: schemas, readers (CSV / TSV / Parquet / Criteo), conversion to binary shards, batching, synthetic data.

::

    files + Schema --TableReader--> Block (numpy) --Loader--> Batch(dense, sparse, labels)
          |                           ^
          +--convert--> shards/ (.npy + manifest.json, the schema inside) --ShardSet
    SyntheticCriteo (planted logistic model) --rows()/batches()--> Block / Batch

The built-in schema is Criteo's (``criteo.toml``): dense = log(1 + max(x, 0)) (empty -> 0);
categorical id = hex value of the field; an empty categorical field of the j-th sparse feature
-> ``2**32 + j``.  Other schemas hash categorical text to ids (``hash_text``).
"""

from ._batch import Batch, sparse_from_ids
from ._block import Bag, Block, CriteoBlock, rebatch
from ._convert import ConvertProgress, ConvertSummary, convert
from ._criteo import CriteoReader, FileSummary, ReadSummary, count_lines, read_criteo
from ._loader import Loader, rank_range
from ._parse import native_parser_available, parse_buffer
from ._hash import hash_text, value_text
from ._infer import infer_schema
from ._reader import TableReader, count_rows, fit_stats, read_table
from ._schema import (CAT_NAMES, DENSE_NAMES, MISSING_ID_BASE, MISSING_IDS, N_CAT, N_DENSE, DenseSpec, LabelSpec, Schema,
                      SparseSpec, criteo_schema, load_schema, missing_id)
from ._shards import ShardInfo, ShardSet
from ._synthetic import BayesMetrics, RawRows, SyntheticCriteo
from ._synthetic_config import CRITEO_KAGGLE_CARDINALITIES, SyntheticConfig
from ._tsv import format_criteo_lines, write_criteo_tsv

__all__ = [
    "Batch",
    "sparse_from_ids",
    "CriteoBlock",
    "Block",
    "Bag",
    "Schema",
    "LabelSpec",
    "DenseSpec",
    "SparseSpec",
    "load_schema",
    "criteo_schema",
    "infer_schema",
    "TableReader",
    "read_table",
    "fit_stats",
    "count_rows",
    "hash_text",
    "value_text",
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
