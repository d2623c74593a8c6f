"""One table of a group as a RowStore: the per-table edge (state_dict, snapshots, deltas, export,
inspect, error messages) over storage that belongs to the group.

``StaticTable``: row slots are the table's own (key k at slot k // num_shards, ``storage()`` its
rows, a view of the group's); ``DynamicTable``: row slots are the group's (``storage()`` the
group's rows, shared with its other tables).  Either way ``storage()[find(keys)]`` are the rows
of `keys`.  ``ArrayStore`` and ``HashStore`` build a group of one table and are its view: a table
on its own, as the tests and the functional API use it.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from . import _ops
from ._common import as_counts, as_keys, as_slots, check_step, direct_write, gather_rows, scatter_rows
from ._layout import LayoutViews
from ._protocol import ExportIndex, StoreExport

__all__ = ["TableView", "StaticTable", "DynamicTable"]


class TableView(LayoutViews):
    """Table `t` of `group`: the RowStore protocol (store/_protocol.py) for that table alone."""

    def __init__(self, group, t: int) -> None:
        self.group, self.t = group, t
        s = group.settings[t]
        self.settings = s
        self.name, self.layout, self.seed = s.name, s.layout, s.seed
        self.dim, self.state_width, self.width = s.layout.dim, s.layout.state_width, s.layout.width
        self.dtype, self.device = s.layout.dtype, group.device
        self.initializer, self.init_state = s.initializer, s.init_state
        self.has_rows = group.has_rows
        group.adopt_view(t, self)

    def _tids(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.full_like(keys, self.t)

    def _keys(self, keys: torch.Tensor, what: str = "keys") -> torch.Tensor:
        return as_keys(self.name, keys, self.device, what)

    # pins live in the group: slots are the group's, and eviction anywhere in it spares them
    def pin(self, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> int:
        return self.group.pins.pin(slots, start, stop)

    def unpin(self, handle: int) -> None:
        self.group.pins.unpin(handle)

    @property
    def eviction_epoch(self) -> int:
        return self.group.pins.epoch

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.storage(), as_slots(self.name, slots, self.storage().shape[0], self.device))

    @direct_write
    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        storage = self.storage()
        scatter_rows(self.name, storage, as_slots(self.name, slots, storage.shape[0], self.device), rows)

    def export(self) -> StoreExport:
        return self.export_index().gather(self.storage())

    def export_index(self) -> ExportIndex:
        return self.group.export_index(self.t)

    @direct_write
    def import_(self, export: StoreExport) -> None:
        self.group.import_(self.t, export)

    def memory_bytes(self) -> int:
        """This table's share of its group's bytes (the shares of a group's tables add up to its total)."""
        return self.group.table_memory_bytes(self.t)

    def index_overhead_bytes(self) -> int:
        """Bytes beyond the weights + state of the live rows (index, metadata, spare rows)."""
        return self.memory_bytes() - len(self) * self.layout.row_bytes

    def __len__(self) -> int:
        return self.group.table_rows(self.t)


class StaticTable(TableView):
    """A static table of a StaticGroup: key k at slot k // num_shards of its own rows."""

    def __init__(self, group, t: int) -> None:
        super().__init__(group, t)
        s = self.settings
        self.num_rows, self.local_rows = s.num_rows, group.sizes[t]
        self._first = group.first[t]

    def storage(self) -> torch.Tensor:
        return self.group.table_view(self.t)

    def meta(self) -> torch.Tensor:
        """``[local_rows, 2]`` hit count and last step of each row (a view of the group's)."""
        return self.group.table_meta(self.t)

    def keys(self) -> torch.Tensor:
        """The keys this table holds, ascending (slot order)."""
        return self.group.keys_of(self.t)

    def keys_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The keys at `slots` (stochastic rounding draws by key)."""
        s = self.settings
        return slots * s.num_shards + s.shard

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        keys = self._keys(keys)
        step = check_step(self.name, step)
        counts = as_counts(self.name, counts, keys.numel(), self.device)
        return self.group.touch(self._tids(keys), keys, step, counts, unique=False) - self._first

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        keys = self._keys(keys)
        return self.group.find(self._tids(keys), keys) - self._first

    def hit_counts(self, keys: torch.Tensor) -> torch.Tensor:
        keys = self._keys(keys)
        return self.group.hit_counts(self._tids(keys), keys)

    def evict(self, step: int, ttl: int | None = None, max_rows: int | None = None, policy: str | None = None,
              protect: torch.Tensor | None = None, min_norm: float | None = None) -> int:
        raise ConfigError(f"table '{self.name}' is static: it holds every row of [0, {self.num_rows}) and cannot "
                          "evict; use a dynamic table (num_rows=None) for ttl / max_rows eviction")

    @direct_write
    def remove(self, keys: torch.Tensor) -> int:
        raise ConfigError(f"table '{self.name}' is static: it holds every row of [0, {self.num_rows}) and cannot "
                          "remove keys")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, num_rows={self.num_rows}, dim={self.dim}, "
                f"state_width={self.state_width}, device={self.device})")


class DynamicTable(TableView):
    """A dynamic table of a DynamicGroup: the group's slots and rows."""

    def __init__(self, group, t: int) -> None:
        super().__init__(group, t)
        s = self.settings
        self.capacity, self.on_full, self.eviction_policy = s.capacity, s.on_full, s.eviction_policy
        self.admit_min_count, self.admit_probability = s.admit_min_count, s.admit_probability
        self.max_pending = s.pending_limit
        self._op_handle, self._op_version = _ops.register(self)  # its ops under torch.compile

    @property
    def salt(self) -> int:
        return self.group.salts[self.t]

    @property
    def num_pending(self) -> int:
        """Keys seen but not admitted yet."""
        return self.group.table_pending(self.t)

    @property
    def num_buckets(self) -> int:
        return self.group.num_buckets

    @property
    def backend(self) -> str:
        return self.group.backend

    # a tiered table's hooks are its index group's
    @property
    def on_free(self):
        return self.group.on_free

    @on_free.setter
    def on_free(self, fn) -> None:
        self.group.on_free = fn

    @property
    def row_norms(self):
        return self.group.row_norms

    @row_norms.setter
    def row_norms(self, fn) -> None:
        self.group.row_norms = fn

    def storage(self) -> torch.Tensor:
        return self.group.rows

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one custom op in the graph (store/_ops.py), this method inside
            return _ops.find_or_insert_op(self, keys, step, counts)
        keys = self._keys(keys)
        step = check_step(self.name, step)
        counts = as_counts(self.name, counts, keys.numel(), self.device)
        if keys.numel() == 0:
            return keys.clone()
        return self.group.find_or_insert(self._tids(keys), keys, step, counts)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _ops.find_op(self, keys)
        keys = self._keys(keys)
        if keys.numel() == 0:
            return keys.clone()
        return self.group.find(self._tids(keys), keys)

    def hit_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """Hits of `keys` so far (admitted or pending; 0 for an unknown key), int64; changes nothing."""
        keys = self._keys(keys)
        return self.group.hit_counts(self._tids(keys), keys)

    def keys_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The keys at `slots` (stochastic rounding draws by key); -1 where a slot holds no key."""
        return self.group.slot_keys(slots)

    def evict(self, step: int, ttl: int | None = None, max_rows: int | None = None, policy: str | None = None,
              protect: torch.Tensor | None = None, min_norm: float | None = None) -> int:
        """Removes rows unseen for more than `ttl` steps, rows whose weight L2 norm is below
        `min_norm`, then the least valuable ones down to `max_rows` (policy "lfu" or "lru"; default
        the table's eviction_policy), never the slots in `protect` nor pinned ones.  Returns rows
        removed.  Pending keys unseen for more than `ttl` steps are dropped too."""
        return self.group.evict(self.t, step, ttl, max_rows, policy, protect, min_norm)

    @direct_write
    def remove(self, keys: torch.Tensor) -> int:
        """Removes `keys` (admitted or pending, each present and given once) and frees their rows;
        returns rows freed.  Refused while batches in flight hold rows (their slots would move)."""
        return self.group.remove(self.t, self._keys(keys))

    def memory_breakdown(self) -> dict[str, int]:
        return self.group.memory_breakdown()

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.copy, deepcopy, pickle) is a store of its own for the compiled ops too
        self.__dict__.update(state)
        self._op_handle, self._op_version = _ops.register(self)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, dim={self.dim}, state_width={self.state_width}, "
                f"rows={len(self)}, pending={self.num_pending}, buckets={self.num_buckets}, "
                f"backend={self.backend!r}, device={self.device})")
