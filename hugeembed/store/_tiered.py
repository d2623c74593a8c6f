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
the all-in-memory one (the tests compare rows, state and metrics).  Stochastic rounding
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
fetch evicts what it needs plus 1/64 of the cache (so victims are chosen once per
C/64 misses, not every call).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .._device import canonical_device
from .. import _native
from ..errors import CapacityError, ConfigError, InputError, StoreError
from ._common import (as_counts, as_keys, as_slots, check_step, direct_write, gather_rows, init_rows, lowest_k,
                      scatter_rows)
from ._layout import LayoutViews, check_import_rows
from ._pins import Pinnable, PinnedRows
from ._protocol import ExportIndex, StoreExport
from ._tier_file import IO_THREADS, RowFile, TableDir
from ._tier_space import MOVED, RecordSpace

__all__ = ["TieredStore", "CACHE_POLICIES", "SLOT_METADATA_BYTES", "cache_rows_for"]

CACHE_POLICIES = ("lru", "lfu")
# Per cache slot beside its row: owner (logical slot), key, last access, its place in the free
# stack (int64 each), the row's accesses (int32: the LFU order, read without touching the
# per-logical-row map), dirty (bool).
SLOT_METADATA_BYTES = 37
# Per logical row in the tier map: its cache slot (int32) and accesses (int32); its record in the file
# (int32) is RecordSpace's.
_MAP_BYTES = 8
_EVICT_SLACK = 64
_CHUNK_ROWS = 1 << 16  # rows per chunk when streaming a table in or out


def cache_rows_for(memory_budget: int, row_bytes: int) -> int:
    """Rows a cache of `memory_budget` bytes holds (each row with its slot metadata)."""
    return int(memory_budget) // (int(row_bytes) + SLOT_METADATA_BYTES)


def cache_victims(owner: torch.Tensor, tick: torch.Tensor, keys: torch.Tensor, freq: torch.Tensor | None,
                  exclude: torch.Tensor, min_take: int, want: int) -> tuple[int, torch.Tensor]:
    """he_cache_victims (csrc/tier_cache.cpp): among cache slots s with ``owner[s] >= 0`` not in `exclude`
    (entries < 0 ignored), the ``min(candidates, want)`` smallest by (freq[s], tick[s], keys[s]) --
    (tick[s], keys[s]) when `freq` is None -- in ascending slot order.  Returns (candidates, victims);
    victims is empty when there are fewer than `min_take` candidates.  Raises _native.KernelError
    (BAD_VALUE) for an `exclude` entry that is no slot of the cache."""
    cap = owner.numel()
    exclude = exclude.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(max(0, min(int(want), cap)), dtype=torch.int64)
    n = _native.call("he_cache_victims", [owner, tick, keys, freq, exclude, out], [int(min_take), int(want)])
    if n < min_take:
        return n, out[:0]
    return n, out[: min(n, out.numel())]


