"""Row stores of one shard: a static table's share of rows, and a table this rank does not hold.

A row-wise static table of ``num_rows`` rows over ``n`` shards keeps, on shard ``i``,
the keys ``k`` with ``k mod n == i`` at slot ``k // n``::

    num_rows = 7, n = 2     shard 0: keys 0 2 4 6 -> slots 0 1 2 3
                            shard 1: keys 1 3 5   -> slots 0 1 2

Rows are initialised with the GLOBAL key (the initializer is a pure function of
(seed, key, column)), so every row starts exactly as in the unsharded ArrayStore.
"""

from __future__ import annotations

import torch

from .._device import canonical_device
from ..errors import ConfigError, ShardingError
from ..store import ArrayStore, ExportIndex, Initializer, RowLayout, StoreExport
from ..store._common import make_layout
from ..store._layout import LayoutViews
from ..store._init import default_initializer

__all__ = ["ShardArrayStore", "AbsentShard"]


class ShardArrayStore(ArrayStore):
    """Static rows ``{k in [0, num_rows) : k mod num_shards == shard}`` of one table, at slot ``k // num_shards``.

    An ArrayStore holding one residue class of the keys: same protocol, same rows.

    Args:
        name: table name (in every error message).
        num_rows: rows of the whole table.
        dim, state_width: as for ArrayStore.
        shard, num_shards: which residue class this store holds.
        initializer, init_state, dtype, device, seed, layout: as for ArrayStore (rows start as the
            unsharded table's rows of the same keys).
        rows: False for the key index of a disk-tiered shard (its TieredStore holds the rows).
    """

    def __init__(self, name: str, num_rows: int, dim: int, state_width: int = 0, *, shard: int, num_shards: int,
                 initializer: Initializer | None = None, init_state=None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, layout: RowLayout | None = None,
                 rows: bool = True) -> None:
        if not (isinstance(num_shards, int) and isinstance(shard, int) and 0 <= shard < num_shards):
            raise ConfigError(f"table '{name}': shard {shard} is outside [0, {num_shards})")
        super().__init__(name, num_rows, dim, state_width, initializer=initializer, init_state=init_state,
                         dtype=dtype, device=device, seed=seed, layout=layout, rows=rows, shard=shard,
                         num_shards=num_shards)

    @property
    def shard(self) -> int:
        return self.settings.shard

    @property
    def num_shards(self) -> int:
        return self.settings.num_shards

    def __repr__(self) -> str:
        return (f"ShardArrayStore(name={self.name!r}, num_rows={self.num_rows}, shard={self.shard}/{self.num_shards}, "
                f"local_rows={self.local_rows}, dim={self.dim}, state_width={self.state_width})")


class AbsentShard(LayoutViews):
    """The store of a table this rank holds no row of (a table-wise table owned elsewhere).

    Empty, and it refuses every lookup: the sharded collection never sends it a key.
    """

    def __init__(self, name: str, dim: int, state_width: int, dtype: torch.dtype, device: torch.device | str,
                 seed: int, initializer: Initializer | None, owners: tuple[int, ...],
                 layout: RowLayout | None = None) -> None:
        layout = make_layout(name, dim, state_width, dtype, layout)
        self.name, self.layout, self.dim, self.state_width = name, layout, dim, state_width
        self.width, self.dtype, self.device, self.seed = layout.width, dtype, canonical_device(device), int(seed)
        self.initializer = initializer if initializer is not None else default_initializer(dim)
        self.owners = owners
        self._storage = torch.empty(0, self.width, dtype=layout.storage_dtype, device=self.device)

    def _refuse(self):
        raise ShardingError(f"table '{self.name}' lives on rank(s) {list(self.owners)}, not on this rank "
                            "(internal routing error)")

    def __len__(self) -> int:
        return 0

    def storage(self) -> torch.Tensor:
        return self._storage

    def find_or_insert(self, keys, step, counts=None):
        self._refuse()

    def find(self, keys):
        self._refuse()

    def gather(self, slots):
        self._refuse()

    def scatter(self, slots, rows):
        self._refuse()

    def evict(self, step, ttl=None, max_rows=None, policy=None, protect=None, min_norm=None) -> int:
        return 0

    def export(self) -> StoreExport:
        return self.export_index().gather(self._storage)

    def export_index(self) -> ExportIndex:
        e = torch.empty(0, dtype=torch.int64, device=self.device)
        return ExportIndex(e, e.clone(), e.clone(), e.clone(), e.clone(), e.clone(), e.clone())

    def import_(self, export: StoreExport) -> None:
        if export.keys.numel() or export.pending_keys.numel():
            self._refuse()

    def remove(self, keys: torch.Tensor) -> int:
        if keys.numel():
            self._refuse()
        return 0

    def memory_bytes(self) -> int:
        return 0

    def index_overhead_bytes(self) -> int:
        return 0

    def to(self, device: torch.device | str) -> "AbsentShard":
        return AbsentShard(self.name, self.dim, self.state_width, self.dtype, device, self.seed, self.initializer,
                           self.owners, self.layout)

    def __repr__(self) -> str:
        return f"AbsentShard(name={self.name!r}, owners={list(self.owners)})"
