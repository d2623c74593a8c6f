"""The cache half of a TieredStore: which logical rows are resident in which cache slot, victims,
write-back, the bring-in (store/_tiered.py is the table; this is its cache; _tier_read.py reads rows into
its slots; _tier_prefetch.py its read-ahead).

The tier map is one record per logical row (``_map``, int32 [N, 3]: cache slot, accesses while not
resident, record in the file), so that a miss touches one cache line, not three arrays.  The
per-id passes of a fetch -- where each id's row is, the missing rows' slots and metadata, the
accesses, the dirty bits, the records that become garbage; the dirty victims' rows gathered and
their slots freed -- are native loops over it (csrc/tier_cache.cpp: he_tier_plan, he_tier_admit,
he_tier_dirty_rows, he_tier_release); the torch twins below do the same and the tests compare
them.  Ids may repeat: a row is read in once and counted once per occurrence."""

from __future__ import annotations

import functools

import torch

from .. import _native
from ..errors import CapacityError, StoreError
from ._evict import EVICTION_POLICIES, choose_victims, policy_columns
from ._tier_file import outer_threads
from ._tier_space import MOVED

__all__ = ["TierCache", "FetchPlan", "CACHE_POLICIES", "SLOT_METADATA_BYTES", "MAP_WIDTH", "cache_rows_for",
           "new_map", "one_thread"]

CACHE_POLICIES = EVICTION_POLICIES  # the cache's victims are chosen as the dynamic store's (store/_evict.py)
MAP_WIDTH = 3  # per logical row: cache slot (-1: not resident), accesses while not resident, record (-1: none)
# Per cache slot beside its row: owner (logical slot), key, last access, its place in the free
# stack (int64 each), the row's accesses (int32: the LFU order, read without touching the
# per-logical-row map), dirty (bool).
SLOT_METADATA_BYTES = 37
# A full cache frees what a call needs plus C/16 rows: the victim choice costs a pass over the
# whole cache however few it takes (he_choose_victims, C = 678 k at d64: about the same for 3 k as
# for 24 k victims), so at C/64 it ran every step of bench/tiered.py case 1 (~12 k misses a step);
# at C/16 once per ~4 steps, for ~0.4 % more misses (the cache holds ~2 % fewer rows on average).
_EVICT_SLACK = 16
_CLEAN_SEGMENTS = 8  # segments (~1 MiB each) a cleaning reads into one buffer at a time


def cache_rows_for(memory_budget: int, row_bytes: int) -> int:
    """Rows a cache of `memory_budget` bytes holds (each row with its slot metadata)."""
    return int(memory_budget) // (int(row_bytes) + SLOT_METADATA_BYTES)


def one_thread(method):
    """Runs `method` with one intra-op thread.  The tier's torch ops are small (a batch's ids, a few
    segments): split over OpenMP workers, each op ends at a barrier where the caller spins until every
    worker ran, and on a busy machine a worker waits for a core -- with 2 threads a d64 step took ~10x
    the in-memory one.  The setting is this thread's (libgomp's per-thread ICV) and is restored; the
    tier's file copies (store/_tier_file.py: caller_threads) still use the threads outside."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        if n == 1:
            return method(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            with outer_threads(n):
                return method(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    return wrapper


def new_map(rows: int, old: torch.Tensor | None = None) -> torch.Tensor:
    """A tier map of `rows` records (not resident, no accesses, not on disk), `old`'s first."""
    m = torch.empty((rows, MAP_WIDTH), dtype=torch.int32)
    m[:, 0], m[:, 1], m[:, 2] = -1, 0, -1
    if old is not None:
        m[: old.shape[0]] = old
    return m


