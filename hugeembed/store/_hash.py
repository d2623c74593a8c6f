"""HashStore: a dynamic table on its own -- rows created on first sight of any int64 key.

A group of one dynamic table (store/_dynamic.py) and its view (store/_views.py): DeepRec's
EmbeddingVariable, TensorNet's SparseTable.  Rows are created on first sight of a key (or after
``admit_min_count`` hits), live in one growable storage tensor, and can be evicted by age (ttl)
or by frequency / recency when the table is over a row budget::

    >>> store = HashStore("user_id", dim=8, state_width=1)
    >>> slots = store.find_or_insert(torch.tensor([17, -3, 99]), step=0)
    >>> rows = store.gather(slots)                         # [3, 9] weights + state
"""

from __future__ import annotations

import torch

from ._common import make_layout
from ._dynamic import DynamicGroup
from ._init import Initializer
from ._layout import RowLayout
from ._settings import TableSettings
from ._views import DynamicTable

__all__ = ["HashStore"]


class HashStore(DynamicTable):
    """Dynamic key -> row store; any int64 is a valid key.

    Args:
        name: table name (in every error message).
        dim: D, embedding width.
        state_width: S, optimizer-state columns stored after the weights of each row.
        initializer: initial weights per (seed, key, column); default TruncatedNormal(0, 1/sqrt(D)).
        init_state: callable filling a fresh [n, S] state tensor in place (zeros if None).
        dtype, device: of the weights and of the row storage.
        layout: the RowLayout of a row (default: state in the weight dtype, beside the weights).
        capacity: at most this many rows (None: unbounded); allocates nothing up front.
        on_full: "evict" (run eviction_policy, sparing the keys of the current call) or "error"
            (CapacityError) when an insert would exceed capacity.
        eviction_policy: "lfu" or "lru", for on_full="evict".
        admit_min_count: a key gets a trainable row once it was seen this many times
            (DeepRec's counter filter); before that find_or_insert returns -1 for it.
        admit_probability: instead, each sighting of a key without a row admits it with this
            probability (DeepRec's probability filter; reproducible per seed, key, step).
        max_pending: keys waiting for admission kept at most (the least seen are forgotten
            past it); None: DEFAULT_MAX_PENDING.
        seed: initializer seed.
        initial_rows: reserve room for this many rows (a hint; saves rehashes).
        backend: "native" (C++, CPU), "triton" (CUDA), "torch" (any device) or None (native on CPU,
            triton on CUDA, where they run).
        rows: False makes this store the key index of a tiered table (store/_tiered.py): it keeps
            keys, slots, counts, admission and eviction, but no rows; the slots it frees are
            reported to ``on_free`` and weight norms read through ``row_norms``.
        salt: the hash salt (None: drawn at random; see store/_index.py).

    A store is not thread-safe: one thread at a time calls it (its kernels use their own threads
    inside a call).  Calls that fail (CapacityError, InputError) leave the store unchanged, except
    that on_full="evict" may have evicted rows before finding that nothing more could go.  Rows
    pinned with :meth:`pin` (the rows of batches whose backward has not run) are never evicted.
    """

    def __init__(self, name: str, dim: int, state_width: int = 0, *, initializer: Initializer | None = None,
                 init_state=None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 capacity: int | None = None, on_full: str = "evict", eviction_policy: str = "lfu",
                 admit_min_count: int = 1, seed: int = 0, initial_rows: int = 0, backend: str | None = None,
                 admit_probability: float | None = None, max_pending: int | None = None,
                 layout: RowLayout | None = None, rows: bool = True, salt: int | None = None):
        settings = TableSettings(name, make_layout(name, dim, state_width, dtype, layout), initializer=initializer,
                                 init_state=init_state, seed=int(seed) if not isinstance(seed, bool) else seed,
                                 capacity=capacity, on_full=on_full, eviction_policy=eviction_policy,
                                 admit_min_count=admit_min_count, admit_probability=admit_probability,
                                 max_pending=max_pending, initial_rows=initial_rows, salt=salt)
        super().__init__(DynamicGroup([settings], device=device, backend=backend, rows=rows), 0)

    @classmethod
    def of_group(cls, group: DynamicGroup) -> "HashStore":
        out = cls.__new__(cls)
        DynamicTable.__init__(out, group, 0)
        return out

    def use_backend(self, backend: str) -> "HashStore":
        """Switches between the native and torch code paths; the layout is shared, nothing is copied."""
        self.group.use_backend(backend)
        return self

    def to(self, device: torch.device | str) -> "HashStore":
        """A copy of this store on `device` (native backend on CPU when available)."""
        return type(self).of_group(self.group.to(device))