class TieredStore(LayoutViews, Pinnable):
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
        self._where = torch.zeros(0, dtype=torch.int32)  # logical slot -> cache slot (-1: not resident)
        self._freq = torch.zeros(0, dtype=torch.int32)
        self._space = RecordSpace(lay.row_bytes, name)
        self.stats = {"accesses": 0, "hits": 0, "rows_read": 0, "rows_written": 0, "rows_prefetched": 0,
                      "rows_relocated": 0}
        self._pool: ThreadPoolExecutor | None = None
        # reads started by prefetch, oldest first, at most 2: (future, logical, rows, stale logical slots)
        self._staged: list[tuple[Future, torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []
        self._reserved: torch.Tensor | None = None  # keys the cache made room for (reserve)
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
        have = self._where.numel()
        if n > have:
            grow = lambda t, fill: torch.cat([t, torch.full((n - have,), fill, dtype=t.dtype)])  # noqa: E731
            self._where, self._freq = grow(self._where, -1), grow(self._freq, 0)
            self._space.grow(n)

    # -------------------------------------------------------------- protocol
    def storage(self) -> torch.Tensor:
        return self._rows

    def keys_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The keys of the rows at cache `slots` (stochastic rounding draws by key)."""
        return self._keys[slots]

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        keys = as_keys(self.name, keys, self.device)
        step = check_step(self.name, step)
        counts = as_counts(self.name, counts, keys.numel(), self.device)
        if keys.numel() == 0:
            return keys.clone()
        reserved, self._reserved = self._reserved, None
        if reserved is None or not (reserved.shape == keys.shape and torch.equal(reserved, keys)):
            self._make_room_for(self.index.find(keys))
        logical = self.index.find_or_insert(keys, step, counts=counts)
        self._fit_map()
        return self._bring_in(logical, keys, counts, training=True)

    def reserve(self, keys: torch.Tensor) -> None:
        """Makes room in the cache for `keys` (victims written back) ahead of ``find_or_insert(keys)``:
        a collection reserves in every tiered table before any table counts or inserts, so a write
        that fails (the disk full) fails the whole fetch before it changed anything.  Changes no row,
        key or count; the next ``find_or_insert`` of the same keys skips making room again."""
        keys = as_keys(self.name, keys, self.device)
        self._reserved = None
        if keys.numel():
            self._make_room_for(self.index.find(keys))
        self._reserved = keys

    def hit_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """Hits of `keys` so far (the key index keeps them); changes nothing."""
        return self.index.hit_counts(keys)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        keys = as_keys(self.name, keys, self.device)
        if keys.numel() == 0:
            return keys.clone()
        logical = self.index.find(keys)
        self._make_room_for(logical[logical >= 0])  # a key without a row reads zeros: no slot
        return self._bring_in(logical, keys, None, training=False)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self._rows, as_slots(self.name, slots, self.capacity_rows, self.device))

    @direct_write
    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        slots = as_slots(self.name, slots, self.capacity_rows, self.device)
        scatter_rows(self.name, self._rows, slots, rows)
        self._set_dirty(slots[slots >= 0])

    # ------------------------------------------------------------ the cache
    def _make_room_for(self, logical: torch.Tensor) -> None:
        """Frees cache slots for every row of `logical` (-1: a key that may get a new row) not resident,
        evicting (and writing back) rows this call does not read; changes no row's value."""
        self._fit_map()
        known = logical >= 0
        res = torch.full_like(logical, -1)
        res[known] = self._where[logical[known]].to(torch.int64)
        need = int((res < 0).sum())
        if need <= self._nfree:
            return
        short = need - self._nfree
        mine = res[res >= 0]
        want = short + self.capacity_rows // _EVICT_SLACK
        if _native.available():
            victims = self._victims_native(mine, need, short, want)
        else:
            victims = self._victims_torch(mine, need, short, want)
        self._write_back(victims)
        self._release_slots(victims)
        self._cache_epoch += 1

    def _capacity_error(self, need: int, mine: torch.Tensor, candidates: int) -> CapacityError:
        used = int((self._owner >= 0).sum())
        return CapacityError(
            f"table '{self.name}': the memory budget holds {self.capacity_rows} rows; this call needs {need} "
            f"more resident beside its {mine.numel()}, and only {candidates} can leave the cache "
            f"({used - candidates - mine.numel()} are pinned by batches whose backward has not "
            f"run): raise memory_budget")

    def _victims_native(self, mine: torch.Tensor, need: int, short: int, want: int) -> torch.Tensor:
        """The victims (ascending cache slots) chosen by he_cache_victims (csrc/tier_cache.cpp): one pass
        over the slots' metadata and a selection, no tensor over all C slots."""
        pinned = self._pins.slots()
        exclude = mine if pinned is None else torch.cat([mine, pinned.to(torch.int64)])
        freq = None if self.cache_policy == "lru" else self._slot_freq
        try:
            n, victims = cache_victims(self._owner, self._tick, self._keys, freq, exclude, short, want)
        except _native.KernelError as e:
            raise StoreError(f"table '{self.name}': he_cache_victims failed: {e} (internal error)") from None
        if n < short:
            raise self._capacity_error(need, mine, n)
        return victims

    def _victims_torch(self, mine: torch.Tensor, need: int, short: int, want: int) -> torch.Tensor:
        """The plain-PyTorch twin of _victims_native (the kernels not built or disabled)."""
        cand = self._owner >= 0
        cand[mine] = False
        pinned = self._pins.slots()
        if pinned is not None:
            p = pinned[pinned >= 0]
            cand[p] = False
        idx = cand.nonzero().squeeze(1)
        if idx.numel() < short:
            raise self._capacity_error(need, mine, idx.numel())
        take = min(idx.numel(), want)
        if self.cache_policy == "lru":
            cols = [self._tick[idx], self._keys[idx]]
        else:  # the slots' own copy: a gather over the logical map per eviction cost ~27 ms at 700 k slots
            cols = [self._slot_freq[idx].to(torch.int64), self._tick[idx], self._keys[idx]]
        return idx[lowest_k(cols, take)]

    def _set_dirty(self, slots: torch.Tensor) -> None:
        """The cached rows at `slots` are (about to be) newer than any copy on disk: their records are
        garbage from now on (a dirty row has none; it gets a new one when written back)."""
        new = slots[~self._dirty[slots]]  # rows dirty already have no record
        self._dirty[new] = True
        self._space.release(self._owner[new])

    def _write_back(self, slots: torch.Tensor) -> None:
        """Writes the dirty rows among cache `slots` to the tier as one run of fresh records (after moving
        the rows of the segments the space cleans to make room); they stay resident.  A failed read or
        write changes no row: records are committed after their write, and a move keeps values."""
        d = slots[self._dirty[slots]]
        if d.numel() == 0:
            return
        self._append(self._owner[d], self._rows.index_select(0, d))
        self._dirty[d] = False
        self.stats["rows_written"] += d.numel()

    def _append(self, logical: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes `rows` as the rows of `logical` to fresh records, first moving the rows of the segments
        the space cleans to make room (their values do not change).  Records are committed after their
        write: a failure leaves every row readable where it was."""
        move = self._space.to_clean(logical.numel())
        if move.numel():
            moved = self._read_segments_rows(move)
            plan = self._space.plan(move, MOVED)
            self.file.write(plan.records, moved)
            self._space.commit(plan, move)
            self._mark_stale(move)
            self.stats["rows_relocated"] += move.numel()
        plan = self._space.plan(logical)
        self.file.write(plan.records, rows)
        self._space.commit(plan, logical)
        self._mark_stale(logical)

    def _read_segments_rows(self, logical: torch.Tensor) -> torch.Tensor:
        """The rows of `logical` (on disk, a cleaning's moves: most records of a few segments), read as
        whole segments (a few large sequential reads instead of one per run of live records)."""
        S = self._space.S
        rec = self._space.records_of(logical)
        segs, where = torch.unique(rec // S, return_inverse=True)
        whole = (segs.unsqueeze(1) * S + torch.arange(S)).reshape(-1)
        buf = self.layout.empty(whole.numel())
        self.file.read(whole, buf)
        return buf.index_select(0, where * S + rec % S)

    def _release_slots(self, slots: torch.Tensor) -> None:
        """Cache slots back to the free stack (their rows are on disk or not needed)."""
        if slots.numel() == 0:
            return
        own = self._owner[slots]
        self._freq[own] = self._slot_freq[slots]
        self._where[own] = -1
        self._owner[slots] = -1
        self._dirty[slots] = False
        n = slots.numel()
        self._free[self._nfree : self._nfree + n] = slots
        self._nfree += n

    def _take_slots(self, n: int) -> torch.Tensor:
        if n > self._nfree:  # _make_room_for reserved them: reaching this is a bug
            raise StoreError(f"table '{self.name}': cache has {self._nfree} free slots, {n} needed (internal error)")
        out = self._free[self._nfree - n : self._nfree].flip(0).clone()
        self._nfree -= n
        return out

    def _bring_in(self, logical: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor | None,
                  training: bool) -> torch.Tensor:
        """Cache slots of `logical` (rows read in or created where missing); -1 where logical is -1."""
        valid = logical >= 0
        out = torch.full_like(logical, -1)
        if bool(valid.all()):
            lv, kv, cv = logical, keys, counts
        else:
            lv, kv, cv = logical[valid], keys[valid], None if counts is None else counts[valid]
        cs = self._where[lv].to(torch.int64)
        miss = cs < 0
        n_miss = int(miss.sum())
        if n_miss:
            ml, mk = lv[miss], kv[miss]
            slots = self._take_slots(n_miss)
            fresh = ~self._space.on_disk(ml)
            read = ~fresh
            try:
                if bool(read.any()):
                    self._read_rows(ml[read], slots[read])
                if bool(fresh.any()):
                    init_rows(self._rows, slots[fresh], mk[fresh], self.layout, self.initializer, self.init_state,
                              self.seed)
            except BaseException:
                self._free[self._nfree : self._nfree + n_miss] = slots.flip(0)
                self._nfree += n_miss
                raise
            self._owner[slots] = ml
            self._keys[slots] = mk
            self._slot_freq[slots] = self._freq[ml]
            self._where[ml] = slots.to(torch.int32)
            self._dirty[slots[fresh]] = True  # not on disk: must be written if it leaves
            cs[miss] = slots
        self._clock += 1
        self._tick[cs] = self._clock
        if training:
            self._set_dirty(cs)
            c = torch.ones_like(lv) if cv is None else cv
            # counted on the cache slot (a small array): the logical map gets it when the row leaves
            self._slot_freq[cs] = (self._slot_freq[cs].to(torch.int64) + c).clamp_(max=2**31 - 1).to(torch.int32)
        total = int(cv.sum()) if cv is not None else lv.numel()
        missed = (int(cv[miss].sum()) if cv is not None else n_miss) if n_miss else 0
        self.stats["accesses"] += total
        self.stats["hits"] += total - missed
        out[valid] = cs
        return out

    def _read_rows(self, logical: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows of `logical` (on disk) into cache `slots`: from the prefetched ones where staged, else the file."""
        got = self._take_staged(logical, slots)
        rest = ~got
        if bool(rest.any()):
            lg, sl = logical[rest], slots[rest]
            rec = self._space.records_of(lg)
            order = rec.argsort()
            lg, sl = lg[order], sl[order]
            buf = self.layout.empty(lg.numel())
            self.file.read(rec[order], buf)
            self._rows.index_copy_(0, sl, buf)
            self.stats["rows_read"] += lg.numel()

    def _drop_logical(self, freed: torch.Tensor) -> None:
        """The key index freed these logical slots (keys evicted or replaced): their rows are gone."""
        self._fit_map()
        cs = self._where[freed].to(torch.int64)
        cs = cs[cs >= 0]
        if cs.numel():
            self._release_slots(cs)
            self._cache_epoch += 1
        self._space.release(freed)
        self._freq[freed] = 0
        self._mark_stale(freed)

    # ------------------------------------------------------------- prefetch
    def prefetch(self, keys: torch.Tensor) -> int:
        """Starts reading the rows of `keys` (e.g. the next batch's ids) that are on disk and not
        resident, in the background; the next fetches take them from there (the reads of the
        prefetch before stay too: prefetch(batch t+1) is called before step t, whose rows the
        previous call read).  Changes nothing a caller can see (no count, no row, no residency).
        Returns rows being read."""
        keys = as_keys(self.name, keys, self.device)
        self._join_staged(keep=1)
        if keys.numel() == 0:
            return 0
        logical = self.index.find(torch.unique(keys))
        self._fit_map()
        logical = logical[logical >= 0]
        logical = logical[(self._where[logical] < 0) & self._space.on_disk(logical)]
        if logical.numel() == 0:
            return 0
        logical = logical.sort().values
        buf = self.layout.empty(logical.numel())
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"tier-{self.name}")
        # A record read here is never overwritten while it is some row's current one (writes go to
        # fresh records); a row rewritten, moved or freed before its fetch is marked stale.
        rec = self._space.records_of(logical)
        self._staged.append((self._pool.submit(self.file.read, rec, buf), logical, buf, []))
        return logical.numel()

    def _join_staged(self, keep: int = 0) -> None:
        """Waits for and drops the staged reads but the newest `keep`."""
        while len(self._staged) > keep:
            try:
                self._staged.pop(0)[0].result()
            except StoreError:
                pass  # a failed prefetch is only a lost hint: the fetch reads the file itself

    def _mark_stale(self, logical: torch.Tensor) -> None:
        if self._staged and logical.numel():
            logical = logical.clone()
            for s in self._staged:
                s[3].append(logical)

    def _take_staged(self, logical: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Copies staged rows of `logical` into `slots`; a mask of those served."""
        got = torch.zeros(logical.numel(), dtype=torch.bool)
        for fut, staged, buf, stale in self._staged:
            try:
                fut.result()
            except StoreError:
                continue
            if stale:  # rewritten or freed since they were read: the file is newer
                ok = ~torch.isin(staged, torch.cat(stale))
            else:
                ok = torch.ones(staged.numel(), dtype=torch.bool)
            pos = torch.searchsorted(staged, logical).clamp_(max=max(staged.numel() - 1, 0))
            hit = ~got & (staged[pos] == logical) & ok[pos]
            if bool(hit.any()):
                self._rows.index_copy_(0, slots[hit], buf.index_select(0, pos[hit]))
                self.stats["rows_prefetched"] += int(hit.sum())
                got |= hit
        return got

    # ------------------------------------------------------------ reading rows
    def read_logical(self, logical: torch.Tensor) -> torch.Tensor:
        """The current rows of logical slots (cache, else disk, else as a new row starts), copied;
        changes nothing (no residency, no count)."""
        self._fit_map()
        out = self.layout.empty(logical.numel())
        if logical.numel() == 0:
            return out
        cs = self._where[logical].to(torch.int64)
        res = cs >= 0
        if bool(res.any()):
            out[res] = self._rows.index_select(0, cs[res])
        disk = ~res & self._space.on_disk(logical)
        if bool(disk.any()):
            rec = self._space.records_of(logical[disk])
            order = rec.argsort()
            buf = self.layout.empty(rec.numel())
            self.file.read(rec[order], buf)
            part = torch.empty_like(buf)
            part[order] = buf
            out[disk] = part
        fresh = ~res & ~disk
        if bool(fresh.any()):  # a static table's row never trained: its initial value
            idx = fresh.nonzero().squeeze(1)
            init_rows(out, idx, self._keys_of_logical(logical[fresh]), self.layout, self.initializer,
                      self.init_state, self.seed)
        return out

    def _keys_of_logical(self, logical: torch.Tensor) -> torch.Tensor:
        if not self.index.settings.static:  # a dynamic table's rows are in the cache or on disk
            raise StoreError(f"table '{self.name}': logical slots {logical[:4].tolist()} hold no row (internal error)")
        return self.index.keys_of(logical)

    def _logical_norms(self, logical: torch.Tensor) -> torch.Tensor:
        out = torch.empty(logical.numel(), dtype=torch.float32)
        for a in range(0, logical.numel(), _CHUNK_ROWS):
            rows = self.read_logical(logical[a : a + _CHUNK_ROWS])
            out[a : a + _CHUNK_ROWS] = self.layout.weights(rows).float().norm(dim=1)
        return out

    def row_source(self) -> "TierRows":
        """What ``export_index().slots`` index: every row, read from the cache or the tier in chunks."""
        return TierRows(self)

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

    def forget_pending(self, step: int) -> int:
        return self.index.forget_pending(step) if hasattr(self.index, "forget_pending") else 0

    # ----------------------------------------------------------------- pins
    def pin(self, slots: torch.Tensor, start: int = 0, stop: int | None = None) -> int:
        h = self._pins.pin(slots, start, stop)
        if hasattr(self.index, "pin"):  # a dynamic index evicts keys: their logical slots stay too
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

    # ------------------------------------------------------- export / import
    def export_index(self) -> ExportIndex:
        """The index's export: slots are logical (read them with ``row_source()``)."""
        return self.index.export_index()

    def export(self) -> StoreExport:
        return self.export_index().gather(self.row_source())

    @direct_write
    def import_(self, export: StoreExport) -> None:
        """Loads `export` into the tier (streamed in chunks; nothing is made resident but rows already in
        the cache, which are overwritten there)."""
        check_import_rows(self.name, self.layout, export.rows)
        self._refuse_if_pinned("import")
        self._join_staged()
        self.index.import_(_without_rows(export))
        self._fit_map()
        keys = export.keys.to(self.device)
        for a in range(0, keys.numel(), _CHUNK_ROWS):
            k = keys[a : a + _CHUNK_ROWS]
            logical = self.index.find(k)
            if bool((logical < 0).any()):
                raise StoreError(f"table '{self.name}': imported key {int(k[logical < 0][0])} has no row (internal error)")
            rows = export.rows[a : a + _CHUNK_ROWS].to(self.layout.storage_dtype).contiguous()
            cs = self._where[logical].to(torch.int64)
            res = cs >= 0
            if bool(res.any()):
                self._rows[cs[res]] = rows[res]
                self._set_dirty(cs[res])
            disk = ~res
            if bool(disk.any()):
                self._append(logical[disk], rows[disk].contiguous())
        self._cache_epoch += 1

    def update_all(self, fn) -> None:
        """Calls ``fn(cache_slots)`` over every row of the table, a chunk at a time made resident (and
        marked dirty): an in-place pass over a table larger than memory (global Adam's catch-up)."""
        keys = self.export_index().keys
        chunk = max(1, (self.capacity_rows - (len(self._pins.slots() or ()) if len(self._pins) else 0)) // 2)
        for a in range(0, keys.numel(), chunk):
            slots = self.find(keys[a : a + chunk])
            self._set_dirty(slots)
            fn(slots)

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


def _without_rows(export: StoreExport) -> StoreExport:
    """The export as a key index takes it (rows of zero width: the tier writes them)."""
    return StoreExport(export.keys, export.rows[:, :0], export.counts, export.last_step, export.pending_keys,
                       export.pending_counts, export.pending_last_step)


class TierRows:
    """``index_select(0, logical)`` over a TieredStore's rows: what a snapshot streams from."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.dtype = store.layout.storage_dtype
        self.shape = torch.Size([store._logical_rows(), store.width])

    def dim(self) -> int:
        return 2

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise InputError("TierRows: rows are selected along dim 0")
        return self.store.read_logical(index)