def _first_seen(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct values of `x` in first-seen order, and for each entry its value's index among them."""
    u, inv = torch.unique(x, return_inverse=True)
    first = torch.full((u.numel(),), x.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inv, torch.arange(x.numel()), "amin")
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return u[order], rank[inv]


class FetchPlan:
    """Where a fetch's rows are (he_tier_plan over its logical slots), made once when the fetch makes
    room and carried to the reads and the bring-in.  It stays true while no slot is freed (the
    store's ``_drops``: victims are never rows of the call); records the cleaner moved since are
    looked up again (``_moves``).  cs: each id's cache slot (-1: no row; -2 - j: the j-th missing
    row), mpos: each missing row's first position, rec: its record (-1: a new row)."""

    __slots__ = ("logical", "cs", "mpos", "rec", "drops", "moves")

    def __init__(self, logical, cs, mpos, rec, drops: int, moves: int) -> None:
        self.logical, self.cs, self.mpos, self.rec, self.drops, self.moves = logical, cs, mpos, rec, drops, moves


class TierCache:
    """Mixin of TieredStore: the cache slots and the moves between them and the tier (state set by
    TieredStore.__init__)."""

    # ------------------------------------------------------------ the cache
    def _make_room_for(self, logical: torch.Tensor, new_rows: bool = True) -> FetchPlan | None:
        """Frees cache slots for every row of `logical` (-1: a key that may get a new row, when
        `new_rows`) not resident, evicting (and writing back) rows this call does not read; changes
        no row's value.  Returns the fetch's plan (native loops; None for the torch twins)."""
        self._fit_map()
        if self.native_loops:
            plan = self._plan(logical)
            missing, exclude = plan.mpos.numel(), plan.cs  # entries < 0 (not resident) are ignored
            mine = int((plan.cs >= 0).sum())
        else:
            plan = None
            known = logical[logical >= 0]
            cs = self._where[known].to(torch.int64)
            missing = int(torch.unique(known[cs < 0]).numel())
            exclude = cs[cs >= 0]
            mine = exclude.numel()
        need = missing + (int((logical < 0).sum()) if new_rows else 0)
        if need <= self._nfree:
            return plan
        short = need - self._nfree
        want = short + self.capacity_rows // _EVICT_SLACK
        pinned = self._pins.slots()
        exclude = exclude if pinned is None else torch.cat([exclude, pinned.to(torch.int64)])
        cols = policy_columns(self.cache_policy, self._slot_freq, self._tick, self._keys)
        try:
            n, victims = choose_victims(cols, want, self._owner, exclude, short)
        except _native.KernelError as e:
            raise StoreError(f"table '{self.name}': the victim choice (he_choose_victims) failed: {e} "
                             f"(internal error)") from None
        if n < short:
            used = int((self._owner >= 0).sum())
            raise CapacityError(
                f"table '{self.name}': the memory budget holds {self.capacity_rows} rows; this call needs {need} "
                f"more resident beside its {mine}, and only {n} can leave the cache "
                f"({used - n - mine} are pinned by batches whose backward has not "
                f"run): raise memory_budget")
        self._write_back(victims)
        self._release_slots(victims)
        self._cache_epoch += 1
        return plan

    def _plan(self, logical: torch.Tensor) -> FetchPlan:
        """he_tier_plan over `logical` (changes nothing)."""
        n = logical.numel()
        cs = torch.empty_like(logical)
        scratch = torch.empty((2, n), dtype=torch.int64)
        m = self._native_call("he_tier_plan", [self._map, logical, cs, scratch[0], scratch[1]])
        return FetchPlan(logical, cs, scratch[0, :m], scratch[1, :m], self._drops, self._moves)

    def _plan_for(self, logical: torch.Tensor, plan: FetchPlan | None) -> FetchPlan:
        """`plan` if it still holds for `logical` (the same slots, none freed since; the records of
        its missing rows looked up again if the cleaner moved rows), else a new one."""
        if plan is None or plan.drops != self._drops or not (
                plan.logical is logical or (plan.logical.shape == logical.shape and torch.equal(plan.logical, logical))):
            return self._plan(logical)
        if plan.moves != self._moves:
            plan.rec = self._space.records_of(logical[plan.mpos])
            plan.moves = self._moves
        return plan

    def _native_call(self, kernel: str, bufs: list, ints=()) -> int:
        try:
            return _native.call(kernel, bufs, ints)
        except _native.KernelError as e:
            raise StoreError(f"table '{self.name}': {kernel} failed: {e} (internal error)") from None

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
        if self.native_loops:  # the dirty ones listed; their rows are written from their slots
            m = slots.numel()
            out = torch.empty((2, m), dtype=torch.int64)
            nd = self._native_call("he_tier_dirty_rows", [slots, self._owner, self._dirty.view(torch.uint8),
                                                          self._rows.view(torch.uint8), out[0], out[1],
                                                          torch.empty(0, dtype=torch.uint8)], [self.layout.row_bytes])
            d, logical = out[0, :nd], out[1, :nd]
        else:
            d = slots[self._dirty[slots]]
            logical = self._owner[d]
        if d.numel() == 0:
            return
        self._append(logical, slots=d)
        self._dirty[d] = False
        self.stats["rows_written"] += d.numel()

    def _append(self, logical: torch.Tensor, rows: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> None:
        """Writes `rows` (or the cached rows at `slots`) as the rows of `logical` to fresh records, first
        moving the rows of the segments the space cleans to make room (their values do not change).
        Records are committed after their write: a failure leaves every row readable where it was."""
        move = self._space.to_clean(logical.numel())
        if move.numel():
            self._moves += 1  # records of rows a fetch planned may change (FetchPlan)
            self._move_rows(move)
        plan = self._space.plan(logical)
        if rows is None:
            self.file.write_rows(plan.records, self._rows, slots)
        else:
            self.file.write(plan.records, rows)
        self._space.commit(plan, logical)
        self._mark_stale(logical)

    def _move_rows(self, move: torch.Tensor) -> None:
        """Moves the rows `move` (a cleaning's: the live rows of a few segments, segment by segment) to
        fresh records, _CLEAN_SEGMENTS segments at a time: each part read as whole segments (a few large
        sequential reads instead of one per run of live records), its live rows written, committed.  The
        buffers stay ~8 MiB however much a write-back cleans (the room kept for 4 write-backs of C/16
        rows: up to ~60 MiB of segments in bench/tiered.py case 1)."""
        S = self._space.S
        rec = self._space.records_of(move)
        per_seg = torch.unique_consecutive(rec // S, return_counts=True)[1]
        ends = per_seg.cumsum(0)[_CLEAN_SEGMENTS - 1 :: _CLEAN_SEGMENTS].tolist()
        if not ends or ends[-1] != move.numel():
            ends.append(move.numel())
        a = 0
        for b in ends:
            part, r = move[a:b], rec[a:b]
            got, where = torch.unique(r // S, return_inverse=True)
            whole = (got.unsqueeze(1) * S + torch.arange(S)).reshape(-1)
            buf = self.layout.empty(whole.numel())
            self.file.read(whole, buf)
            plan = self._space.plan(part, MOVED)
            self.file.write_rows(plan.records, buf, where * S + r % S)  # gathered from the segments read
            self._space.commit(plan, part)
            self._mark_stale(part)
            self.stats["rows_relocated"] += part.numel()
            a = b

    def _release_slots(self, slots: torch.Tensor) -> None:
        """Cache slots back to the free stack (their rows are on disk or not needed)."""
        if slots.numel() == 0:
            return
        if self.native_loops:
            self._nfree = self._native_call("he_tier_release", [self._map, slots, self._owner,
                                                                self._dirty.view(torch.uint8), self._slot_freq,
                                                                self._free], [self._nfree])
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
                  training: bool, plan: FetchPlan | None = None) -> torch.Tensor:
        """Cache slots of `logical` (rows read in or created where missing); -1 where logical is -1.
        Training, each id counts (`counts`: its occurrences) and its row becomes dirty.  `plan`: the
        fetch's, if made already (used while it holds)."""
        if self.native_loops:
            return self._bring_in_native(logical, keys, counts, training, plan)
        valid = logical >= 0
        out = torch.full_like(logical, -1)
        lv, kv = logical[valid], keys[valid]
        cv = torch.ones_like(lv) if counts is None else counts[valid]
        u, inv = _first_seen(lv)  # a row is read in once, however often its id repeats
        cs = self._where[u].to(torch.int64)
        miss = cs < 0
        n_miss = int(miss.sum())
        if n_miss:
            first = torch.full((u.numel(),), lv.numel(), dtype=torch.int64)
            first.scatter_reduce_(0, inv, torch.arange(lv.numel()), "amin")
            ml, mk = u[miss], kv[first[miss]]
            rec = self._space.records_of(ml)
            slots = self._fill_missing(ml, mk, rec)
            self._owner[slots] = ml
            self._keys[slots] = mk
            self._slot_freq[slots] = self._freq[ml]
            self._where[ml] = slots.to(torch.int32)
            self._dirty[slots] = rec < 0  # not on disk: must be written if it leaves
            cs[miss] = slots
        self._clock += 1
        self._tick[cs] = self._clock
        if training:
            self._set_dirty(cs)
            uc = torch.zeros(u.numel(), dtype=torch.int64).index_add_(0, inv, cv)
            # counted on the cache slot (a small array): the logical map gets it when the row leaves
            self._slot_freq[cs] = (self._slot_freq[cs].to(torch.int64) + uc).clamp_(max=2**31 - 1).to(torch.int32)
        total = int(cv.sum())
        self.stats["accesses"] += total
        self.stats["hits"] += total - (int(cv[miss[inv]].sum()) if n_miss else 0)
        out[valid] = cs[inv]
        return out

    def _bring_in_native(self, logical: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor | None,
                         training: bool, plan: FetchPlan | None) -> torch.Tensor:
        """_bring_in as two native loops around the reads: he_tier_plan finds the missing rows (changing
        nothing; the fetch's plan where it holds), they are read into fresh slots, he_tier_admit records
        them and stamps every id."""
        n = logical.numel()
        plan = self._plan_for(logical, plan)
        cs, mpos, rec = plan.cs, plan.mpos, plan.rec
        m = mpos.numel()
        slots = self._fill_missing(logical[mpos], keys[mpos], rec, plan) if m else mpos
        out = torch.empty(3 + m + n, dtype=torch.int64)
        self._clock += 1
        live = self._space.live
        emptied = self._native_call("he_tier_admit", [
            self._map, logical, keys, counts, cs, mpos, slots, self._owner, self._keys, self._tick,
            self._dirty.view(torch.uint8), self._slot_freq, live, out], [self._clock, int(training), self._space.S])
        acc, hits, released = out[:3].tolist()
        self.stats["accesses"] += acc
        self.stats["hits"] += hits
        if released:
            self._space.dropped(released, sorted(out[3 : 3 + emptied].tolist()))  # as torch.unique
        return cs

    def _drop_logical(self, freed: torch.Tensor) -> None:
        """The key index freed these logical slots (keys evicted or replaced): their rows are gone."""
        self._fit_map()
        self._drops += 1  # a plan made before holds no more (FetchPlan)
        if self._pre_read is not None:  # a row read ahead of the index call whose key left: not taken
            self._pre_plan = None
            pl, ps = self._pre_read
            gone = torch.isin(pl, freed)
            if bool(gone.any()):
                self._pre_read = (pl[gone], ps[gone])
                self._give_back_pre_read()
                self._pre_read = (pl[~gone], ps[~gone]) if bool((~gone).any()) else None
        cs = self._where[freed].to(torch.int64)
        cs = cs[cs >= 0]
        if cs.numel():
            self._release_slots(cs)
            self._cache_epoch += 1
        self._space.release(freed)
        self._freq[freed] = 0
        self._mark_stale(freed)
