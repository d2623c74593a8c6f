"""What changes a dynamic group other than a training fetch's own find-or-insert: eviction (on a
full table too), expiry, forgetting pending keys, removal, export and import of a table's rows (the
edges: snapshots, deltas, state_dict), and the group's room: index and rows growth, rekeying, row
slots.  Apart from store/_dynamic.py, which keeps the fetch (find-or-insert, admission, new rows, reads).

Each works on one table of the group by its index ``t`` (or, for expiry, on all at once); the
group's index and rows are shared, so a table's keys are found by the table word of each record.
"""

from __future__ import annotations

import math
from operator import attrgetter

import torch

from ..errors import CapacityError, InputError, StoreError
from . import _alloc
from ._admit import pending_victims
from ._evict import check_evict_args, select_victims
from ._index import (EMPTY_TABLE, G_ENTRIES, G_NUM_FREE, G_ROW_HWM, PENDING, T_HASH_KEY, T_PENDING, T_ROWS, code_of,
                     count_of, hash_key)
from ._layout import check_import_rows
from ._protocol import ExportIndex, StoreExport
from ._settings import draw_salt

__all__ = ["DynamicEdits", "MAX_LOAD", "AUTO_EVICT_SLACK"]

# The index grows (x1.5, or to what a batch needs) when it would be fuller than this.  Measured
# (docs/store.md): find at load 0.49 / 0.59 / 0.69 / 0.78 runs at 38 / 33 / 28 / 23 M keys per CPU-second.
MAX_LOAD = 0.6
# on_full="evict" frees this fraction of the capacity beyond what the batch needs, so a full table
# looks for victims once per capacity/64 new rows rather than at every batch.
AUTO_EVICT_SLACK = 64
_GROWTH = 1.5
_MAX_BUCKETS = 2**32
_MIN_ROWS = 64


