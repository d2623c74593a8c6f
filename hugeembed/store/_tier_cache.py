"""The cache half of a TieredStore: which logical rows are resident in which cache slot, victims,
write-back, reading rows in and prefetching them (store/_tiered.py is the table; this is its cache)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .. import _native
from ..errors import CapacityError, StoreError
from ._common import as_keys, init_rows, lowest_k
from ._tier_space import MOVED

__all__ = ["TierCache", "CACHE_POLICIES", "SLOT_METADATA_BYTES", "cache_rows_for", "cache_victims"]

CACHE_POLICIES = ("lru", "lfu")
# Per cache slot beside its row: owner (logical slot), key, last access, its place in the free
# stack (int64 each), the row's accesses (int32: the LFU order, read without touching the
# per-logical-row map), dirty (bool).
SLOT_METADATA_BYTES = 37
_EVICT_SLACK = 64


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


class TierCache:
    """Mixin of TieredStore: the cache slots and the moves between them and the tier (state set by
    TieredStore.__init__)."""

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
