"""Key -> row storage of embedding tables, in groups decided once.

``RowLayout`` says how a row (weights + optimizer state, each in its own dtype) is stored and
gives typed views of it.  Tables of one kind and row layout share a group (``group_tables``):

* ``StaticGroup`` -- static tables, key k of table t at row ``first[t] + k``: one rows tensor.
* ``DynamicGroup`` -- dynamic tables: rows created on first sight of any int64 key, admission
  after k hits, ttl / LFU / LRU eviction, capacities; one rows tensor and one hash index keyed by
  (table, key), driven by native C++ kernels on CPU or by the torch reference on any device.
* ``TieredStore`` -- a table larger than memory: a key index (a group without rows), a
  byte-budgeted memory cache of rows (LRU / LFU) and a file of rows on disk (``storage_dir``),
  bit-identical to the in-memory table.

A table of a group is seen alone through its view, a ``RowStore`` (``StaticTable``,
``DynamicTable``); ``ArrayStore`` and ``HashStore`` are a table on its own (a group of one), and
``DictStore`` the plain-dict oracle of a dynamic table.  Initial rows are deterministic per
(seed, key, column): ``Uniform``, ``Normal``, ``TruncatedNormal``, ``Constant``, ``Zeros``,
``FromCallable``.  See docs/store.md.
"""

from ._admit import check_admission
from ._alloc import allocate_rows
from ._array import ArrayStore
from ._dict import DictStore
from ._dynamic import DynamicGroup
from ._grouping import group_tables
from ._hash import HashStore
from ._settings import TableSettings
from ._static import StaticGroup
from ._tiered import CACHE_POLICIES, SLOT_METADATA_BYTES, TieredStore, cache_rows_for
from ._tiered_group import TieredGroup
from ._layout import RowLayout, default_state_dtype
from ._init import (INIT_KINDS, Constant, FromCallable, Initializer, Normal, TruncatedNormal, Uniform, Zeros,
                    check_initializer_spec, initializer_from_spec)
from ._protocol import EXPORT_FIELDS, EvictionPolicy, ExportIndex, RowStore, StoreExport, row_independent
from ._views import DynamicTable, StaticTable, TableView

__all__ = [
    "RowStore",
    "RowLayout",
    "default_state_dtype",
    "StoreExport",
    "EXPORT_FIELDS",
    "ExportIndex",
    "EvictionPolicy",
    "TableSettings",
    "StaticGroup",
    "DynamicGroup",
    "group_tables",
    "TableView",
    "StaticTable",
    "DynamicTable",
    "HashStore",
    "row_independent",
    "ArrayStore",
    "DictStore",
    "TieredStore",
    "TieredGroup",
    "check_admission",
    "CACHE_POLICIES",
    "cache_rows_for",
    "SLOT_METADATA_BYTES",
    "Initializer",
    "Uniform",
    "Normal",
    "TruncatedNormal",
    "Constant",
    "Zeros",
    "FromCallable",
    "INIT_KINDS",
    "check_initializer_spec",
    "initializer_from_spec",
    "allocate_rows",
]