class DynamicEdits:
    """Mixin of DynamicGroup (store/_dynamic.py): its edits of one table's keys and rows, its growth."""

    # ---------------------------------------------------------------- a table's records
    def entries(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, codes, counts, last steps) of every record of table `t`."""
        rec = self.buckets[self.buckets[:, 1] == t]
        return rec[:, 0], code_of(rec[:, 2]), count_of(rec[:, 2]), rec[:, 3]

    def slot_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """The key held at each row slot (-1 where none): a scan of the index, for the rare callers
        that hold slots without keys (stochastic rounding through a table's own update)."""
        rec = self.buckets[self.buckets[:, 1] != EMPTY_TABLE]
        codes = code_of(rec[:, 2])
        rows = codes >= 0
        out = torch.full((max(self.rows.shape[0], 1),), -1, dtype=torch.int64, device=self.device)
        out[codes[rows]] = rec[rows][:, 0]
        return out[slots]

    def _drop(self, t: int, keys: torch.Tensor, slots: torch.Tensor, pending: int) -> None:
        """Erases `keys` of table `t` (present), frees `slots` (their rows), fixes the counts."""
        if keys.numel():
            tids = torch.full_like(keys, t)
            missing = self._index.erase(self, keys, tids)
            if missing:
                raise StoreError(f"table '{self.settings[t].name}': {missing} keys to erase were not present "
                                 "(internal error)")
        self.release_rows(slots)
        self.tables[t, T_ROWS] -= slots.numel()
        self.tables[t, T_PENDING] -= pending
        self._known = None
        if slots.numel():  # a slot released before now may hold another key later
            self.pins.epoch += 1

    def refuse_if_pinned(self, t: int, what: str) -> None:
        """StoreError when batches in flight hold rows (`what` would move their slots)."""
        if len(self.pins):
            raise StoreError(f"table '{self.settings[t].name}': cannot {what} while {len(self.pins)} batches whose "
                             "backward has not run hold rows of it; run their backward (or drop their outputs) first")

    # ---------------------------------------------------------------- eviction
    def evict(self, t: int, step: int, ttl: int | None = None, max_rows: int | None = None,
              policy: str | None = None, protect: torch.Tensor | None = None, min_norm: float | None = None,
              pending_excess: int = 0) -> int:
        """Removes table `t`'s rows unseen for more than `ttl` steps, rows whose weight L2 norm is
        below `min_norm`, then the least valuable ones down to `max_rows` (policy "lfu" or "lru";
        default the table's), never the slots in `protect` nor pinned ones; then `pending_excess`
        pending keys, fewest hits first.  Pending keys unseen for more than `ttl` steps go too.
        Returns rows removed."""
        s = self.settings[t]
        policy = s.eviction_policy if policy is None else policy
        keys, codes, counts, lasts = self.entries(t)
        rows = codes >= 0
        slots_all = codes[rows]
        norms = None
        if min_norm is not None:
            norms = self.row_norms(slots_all) if self.row_norms is not None else \
                self.layout.weights(self.rows)[slots_all].float().norm(dim=1)  # typed: packed weights
        gone, pgone = select_victims(s.name, step, ttl, max_rows, policy, self.pins.protect(protect),
                                     max(self.rows.shape[0], 1), keys[rows], slots_all, counts[rows], lasts[rows],
                                     keys[~rows], counts[~rows], lasts[~rows], row_norms=norms, min_norm=min_norm,
                                     pending_excess=pending_excess)
        row_slots, pend = slots_all[gone], keys[~rows][pgone]
        self._drop(t, torch.cat([keys[rows][gone], pend]), row_slots, pend.numel())
        return row_slots.numel()

    def _make_room(self, t: int, step: int, needed: int, protect: torch.Tensor, retried: bool) -> None:
        s = self.settings[t]
        cap, live = s.capacity, self.table_rows(t)
        msg = f"table '{s.name}': capacity {cap} rows reached ({live} live); this batch needs {needed} new rows"
        if s.on_full == "error" or needed > cap or retried:
            raise CapacityError(msg + (" and on_full='error'" if s.on_full == "error" else ""))
        self.evict(t, step, max_rows=max(0, cap - needed - cap // AUTO_EVICT_SLACK), protect=protect)
        if self.table_rows(t) + needed > cap:
            raise CapacityError(msg + f"; only {cap - self.table_rows(t)} could be freed without evicting rows of this "
                                "batch" + (f" or of the {len(self.pins)} batches whose backward has not run (pinned)"
                                           if len(self.pins) else ""))

    def expire(self, step: int, ttl: list[int | None], min_norm: list[float | None],
               protect: torch.Tensor | None = None) -> list[int]:
        """Every table's ttl and weight-norm eviction in one pass (table t: ``ttl[t]``,
        ``min_norm[t]``, None for none): what each table's own :meth:`evict` with those alone
        removes.  Returns rows removed per table."""
        T, dev = len(self.settings), self.buckets.device
        for t, s in enumerate(self.settings):
            check_evict_args(s.name, step, ttl[t], None, s.eviction_policy, min_norm[t])
        occupied = self.buckets[:, 1] != EMPTY_TABLE
        rec = self.buckets[occupied]
        tid, codes, lasts = rec[:, 1], code_of(rec[:, 2]), rec[:, 3]
        ttl_v = torch.tensor([-1 if x is None else x for x in ttl], dtype=torch.int64, device=dev)[tid]
        old = (ttl_v >= 0) & ((step - lasts) > ttl_v)
        rows = codes >= 0
        gone = old.clone()
        if any(x is not None for x in min_norm):
            norm_v = torch.tensor([0.0 if x is None else x for x in min_norm], dtype=torch.float64, device=dev)[tid]
            slots = codes.clamp(min=0)
            norms = self.row_norms(slots) if self.row_norms is not None else \
                self.layout.weights(self.rows)[slots].float().norm(dim=1)
            gone |= rows & (norms.double() < norm_v)
        pinned = self.pins.protect(protect)
        if pinned is not None and pinned.numel():
            guard = torch.zeros(max(self.rows.shape[0], 1), dtype=torch.bool, device=dev)
            p = pinned.to(dev, torch.int64)
            guard[p[p >= 0]] = True
            gone &= ~(rows & guard[codes.clamp(min=0)])
        removed = [0] * T
        if not bool(gone.any()):
            return removed
        g_tid, g_codes, g_keys = tid[gone], codes[gone], rec[gone][:, 0]
        g_rows = g_codes >= 0
        per_rows = torch.bincount(g_tid[g_rows], minlength=T).tolist()
        per_pend = torch.bincount(g_tid[~g_rows], minlength=T).tolist()
        missing = self._index.erase(self, g_keys, g_tid)
        if missing:
            raise StoreError(f"tables {self.names()}: {missing} expired keys were not present (internal error)")
        self.release_rows(g_codes[g_rows])
        self._known = None
        self.tables[:, T_ROWS] -= torch.tensor(per_rows, dtype=torch.int64)
        self.tables[:, T_PENDING] -= torch.tensor(per_pend, dtype=torch.int64)
        if sum(per_rows):
            self.pins.epoch += 1
        return per_rows

    def _forget_pending(self, step: int, pending: list[int]) -> int:
        """Forgets the least seen pending keys of each table past its max_pending; returns how many."""
        done = 0
        for t in self._counted:  # (a table without a counter filter has no pending keys)
            s = self.settings[t]
            n = pending_victims(pending[t], s.pending_limit)
            if n:
                self.evict(t, step, policy=s.eviction_policy, pending_excess=n)
                done += n
        return done

    # ---------------------------------------------------------------- removal
    def remove(self, t: int, keys: torch.Tensor) -> int:
        """Removes table `t`'s `keys` (admitted or pending, each present and given once) and frees
        their rows; returns rows freed.  Checked before anything changes; refused while batches in
        flight hold rows (their slots would move)."""
        name = self.settings[t].name
        self.refuse_if_pinned(t, "remove keys")
        if keys.numel() == 0:
            return 0
        ordered = keys.sort().values
        dup = ordered[1:][ordered.diff() == 0]
        if dup.numel():
            raise InputError(f"table '{name}': key {int(dup[0])} is given twice to remove")
        codes = self.codes(torch.full_like(keys, t), keys)
        absent = keys[codes == -1]
        if absent.numel():
            raise InputError(f"table '{name}': cannot remove key {int(absent[0])}: it is neither admitted nor "
                             f"pending ({absent.numel()} of the {keys.numel()} keys are absent)")
        slots = codes[codes >= 0]
        self._drop(t, keys, slots, keys.numel() - slots.numel())
        return slots.numel()

    def reset(self, t: int) -> None:
        """Removes every key of table `t` (its rows freed): before a load replaces its contents."""
        keys, codes, _, _ = self.entries(t)
        rows = codes >= 0
        self._drop(t, keys, codes[rows], int((~rows).sum()))

    # ---------------------------------------------------------------- export / import
    def export_index(self, t: int) -> ExportIndex:
        keys, codes, counts, lasts = self.entries(t)
        order = keys.argsort()
        keys, codes, counts, lasts = keys[order], codes[order], counts[order], lasts[order]
        r = codes >= 0
        return ExportIndex(keys[r], codes[r], counts[r], lasts[r], keys[~r], counts[~r], lasts[~r])

    def check_import(self, t: int, export: StoreExport) -> None:
        """Raises what replacing table t's contents by `export` would raise, changing nothing."""
        s = self.settings[t]
        if self.has_rows:
            check_import_rows(s.name, self.layout, export.rows)
        allk = torch.cat([export.keys, export.pending_keys])
        if allk.numel() > 1 and bool((allk.sort().values.diff() == 0).any()):
            raise InputError(f"table '{s.name}': import holds a key twice")
        if s.capacity is not None and export.keys.numel() > s.capacity:
            raise CapacityError(f"table '{s.name}': import needs {export.keys.numel()} rows, capacity is {s.capacity}")

    def replace_table(self, t: int, export: StoreExport) -> None:
        """Table t's contents become `export`'s (its other keys removed)."""
        self.reset(t)
        self.import_(t, export)

    def renewed(self):
        """This group as a new object over the same arrays (a load replaces its tables' contents: batches
        in flight see the group replaced)."""
        from ._pins import PinnedRows

        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.pins, out.__dict__["_views"] = PinnedRows(), {}
        return out

    def import_(self, t: int, export: StoreExport) -> None:
        """Loads `export` into table `t` (its keys overwritten, the table's other keys kept); rows
        are taken in export order.  Checked before anything changes."""
        s = self.settings[t]
        exp = export.to(self.device)
        if self.has_rows:  # a key index takes rows of zero width
            check_import_rows(s.name, self.layout, exp.rows)
        self.refuse_if_pinned(t, "import")
        allk = torch.cat([exp.keys, exp.pending_keys])
        if allk.numel() > 1 and bool((allk.sort().values.diff() == 0).any()):
            raise InputError(f"table '{s.name}': import holds a key twice")
        if allk.numel() == 0:
            return
        tids = torch.full_like(allk, t)
        present = self.codes(tids, allk)
        n = exp.keys.numel()
        after = self.table_rows(t) - int((present >= 0).sum()) + n
        if s.capacity is not None and after > s.capacity:
            raise CapacityError(f"table '{s.name}': import needs {after} rows, capacity is {s.capacity}")
        old = present != -1
        if bool(old.any()):
            oc = present[old]
            self._drop(t, allk[old], oc[oc >= 0], int((oc < 0).sum()))
            self.pins.epoch += 1  # existing keys get new slots: a released batch's slots are stale
        self._grow_for(allk.numel(), n)
        slots = self.take_rows(n)
        codes = torch.cat([slots, torch.full_like(exp.pending_keys, PENDING)])
        self._index.insert(self, allk, tids, codes, torch.cat([exp.counts, exp.pending_counts]),
                           torch.cat([exp.last_step, exp.pending_last_step]))
        self._known = None
        if self.has_rows:  # a key index's tier writes the rows
            self.rows[slots] = exp.rows.to(self.layout.storage_dtype)
        self.tables[t, T_ROWS] += n
        self.tables[t, T_PENDING] += exp.pending_keys.numel()

    def check_layout(self) -> None:
        """Raises StoreError unless the index's counters agree with its records (for tests and
        after loads): entries, each table's rows and pending keys."""
        occupied = self.buckets[:, 1] != EMPTY_TABLE
        if int(occupied.sum()) != int(self.scalars[G_ENTRIES]):
            raise StoreError(f"tables {self.names()}: {int(occupied.sum())} records, {int(self.scalars[G_ENTRIES])} "
                             "counted")
        rec = self.buckets[occupied]
        codes = code_of(rec[:, 2])
        T = len(self.settings)
        rows = torch.bincount(rec[:, 1][codes >= 0], minlength=T).tolist()
        pend = torch.bincount(rec[:, 1][codes == PENDING], minlength=T).tolist()
        if rows != self.tables[:, T_ROWS].tolist() or pend != self.tables[:, T_PENDING].tolist():
            raise StoreError(f"tables {self.names()}: rows {rows} / pending {pend} held, "
                             f"{self.tables[:, T_ROWS].tolist()} / {self.tables[:, T_PENDING].tolist()} counted")

    # ---------------------------------------------------------------- growth
    def _state_now(self) -> tuple[int, int, int]:
        """(entries, row_hwm, free rows listed): as the last call reported them, else read once."""
        if self._known is None:
            self._known = tuple(self.scalars.tolist())
        return self._known

    def _room_for(self, n: int) -> None:
        """Grows the group ahead of a call of `n` keys that might not fit (were every key new and every
        one a row): the call then needs no second try for room, and its one read tells all.  The
        rows grow ahead by at most one batch more than they turn out to need."""
        entries, hwm, nfree = self._state_now()
        if entries + n > self.max_entries() or hwm + max(0, n - nfree) > self.rows.shape[0]:
            self._grow_for(n, n, ahead=True)

    def _grow_for(self, new_entries: int, new_rows: int, ahead: bool = False) -> None:
        """Grows the index (to under MAX_LOAD, x1.5 at least) and the rows (x1.5) to fit this many
        more (`ahead`: a guess, so rows stop at the tables' capacities instead of raising)."""
        entries, row_hwm, nfree = self._state_now()
        need = entries + new_entries
        nb = self.buckets.shape[0]
        if need > int(nb * MAX_LOAD):
            nb = max(math.ceil(need / MAX_LOAD), int(nb * _GROWTH))
            nb = -(-nb // 64) * 64
            if nb > _MAX_BUCKETS:
                raise CapacityError(f"tables {self.names()}: {need} keys exceed the index limit of one group "
                                    f"({int(_MAX_BUCKETS * MAX_LOAD)})")
            self._rehash(nb)
        hwm = row_hwm + max(0, new_rows - nfree)
        limit = self._rows_limit()
        if ahead:
            hwm = min(hwm, limit)
        if hwm > limit:
            raise CapacityError(f"tables {self.names()}: {hwm} rows exceed the {limit} row slots of one group")
        if hwm > self.rows.shape[0]:
            self._grow_rows(min(limit, max(hwm, int(self.rows.shape[0] * _GROWTH), _MIN_ROWS)))

    def _rows_limit(self) -> int:
        """Row slots the group may hand out: the tables' capacities when all have one."""
        from ._index import MAX_SLOTS

        caps = list(map(attrgetter("capacity"), self.settings))  # (C-level: growth runs no Python per table)
        return MAX_SLOTS if None in caps else min(MAX_SLOTS, sum(caps))

    def _rehash(self, nbuckets: int) -> None:
        new = _alloc.empty((nbuckets, 4), torch.int64, self.device)
        if self.device.type == "meta":  # shapes only (memory planning): no records to move
            self.buckets = new
            return
        expected = self._state_now()[0]
        moved = self._index.rehash(self, new)
        if moved != expected:
            raise StoreError(f"tables {self.names()}: rehash moved {moved} keys, expected {expected} (internal error)")
        self.buckets = new

    def rekey(self, t: int) -> None:
        """Gives table `t` a new random salt and rehashes (a chain grew too long: keys chosen to
        collide under the old salt spread out under the new one)."""
        self.salts[t] = draw_salt()
        self.tables[t, T_HASH_KEY] = hash_key(self.salts[t], t)
        self._rehash(self.buckets.shape[0])

    def _grow_rows(self, rows: int) -> None:
        used = self._state_now()[1]
        grown = _alloc.empty((rows, self.rows.shape[1]), self.rows.dtype, self.device)
        if self.device.type == "meta":
            self.rows = grown
            return
        grown[:used] = self.rows[:used]
        # Touch the spare rows now: first-touch page faults cost more than the writes
        # themselves (docs/architecture.md), better paid at growth than per batch.
        grown[used:] = 0
        self.rows = grown

    # ---------------------------------------------------------------- row slots
    def take_rows(self, m: int) -> torch.Tensor:
        """`m` row slots: free ones smallest first, then fresh ones (the room is there)."""
        nf, hwm = int(self.scalars[G_NUM_FREE]), int(self.scalars[G_ROW_HWM])
        take = min(m, nf)
        slots = torch.cat([self.free_rows[nf - take : nf].flip(0).to(torch.int64),
                           torch.arange(hwm, hwm + m - take, device=self.device)])
        self.scalars[G_NUM_FREE] = nf - take
        self.scalars[G_ROW_HWM] = hwm + m - take
        self._known = None
        return slots

    def release_rows(self, slots: torch.Tensor) -> None:
        if self.on_free is not None and slots.numel():
            self.on_free(slots.to(torch.int64))
        nf = int(self.scalars[G_NUM_FREE])
        self.free_rows = torch.cat([self.free_rows[:nf], slots.to(torch.int32)]).sort(descending=True).values
        self.scalars[G_NUM_FREE] = self.free_rows.numel()
        self._known = None
