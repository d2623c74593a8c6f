"""TieredStore: a table larger than memory -- a host-memory cache of rows over a disk tier.

OneFlow's OneEmbedding and DeepRec's EmbeddingVariable keep the rows of a big table on
SSD with a faster tier caching them; FBGEMM's SSD TBE does the same under RocksDB.  A
TieredStore is one table made of three parts, each with one job::

    key index   (a HashStore or ArrayStore without rows: ``rows=False``)
        key -> logical slot, hit counts, last steps, admission, eviction of keys
        (the table's logical capacity); reports the slots it frees
    resident rows (the cache: ``storage()`` is [C, W], C = what the byte budget holds)
        logical slot <-> cache slot, dirty bits, LRU / LFU order
    backing tier (RowFile: fixed-size records in one file; RecordSpace: which record
        holds which row) reads missing rows in, takes evicted dirty rows back, appended
        as one sequential run (store/_tier_space.py)

``find_or_insert`` returns *cache* slots: the fused lookup and the optimizer rules work on
``storage()`` exactly as for an in-memory store, so a tiered table trains bit for bit as
the all-in-memory one (the tests compare rows, state and metrics).  The cache's calls are in
store/_tier_cache.py; whole-table reads, export and import in store/_tier_rows.py.  Stochastic rounding
draws by key (``keys_of``), as the in-memory table does.

A fetch first makes room (write-back of dirty victims, only unpinned rows that the call
does not read), then asks the key index, then brings the missing rows in: a failure while
making room (the disk full) leaves every row where it was.  Rows of batches whose backward
has not run are pinned in the cache and, through it, in the key index.

Cache policy (``cache_policy``), victims chosen among unpinned resident rows the call does
not read, smallest first:
  * ``"lru"``: (last access, key)
  * ``"lfu"``: (accesses since the key got its row, last access, key); accesses are the
    id's occurrences in training batches (an eval read counts none).
"Last access" is the number of the fetch call that last read the row.  When full, a
fetch evicts what it needs plus 1/16 of the cache (so victims are chosen once per
C/16 misses, not every call).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .._device import canonical_device
from ..errors import ConfigError
from ._common import (as_counts, as_keys, as_slots, check_step, direct_write, gather_rows,
                      scatter_rows)
from ._layout import LayoutViews
from ._pins import Pinnable, PinnedRows
from ._tier_file import IO_THREADS, RowFile, TableDir
from .. import _native
from ._tier_cache import (CACHE_POLICIES, SLOT_METADATA_BYTES, TierCache, cache_rows_for, new_map,
                          one_thread)
from ._tier_prefetch import TierPrefetch
from ._tier_read import TierReads
from ._tier_rows import TierTransfer
from ._tier_space import RecordSpace

__all__ = ["TieredStore", "CACHE_POLICIES", "SLOT_METADATA_BYTES", "cache_rows_for"]

# Per logical row in the tier map: its cache slot (int32) and accesses (int32); its record in the file
# (int32, the map's third column) is counted by RecordSpace.
_MAP_BYTES = 8


class TieredStore(TierTransfer, TierCache, TierReads, TierPrefetch, LayoutViews, Pinnable):
    """A table whose rows live in a file under `storage_dir`, at most `memory_budget` bytes of them in memory.

    Args:
        index: the key index, a HashStore or ArrayStore built with ``rows=False`` (it carries
            the table's name, layout, capacity, admission and eviction settings).
        initializer, init_state, seed: how new rows start (as for the index's store kind).
        memory_budget: bytes of resident rows (with their 37 B of cache metadata each); the
            key index is not in it (``memory_breakdown()`` reports it beside).
        storage_dir: the tier's directory (a subdirectory per table is made in it).
        cache_policy: "lfu" or "lru".
        owner: a tag naming the run: a directory left by a crashed run is reused only by the
            same owner (None: never reused).
        io_threads: reads / writes in flight.
    """

    def __init__(self, index, *, initializer, init_state, seed: int, memory_budget: int, storage_dir,
                 cache_policy: str = "lfu", owner: str | None = None, io_threads: int = IO_THREADS) -> None:
        if index.has_rows:
            raise ConfigError(f"table '{index.name}': the index of a TieredStore is built with rows=False")
        name = index.name
        if index.device.type != "cpu":
            raise ConfigError(f"table '{name}': a disk-tiered table lives on the CPU, not {index.device}")
        if cache_policy not in CACHE_POLICIES:
            raise ConfigError(f"table '{name}': cache_policy must be one of {CACHE_POLICIES}, got {cache_policy!r}")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
            raise ConfigError(f"table '{name}': memory_budget must be a positive int (bytes), got {memory_budget!r}")
        if storage_dir is None or str(storage_dir) == "":
            raise ConfigError(f"table '{name}': a tiered table needs a storage_dir")
        lay = index.layout
        cap = cache_rows_for(memory_budget, lay.row_bytes)
        if cap < 1:
            raise ConfigError(f"table '{name}': memory_budget {memory_budget} B holds no row "
                              f"({lay.row_bytes} B + {SLOT_METADATA_BYTES} B each)")
        self.index, self.layout = index, lay
        self.name, self.dim, self.state_width, self.width = name, index.dim, index.state_width, lay.width
        self.dtype, self.device = index.dtype, index.device
        self.initializer, self.init_state, self.seed = initializer, init_state, int(seed)
        self.memory_budget, self.cache_policy, self.capacity_rows = memory_budget, cache_policy, cap
        self._dir = TableDir(storage_dir, name, lay.describe(), owner)
        self.file = RowFile(self._dir.new_rows_path(), lay.row_bytes, name, io_threads)
        self._pins = PinnedRows()
        self._index_pins: dict[int, int] = {}
        self._cache_epoch = 0
        self._clock = 0
        self._rows = lay.empty(cap)
        self._owner = torch.full((cap,), -1, dtype=torch.int64)  # cache slot -> logical slot
        self._keys = torch.zeros(cap, dtype=torch.int64)
        self._tick = torch.zeros(cap, dtype=torch.int64)
        self._dirty = torch.zeros(cap, dtype=torch.bool)
        self._slot_freq = torch.zeros(cap, dtype=torch.int32)  # accesses of resident rows (_freq: the others')
        self._free = torch.arange(cap - 1, -1, -1, dtype=torch.int64)  # a stack: smallest slot on top
        self._nfree = cap
        self._space = RecordSpace(lay.row_bytes, name)
        self._bind_map(new_map(0))
        self.native_loops = _native.available()  # the fetch's per-id passes as native loops (else torch ops)
        self.stats = {"accesses": 0, "hits": 0, "rows_read": 0, "rows_written": 0, "rows_prefetched": 0,
                      "rows_relocated": 0}
        self._pool: ThreadPoolExecutor | None = None
        # reads started by prefetch, oldest first, at most 2: (future, logical, rows, stale logical slots)
        self._staged: list[tuple[Future, torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []
        # what reserve made room for: (keys, their logical slots, the plan, _drops, write_stamp then)
        self._reserved: tuple | None = None
        self._pre_read: tuple[torch.Tensor, torch.Tensor] | None = None  # (logical, cache slots)
        self._pre_plan = None  # (the FetchPlan the pre-read came from, the numbers of its rows there)
        self._drops = 0  # key index frees of logical slots (a FetchPlan made before holds no more)
        self._moves = 0  # cleanings (records of rows moved)
        index.on_free = self._drop_logical
        index.row_norms = self._logical_norms

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_pending(self) -> int:
        return 0 if self.index.settings.static else self.index.num_pending

    @property
    def capacity(self):
        return self.index.settings.capacity

    @property
    def resident_rows(self) -> int:
        return self.capacity_rows - self._nfree

    @property
    def stored_rows(self) -> int:
        """Rows whose current value is in the tier's file (its live records)."""
        return self._space.n_live

    def _logical_rows(self) -> int:
        return self.index.storage().shape[0]

    def _fit_map(self) -> None:
        """Grows the per-logical-row map with the key index (new logical slots: not resident, not on disk)."""
        n = self._logical_rows()
        if n > self._map.shape[0]:
            self._bind_map(new_map(n, self._map))

    def _bind_map(self, m: torch.Tensor) -> None:
        """The tier map, one int32 record per logical row (store/_tier_cache.py); its columns as views."""
        self._map = m
        self._where, self._freq = m[:, 0], m[:, 1]  # cache slot (-1: not resident); accesses while not resident
        self._space.bind(m[:, 2])  # record in the file (-1: none)

    # -------------------------------------------------------------- protocol
    def storage(self) -> torch.Tensor:
        return self._rows

    def keys_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The keys of the rows at cache `slots` (stochastic rounding draws by key)."""
        return self._keys[slots]

    @one_thread
    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        keys = as_keys(self.name, keys, self.device)
        step = check_step(self.name, step)
        counts = as_counts(self.name, counts, keys.numel(), self.device)
        if keys.numel() == 0:
            return keys.clone()
        reserved, self._reserved = self._reserved, None
        if reserved is not None and reserved[3:] == (self._drops, getattr(self, "write_stamp", 0)) \
                and reserved[0].shape == keys.shape and torch.equal(reserved[0], keys):
            known, plan = reserved[1], reserved[2]  # nothing changed since: room made, plan made
        else:
            known = self.index.find(keys)
            plan = self._make_room_for(known)
        self._read_before_counting(known, plan)  # a read that fails changes nothing: the index has not counted
        try:
            logical = self.index.find_or_insert(keys, step, counts=counts)
        except BaseException:
            self._give_back_pre_read()
            raise
        self._fit_map()
        return self._bring_in(logical, keys, counts, training=True, plan=plan)

    @one_thread
    def reserve(self, keys: torch.Tensor) -> None:
        """Makes room in the cache for `keys` (victims written back) ahead of ``find_or_insert(keys)``:
        a collection reserves in every tiered table before any table counts or inserts, so a write
        that fails (the disk full) fails the whole fetch before it changed anything.  Changes no row,
        key or count; the next ``find_or_insert`` of the same keys skips making room again."""
        keys = as_keys(self.name, keys, self.device)
        self._reserved = None
        if keys.numel():
            known = self.index.find(keys)
            plan = self._make_room_for(known)
            self._reserved = (keys, known, plan, self._drops, getattr(self, "write_stamp", 0))

    def hit_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """Hits of `keys` so far (the key index keeps them); changes nothing."""
        return self.index.hit_counts(keys)

    @one_thread
    def find(self, keys: torch.Tensor) -> torch.Tensor:
        keys = as_keys(self.name, keys, self.device)
        if keys.numel() == 0:
            return keys.clone()
        logical = self.index.find(keys)
        plan = self._make_room_for(logical, new_rows=False)  # a key without a row reads zeros: no slot
        return self._bring_in(logical, keys, None, training=False, plan=plan)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self._rows, as_slots(self.name, slots, self.capacity_rows, self.device))

    @direct_write
    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        slots = as_slots(self.name, slots, self.capacity_rows, self.device)
        scatter_rows(self.name, self._rows, slots, rows)
        self._set_dirty(slots[slots >= 0])

    # ------------------------------------------------------------- eviction
    def evict(self, step: int, ttl: int | None = None, max_rows: int | None = None, policy: str | None = None,
              protect: torch.Tensor | None = None, min_norm: float | None = None) -> int:
        """As HashStore.evict (keys leave the table); `protect` holds cache slots."""
        if protect is not None:
            p = as_slots(self.name, protect.reshape(-1), self.capacity_rows, self.device)
            protect = self._owner[p[p >= 0]]
            protect = protect[protect >= 0]
        return self.index.evict(step, ttl=ttl, max_rows=max_rows, policy=policy, protect=protect, min_norm=min_norm)

    @direct_write
    def remove(self, keys: torch.Tensor) -> int:
        """As HashStore.remove (a snapshot delta's removed keys): the key index drops them and frees
        their slots, whose cached and stored rows go with them.  A static table refuses."""
        self._join_staged()
        return self.index.remove(keys)

    # ----------------------------------------------------------------- pins
    def pin(self, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> int:
        h = self._pins.pin(slots, start, stop)
        if not self.index.settings.static:  # a dynamic index evicts keys: their logical slots stay too
            own = self._owner[slots.reshape(-1)[start:stop].clamp(min=0)]
            own = own[slots.reshape(-1)[start:stop] >= 0]
            self._index_pins[h] = self.index.pin(own)
        return h

    def unpin(self, handle: int) -> None:
        self._pins.unpin(handle)
        ih = self._index_pins.pop(handle, None)
        if ih is not None:
            self.index.unpin(ih)

    @property
    def eviction_epoch(self) -> int:
        """Changes whenever a cache slot may have changed hands (cache or key eviction, import)."""
        return self._pins.epoch + self._cache_epoch + self.index.eviction_epoch

    def flush(self) -> None:
        """Writes every dirty resident row to the tier (they stay resident)."""
        self._write_back((self._owner >= 0).nonzero().squeeze(1))

    # --------------------------------------------------------------- memory
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes in memory by part.  `resident_rows` + `cache_metadata` are what `memory_budget` bounds;
        `index` (the key index: keys, slots, counts, last steps) and `tier_map` (per logical row: cache
        slot, accesses, record in the file; per file segment its live count) are beside it."""
        self._fit_map()
        return {"resident_rows": self._rows.numel() * self._rows.element_size(),
                "cache_metadata": SLOT_METADATA_BYTES * self.capacity_rows,
                "index": self.index.memory_bytes(),
                "tier_map": _MAP_BYTES * self._where.numel() + self._space.memory_bytes()}

    def memory_bytes(self) -> int:
        return sum(self.memory_breakdown().values())

    def index_overhead_bytes(self) -> int:
        b = self.memory_breakdown()
        return b["index"] + b["tier_map"] + b["cache_metadata"]

    def stored_bytes(self) -> int:
        """Bytes of rows in the tier's file (live records; the file also holds garbage records, at most
        ~25% beside them, see store/_tier_space.py)."""
        return self.stored_rows * self.layout.row_bytes

    def cache_stats(self) -> dict[str, float | int]:
        """Accesses (id occurrences read), hits (served from memory), hit rate, rows read / written / prefetched."""
        s = dict(self.stats)
        s["hit_rate"] = s["hits"] / s["accesses"] if s["accesses"] else 0.0
        s["resident_rows"], s["capacity_rows"], s["stored_rows"] = self.resident_rows, self.capacity_rows, \
            self.stored_rows
        return s

    def to(self, device) -> "TieredStore":
        if canonical_device(device) != self.device:
            raise ConfigError(f"table '{self.name}': a disk-tiered table stays on the CPU (asked: {device})")
        return self

    def close(self) -> None:
        """Closes the tier (its rows file is deleted: snapshots hold the table)."""
        self._join_staged()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.file.close()
        self._dir.close()

    def __repr__(self) -> str:
        return (f"TieredStore(name={self.name!r}, dim={self.dim}, rows={len(self)}, resident={self.resident_rows}"
                f"/{self.capacity_rows}, policy={self.cache_policy!r}, dir={str(self._dir.path)!r})")
