"""What changes a dynamic group other than a training fetch: eviction, forgetting pending keys,
removal, export and import of a table's rows (the edges: snapshots, deltas, state_dict).

Each works on one table of the group by its index ``t`` (or, for expiry, on all at once); the
group's index and rows are shared, so a table's keys are found by the table word of each record.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError, InputError, StoreError
from ._admit import pending_victims
from ._evict import check_evict_args, select_victims
from ._index import EMPTY_TABLE, G_ENTRIES, PENDING, T_PENDING, T_ROWS, code_of, count_of
from ._layout import check_import_rows
from ._protocol import ExportIndex, StoreExport

__all__ = ["DynamicEdits"]


class DynamicEdits:
    """Mixin of DynamicGroup (store/_dynamic.py): its edits of one table's keys and rows."""

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
        for t, s in enumerate(self.settings):
            if s.admit_min_count == 1:  # no counter filter: no pending keys
                continue
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
