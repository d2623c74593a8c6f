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

from ..errors import ConfigError, InputError, ShardingError
from ..store import Initializer, StoreExport
from ..store._common import init_rows
from ..store._init import default_initializer

__all__ = ["ShardArrayStore", "AbsentShard"]

_INIT_CHUNK = 1 << 20


class ShardArrayStore:
    """Static rows ``{k in [0, num_rows) : k mod num_shards == shard}`` of one table, at slot ``k // num_shards``.

    Args:
        name: table name (in every error message).
        num_rows: rows of the whole table.
        dim, state_width: as for ArrayStore.
        shard, num_shards: which residue class this store holds.
        initializer, init_state, dtype, device, seed: as for ArrayStore (rows start as the
            unsharded table's rows of the same keys).
    """

    def __init__(self, name: str, num_rows: int, dim: int, state_width: int = 0, *, shard: int, num_shards: int,
                 initializer: Initializer | None = None, init_state=None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0) -> None:
        if not 0 <= shard < num_shards:
            raise ConfigError(f"table '{name}': shard {shard} is outside [0, {num_shards})")
        self.name, self.dim, self.state_width, self.width = name, dim, state_width, dim + state_width
        self.num_rows, self.shard, self.num_shards = num_rows, shard, num_shards
        self.dtype, self.device = dtype, torch.device(device)
        self.initializer = initializer if initializer is not None else default_initializer(dim)
        self.init_state, self.seed = init_state, int(seed)
        n = self.local_rows = max(0, -(-(num_rows - shard) // num_shards))
        self._storage = torch.empty(n, self.width, dtype=dtype, device=self.device)
        self._meta = torch.zeros(n, 2, dtype=torch.int64, device=self.device)
        for start in range(0, n, _INIT_CHUNK):
            end = min(n, start + _INIT_CHUNK)
            slots = torch.arange(start, end, device=self.device)
            init_rows(self._storage, slots, slots * num_shards + shard, dim, state_width, self.initializer,
                      init_state, self.seed)

    def keys(self) -> torch.Tensor:
        """The global keys this shard holds, ascending (slot order)."""
        return torch.arange(self.local_rows, device=self.device) * self.num_shards + self.shard

    def _slots(self, keys: torch.Tensor) -> torch.Tensor:
        if keys.dtype != torch.int64 or keys.dim() != 1 or keys.device != self.device:
            raise InputError(f"table '{self.name}': keys must be int64 [n] on {self.device}, got {keys.dtype} "
                             f"{tuple(keys.shape)} on {keys.device}")
        if keys.numel():
            bad = (keys < 0) | (keys >= self.num_rows) | (keys % self.num_shards != self.shard)
            if bool(bad.any()):
                k = int(keys[bad][0])
                raise ShardingError(f"table '{self.name}': key {k} does not belong to shard {self.shard} of "
                                    f"{self.num_shards} (keys k with k mod {self.num_shards} == {self.shard}, "
                                    f"k < {self.num_rows})")
        return torch.div(keys, self.num_shards, rounding_mode="floor")

    def __len__(self) -> int:
        return self.local_rows

    def storage(self) -> torch.Tensor:
        return self._storage

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        slots = self._slots(keys)
        c = counts.to(torch.int64) if counts is not None else torch.ones_like(slots)
        self._meta[:, 0].index_add_(0, slots, c)
        self._meta[slots, 1] = int(step)
        return slots

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        return self._slots(keys)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return self._storage.index_select(0, slots)

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self._storage.index_copy_(0, slots, rows.to(self.dtype))

    def evict(self, step: int, ttl: int | None = None, max_rows: int | None = None, policy: str = "lfu",
              protect: torch.Tensor | None = None) -> int:
        raise ConfigError(f"table '{self.name}' is static: it holds every row of [0, {self.num_rows}) and cannot "
                          "evict")

    def export(self) -> StoreExport:
        e = torch.empty(0, dtype=torch.int64, device=self.device)
        return StoreExport(self.keys(), self._storage.clone(), self._meta[:, 0].clone(), self._meta[:, 1].clone(),
                           e, e.clone(), e.clone())

    def import_(self, export: StoreExport) -> None:
        exp = export.to(self.device)
        if exp.width != self.width:
            raise InputError(f"table '{self.name}': import has rows of width {exp.width}, the table has "
                             f"{self.width} (dim {self.dim} + state {self.state_width})")
        if exp.pending_keys.numel():
            raise InputError(f"table '{self.name}': a static table admits every key; the import has "
                             f"{exp.pending_keys.numel()} pending keys")
        slots = self._slots(exp.keys)
        self._storage[slots] = exp.rows.to(self.dtype)
        self._meta[slots, 0] = exp.counts
        self._meta[slots, 1] = exp.last_step

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._storage, self._meta))

    def index_overhead_bytes(self) -> int:
        return self._meta.numel() * self._meta.element_size()

    def to(self, device: torch.device | str) -> "ShardArrayStore":
        out = ShardArrayStore.__new__(ShardArrayStore)
        out.__dict__.update(self.__dict__)
        out.device = torch.device(device)
        out._storage = self._storage.to(out.device, copy=True)
        out._meta = self._meta.to(out.device, copy=True)
        return out

    def __repr__(self) -> str:
        return (f"ShardArrayStore(name={self.name!r}, num_rows={self.num_rows}, shard={self.shard}/{self.num_shards}, "
                f"local_rows={self.local_rows}, dim={self.dim}, state_width={self.state_width})")


class AbsentShard:
    """The store of a table this rank holds no row of (a table-wise table owned elsewhere).

    Empty, and it refuses every lookup: the sharded collection never sends it a key.
    """

    def __init__(self, name: str, dim: int, state_width: int, dtype: torch.dtype, device: torch.device | str,
                 seed: int, initializer: Initializer | None, owners: tuple[int, ...]) -> None:
        self.name, self.dim, self.state_width, self.width = name, dim, state_width, dim + state_width
        self.dtype, self.device, self.seed = dtype, torch.device(device), int(seed)
        self.initializer = initializer if initializer is not None else default_initializer(dim)
        self.owners = owners
        self._storage = torch.empty(0, self.width, dtype=dtype, device=self.device)

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

    def evict(self, step, ttl=None, max_rows=None, policy="lfu", protect=None) -> int:
        return 0

    def export(self) -> StoreExport:
        e = torch.empty(0, dtype=torch.int64, device=self.device)
        return StoreExport(e, self._storage.clone(), e.clone(), e.clone(), e.clone(), e.clone(), e.clone())

    def import_(self, export: StoreExport) -> None:
        if export.keys.numel() or export.pending_keys.numel():
            self._refuse()

    def memory_bytes(self) -> int:
        return 0

    def index_overhead_bytes(self) -> int:
        return 0

    def to(self, device: torch.device | str) -> "AbsentShard":
        return AbsentShard(self.name, self.dim, self.state_width, self.dtype, device, self.seed, self.initializer,
                           self.owners)

    def __repr__(self) -> str:
        return f"AbsentShard(name={self.name!r}, owners={list(self.owners)})"
