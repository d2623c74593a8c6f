"""ArrayStore: a static table of `num_rows` rows where key k lives at slot k.

The classic ``nn.Embedding`` layout (TorchRec / FBGEMM tables), with the same
RowStore interface as the dynamic HashStore so the nn layer treats both alike.
Rows are initialised with the table's initializer at key = row index, so a
HashStore trained on ids in [0, n) holds exactly the rows of an ArrayStore(n)::

    keys   [3, 0, 7]  ->  slots [3, 0, 7]       key 12 with num_rows=10 -> InputError
"""

from __future__ import annotations

import itertools

import torch

from .. import _native
from .._device import canonical_device
from ..errors import ConfigError, InputError
from . import _alloc
from ._common import (as_counts, as_keys, as_slots, check_step, check_table_config, direct_write, gather_rows,
                      make_layout, scatter_rows)
from ._layout import LayoutViews, RowLayout, check_import_rows
from ._init import Initializer, default_initializer, init_rows_native
from ._protocol import ExportIndex, StoreExport

__all__ = ["ArrayStore", "RowBlock", "touch_many"]

_INIT_CHUNK = 1 << 20



def _row_ptr(t: torch.Tensor, row: int) -> int:
    """Address of row `row` of a 2-D tensor."""
    return t.data_ptr() + row * t.stride(0) * t.element_size()


class RowBlock:
    """One ``[R, W]`` storage and one ``[R, 2]`` metadata tensor holding the rows of several
    static tables (an EmbeddingCollection gives its static tables of one row width and dtype one
    block).  Each table's rows are a view of rows ``[first, first + n)``, so the torch path
    (any device) gathers, counts and updates the rows of all of them with one op each instead
    of one per table: the ``num_rows`` of the table before it offsets its slots.
    """

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.storage = _alloc.empty((rows, width), dtype, device)
        self.meta = torch.zeros(rows, 2, dtype=torch.int64, device=device)

    def like(self, device: torch.device | str) -> "RowBlock":
        """An empty block of this one's shape and dtype on `device` (its tables' stores move there
        with ``ArrayStore.to(device, block)``)."""
        return RowBlock(self.storage.shape[0], self.storage.shape[1], self.storage.dtype, device)

    @classmethod
    def for_tables(cls, num_rows: list[int], width: int, dtype: torch.dtype,
                   device: torch.device | str) -> list[tuple["RowBlock", int]]:
        """A block for tables of `num_rows` rows each, with each table's first row."""
        block = cls(sum(num_rows), width, dtype, device)
        return [(block, first) for first in [0, *itertools.accumulate(num_rows)][:-1]]


