"""Key -> row storage of embedding tables.

``RowLayout`` says how a row (weights + optimizer state, each in its own dtype) is stored
and gives typed views of it; ``RowStore`` is the protocol the nn layer calls; three stores implement it:

* ``HashStore``  -- dynamic table: rows created on first sight of any int64 key,
  admission after k hits, ttl / LFU / LRU eviction, capacity; native C++ on CPU,
  vectorised torch ops on GPU (one shared memory layout).
* ``ArrayStore`` -- static table, key = row index in [0, num_rows).
* ``DictStore``  -- plain-dict oracle of HashStore used by tests.
* ``TieredStore`` -- a table larger than memory: a key index (a HashStore / ArrayStore
  built with ``rows=False``), a byte-budgeted memory cache of rows (LRU / LFU) and a file
  of rows on disk (``storage_dir``), bit-identical to the in-memory table.

Initial rows are deterministic per (seed, key, column): ``Uniform``, ``Normal``,
``TruncatedNormal``, ``Constant``, ``Zeros``, ``FromCallable``.  See docs/store.md.
"""

from ._alloc import allocate_rows
from ._array import ArrayStore, RowBlock
from ._dict import DictStore
from ._hash import HashStore, find_many, find_or_insert_many
from ._tiered import CACHE_POLICIES, SLOT_METADATA_BYTES, TieredStore, cache_rows_for
from ._layout import RowLayout, default_state_dtype
from ._init import (INIT_KINDS, Constant, FromCallable, Initializer, Normal, TruncatedNormal, Uniform, Zeros,
                    check_initializer_spec, initializer_from_spec)
from ._protocol import EXPORT_FIELDS, EvictionPolicy, ExportIndex, RowStore, StoreExport, row_independent

__all__ = [
    "RowStore",
    "RowLayout",
    "default_state_dtype",
    "StoreExport",
    "EXPORT_FIELDS",
    "ExportIndex",
    "EvictionPolicy",
    "HashStore",
    "find_or_insert_many",
    "find_many",
    "row_independent",
    "ArrayStore",
    "RowBlock",
    "DictStore",
    "TieredStore",
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