class ArrayStore(LayoutViews):
    """Static key -> row store: keys must lie in [0, num_rows).

    Args:
        name: table name (in every error message).
        num_rows: rows of the table, all allocated and initialised now.
        dim, state_width, initializer, init_state, dtype, device, seed, layout: as for HashStore.
        rows: False makes this store the key index of a tiered table (store/_tiered.py): the
            range check and the per-row counts, no rows.
        block: ``(RowBlock, first_row)``: keep the rows and counts in that block's rows
            ``[first_row, first_row + num_rows)`` rather than in tensors of their own.

    Example::

        >>> store = ArrayStore("country", num_rows=250, dim=4)
        >>> store.gather(store.find_or_insert(torch.tensor([3, 7]), step=0)).shape
        torch.Size([2, 4])
    """

    # Which keys this store holds: those k with k mod _num_shards == _shard, at slot
    # k // _num_shards.  One store holds them all; a ShardArrayStore (distributed) one class.
    _shard, _num_shards = 0, 1

    def __init__(self, name: str, num_rows: int, dim: int, state_width: int = 0, *,
                 initializer: Initializer | None = None, init_state=None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, layout: RowLayout | None = None,
                 rows: bool = True, block: tuple[RowBlock, int] | None = None):
        if initializer is None and isinstance(dim, int) and dim > 0:
            initializer = default_initializer(dim)
        check_table_config(name, dim, state_width, dtype, initializer)
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise ConfigError(f"table '{name}': num_rows must be a positive int, got {num_rows!r}")
        self.layout = make_layout(name, dim, state_width, dtype, layout)
        self.name, self.dim, self.state_width, self.width = name, dim, state_width, self.layout.width
        self.num_rows, self.dtype, self.device = num_rows, dtype, canonical_device(device)
        self.initializer, self.init_state, self.seed = initializer, init_state, int(seed)
        n = self.local_rows = len(range(self._shard, num_rows, self._num_shards))
        lay = self.layout
        self.has_rows = bool(rows)
        self._block = None
        if block is None:
            self._storage = _alloc.empty((n, self.width if rows else 0), lay.storage_dtype, self.device)
            self._meta = torch.zeros(n, 2, dtype=torch.int64, device=self.device)
        else:
            if not (isinstance(block, tuple) and len(block) == 2 and isinstance(block[0], RowBlock)
                    and isinstance(block[1], int) and not isinstance(block[1], bool)):
                raise ConfigError(f"table '{name}': block must be (RowBlock, first_row), got {block!r}")
            blk, first = block
            if not rows or blk.storage.shape[1] != self.width or blk.storage.dtype != lay.storage_dtype or \
                    blk.storage.device != self.device or not 0 <= first <= blk.storage.shape[0] - n:
                raise ConfigError(f"table '{name}': its rows do not fit the block given (rows {first}..{first + n} "
                                  f"of width {self.width}, {lay.storage_dtype} on {self.device}; the block has "
                                  f"{blk.storage.shape[0]} rows of width {blk.storage.shape[1]}, "
                                  f"{blk.storage.dtype} on {blk.storage.device})")
            self._block = block
            self._storage, self._meta = blk.storage[first:first + n], blk.meta[first:first + n]
        # On "meta" (shape-only planning) there is nothing to initialise; a key index has no rows.
        for start in range(0, n if self.device.type != "meta" and rows else 0, _INIT_CHUNK):
            end = min(n, start + _INIT_CHUNK)
            keys = self._keys_of(torch.arange(start, end, device=self.device))
            block = self._storage[start:end]
            # the native initializer writes float32 weights: only into a plain layout's columns
            if lay.packed or not init_rows_native(initializer, keys, dim, self.seed, block, None):
                lay.weights(block).copy_(initializer.generate(keys, dim, self.seed))
            if state_width:  # in place: no temporary as large as the block
                state = lay.state(block)
                state.zero_()
                if init_state is not None:
                    init_state(state)

    def block_rows(self) -> tuple[RowBlock, int] | None:
        """``(block, first_row)`` while this store's rows and counts are still that RowBlock's
        views (a load or a move gives the store tensors of its own), else None."""
        if self._block is None:
            return None
        blk, first = self._block
        if (self._storage.data_ptr() == _row_ptr(blk.storage, first) and self._storage.shape[1] == blk.storage.shape[1]
                and self._meta.data_ptr() == _row_ptr(blk.meta, first)):
            return self._block
        return None

    def _keys_of(self, slots: torch.Tensor) -> torch.Tensor:
        return slots if self._num_shards == 1 else slots * self._num_shards + self._shard

    def keys(self) -> torch.Tensor:
        """The keys this store holds, ascending (slot order)."""
        return self._keys_of(torch.arange(self.local_rows, device=self.device))

    def _bad_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Where `keys` name no row of this store."""
        return (keys < 0) | (keys >= self.num_rows)

    def _check_range(self, keys: torch.Tensor) -> None:
        bad = self._bad_keys(keys)
        if keys.numel() and bool(bad.any()):
            key = int(keys[bad][0])
            raise InputError(f"table '{self.name}': key {key} is outside [0, {self.num_rows}) "
                             f"(num_rows={self.num_rows} of this static table)")

    def _slots_of(self, keys: torch.Tensor) -> torch.Tensor:
        self._check_range(keys)
        return self._slots_unchecked(keys)

    def _slots_unchecked(self, keys: torch.Tensor) -> torch.Tensor:
        if self._num_shards == 1:
            return keys.clone()
        return torch.div(keys, self._num_shards, rounding_mode="floor")

    def _invalid(self, keys: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
        """0-d bool on the device: a key outside the table or a count < 1 (no host sync;
        find_or_insert_many reads these flags of many tables at once)."""
        bad = self._bad_keys(keys).any()
        return bad if counts is None else bad | (counts < 1).any()

    def _touch(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None) -> torch.Tensor:
        """find_or_insert of checked keys and counts: counts the hits, stamps the step."""
        slots = self._slots_unchecked(keys)
        c = counts if counts is not None else torch.ones_like(slots)
        self._meta[:, 0].index_add_(0, slots, c)
        self._meta[slots, 1] = step
        return slots

    def __len__(self) -> int:
        return self.local_rows

    def storage(self) -> torch.Tensor:
        return self._storage

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        keys = as_keys(self.name, keys, self.device)
        step = check_step(self.name, step)
        counts = as_counts(self.name, counts, keys.numel(), self.device)
        self._check_range(keys)
        return self._touch(keys, step, counts)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        return self._slots_of(as_keys(self.name, keys, self.device))

    def _touch_row(self, keys: torch.Tensor, counts: torch.Tensor | None, out: torch.Tensor) -> tuple | None:
        """This store's part of a he_array_touch_many call, (buffers, rows): find_or_insert of int64
        `keys` into `out`, both contiguous CPU tensors of one length; or None when it takes its own
        find_or_insert (a shard of a table, not on the CPU, no kernels)."""
        if self._num_shards != 1 or self.device.type != "cpu" or not _native.available() or \
                not self._meta.is_contiguous():
            return None
        return [self._meta, keys, counts, out], self.local_rows

    def hit_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """Hits of `keys` so far (int64); changes nothing."""
        return self._meta[self._slots_of(as_keys(self.name, keys, self.device)), 0].clone()

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self._storage, as_slots(self.name, slots, self.local_rows, self.device))

    @direct_write
    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        scatter_rows(self.name, self._storage, as_slots(self.name, slots, self.local_rows, self.device), rows)

    def evict(self, step: int, ttl: int | None = None, max_rows: int | None = None, policy: str | None = None,
              protect: torch.Tensor | None = None, min_norm: float | None = None) -> int:
        raise ConfigError(f"table '{self.name}' is a static ArrayStore: it holds every row of [0, {self.num_rows}) "
                          "and cannot evict; use a HashStore for ttl / max_rows eviction")

    @direct_write
    def remove(self, keys: torch.Tensor) -> int:
        raise ConfigError(f"table '{self.name}' is a static ArrayStore: it holds every row of [0, {self.num_rows}) "
                          "and cannot remove keys")

    def export(self) -> StoreExport:
        return self.export_index().gather(self._storage)

    def export_index(self) -> ExportIndex:
        e = torch.empty(0, dtype=torch.int64, device=self.device)
        return ExportIndex(self.keys(), torch.arange(self.local_rows, device=self.device), self._meta[:, 0].clone(),
                           self._meta[:, 1].clone(), e, e.clone(), e.clone())

    @direct_write
    def import_(self, export: StoreExport) -> None:
        exp = export.to(self.device)
        if self.has_rows:  # a key index takes rows of zero width
            check_import_rows(self.name, self.layout, exp.rows)
        if exp.pending_keys.numel():
            raise InputError(f"table '{self.name}': a static table admits every key; the import has "
                             f"{exp.pending_keys.numel()} pending keys")
        slots = self._slots_of(exp.keys)
        if self.has_rows:  # a key index's tier writes the rows
            self._storage[slots] = exp.rows.to(self.layout.storage_dtype)
        self._meta[slots, 0] = exp.counts
        self._meta[slots, 1] = exp.last_step

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._storage, self._meta))

    def index_overhead_bytes(self) -> int:
        """Bytes beyond weights + state: the per-row (count, last step) metadata."""
        return self._meta.numel() * self._meta.element_size()

    def to(self, device: torch.device | str, block: RowBlock | None = None) -> ArrayStore:
        """A copy on `device`; `block` (on that device, laid out as this store's block): its rows
        go to the same rows of that block, else to tensors of their own."""
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.device = canonical_device(device)
        here = self.block_rows()
        if block is not None and here is not None and block.storage.shape == here[0].storage.shape and \
                block.storage.dtype == here[0].storage.dtype and block.storage.device == out.device:
            first, n = here[1], self._storage.shape[0]
            out._block = (block, first)
            out._storage, out._meta = block.storage[first:first + n], block.meta[first:first + n]
            out._storage.copy_(self._storage)
            out._meta.copy_(self._meta)
            return out
        out._block = None  # tensors of its own on the new device
        out._storage = _alloc.empty(tuple(self._storage.shape), self._storage.dtype, out.device)
        out._storage.copy_(self._storage)
        out._meta = self._meta.to(out.device, copy=True)
        return out

    def __repr__(self) -> str:
        return (f"ArrayStore(name={self.name!r}, num_rows={self.num_rows}, dim={self.dim}, "
                f"state_width={self.state_width}, device={self.device})")


def touch_many(parts: list[tuple[list, int]], step: int) -> int | None:
    """Runs he_array_touch_many over the tables' parts (ArrayStore._touch_row): the training fetch
    of many static tables in one call.  None if done; else the index of the first part with a
    bad key or count, and nothing anywhere was written."""
    bufs, ints = [], [int(step)]
    for b, rows in parts:
        bufs += b
        ints.append(rows)
    try:
        _native.call("he_array_touch_many", bufs, ints)
    except _native.KernelError as e:
        if e.status != _native.Status.BAD_VALUE:
            raise
        return e.detail[0]
    return None
