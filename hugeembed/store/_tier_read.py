"""The reading half of a TieredStore's cache: rows read into cache slots, from the file or the
prefetched ones, or created fresh; and the rows a fetch reads before its key index call (so a read
that fails changes no key, count or row), taken by the bring-in after it (store/_tier_cache.py)."""

from __future__ import annotations

import torch

from ..errors import StoreError
from ._common import init_rows
from ._tier_cache import FetchPlan

__all__ = ["TierReads"]


class TierReads:
    """Mixin of TieredStore (state set by TieredStore.__init__; slots taken with TierCache._take_slots)."""

    def _read_before_counting(self, known: torch.Tensor, plan: FetchPlan | None = None) -> None:
        """Reads the rows of `known` (logical slots the key index holds; -1: none) that are on disk and
        not resident into fresh cache slots, before the key index counts the call: a read that fails
        then leaves every key, count and row as it was.  The bring-in after the index call takes them
        (``_fill_missing``); nothing else changes.  `plan`: the fetch's, if made already."""
        self._fit_map()
        if self.native_loops:
            plan = self._plan_for(known, plan)
            j = (plan.rec >= 0).nonzero().squeeze(1)  # the missing rows on disk, by their number
            lg = known[plan.mpos[j]]
            order = lg.argsort()  # slots taken in the order of the logical rows, as the twin does
            lg, j = lg[order], j[order]
            rec = plan.rec[j]
        else:
            lg = torch.unique(known[known >= 0])
            lg = lg[self._where[lg] < 0]
            rec = self._space.records_of(lg)
            on_disk = rec >= 0
            lg, rec = lg[on_disk], rec[on_disk]
        if lg.numel() == 0:
            return
        slots = self._take_slots(lg.numel())
        self._fill_slots(lg, lg, rec, slots)  # all on disk: read, keys not needed
        self._pre_read = (lg, slots)
        if plan is not None:  # the bring-in of the same plan places them by number
            self._pre_plan = (plan, j)

    def _give_back_pre_read(self) -> None:
        """The rows _read_before_counting read are not taken (the index call failed): slots freed."""
        pre, self._pre_read, self._pre_plan = self._pre_read, None, None
        if pre is not None:
            n = pre[1].numel()
            self._free[self._nfree : self._nfree + n] = pre[1].flip(0)
            self._nfree += n

    def _fill_missing(self, logical: torch.Tensor, keys: torch.Tensor, rec: torch.Tensor,
                      plan: FetchPlan | None = None) -> torch.Tensor:
        """Cache slots holding the rows of `logical` (missing, distinct; `plan`'s missing rows in its
        order, if given): those read before the index call, the others taken now and read or created
        (``_fill_slots``)."""
        pre, self._pre_read = self._pre_read, None
        pre_plan, self._pre_plan = self._pre_plan, None
        if pre is None:
            slots = self._take_slots(logical.numel())
            self._fill_slots(logical, keys, rec, slots)
            return slots
        pre_l, pre_s = pre
        if plan is not None and pre_plan is not None and pre_plan[0] is plan:  # read by number
            got = torch.zeros(logical.numel(), dtype=torch.bool)
            got[pre_plan[1]] = True
            slots = torch.empty_like(logical)
            slots[pre_plan[1]] = pre_s
        else:
            order = pre_l.argsort()
            pre_l, pre_s = pre_l[order], pre_s[order]
            pos = torch.searchsorted(pre_l, logical).clamp_(max=pre_l.numel() - 1)
            got = pre_l[pos] == logical
            if int(got.sum()) != pre_l.numel():  # every row read ahead is one of the call's missing rows
                self._pre_read = pre
                self._give_back_pre_read()
                raise StoreError(f"table '{self.name}': rows read before the key index call are not among the "
                                 f"missing ones (internal error)")
            slots = torch.empty_like(logical)
            slots[got] = pre_s[pos[got]]
        rest = ~got
        if bool(rest.any()):
            try:
                new = self._take_slots(int(rest.sum()))
                self._fill_slots(logical[rest], keys[rest], rec[rest], new)
            except BaseException:
                self._pre_read = pre
                self._give_back_pre_read()
                raise
            slots[rest] = new
        return slots

    def _fill_slots(self, logical: torch.Tensor, keys: torch.Tensor, rec: torch.Tensor, slots: torch.Tensor) -> None:
        """The rows of `logical` into cache `slots` (taken): read where on disk (`rec` >= 0), else new.
        On a failure the slots go back to the free stack and nothing else changed."""
        read = rec >= 0
        n_read = int(read.sum())
        try:
            if n_read == rec.numel():  # (a fetch's pre-read: all on disk, no masks)
                self._read_rows(logical, slots, rec)
            elif n_read:
                self._read_rows(logical[read], slots[read], rec[read])
            if n_read < rec.numel():
                fresh = ~read
                init_rows(self._rows, slots[fresh], keys[fresh], self.layout, self.initializer, self.init_state,
                          self.seed)
        except BaseException:
            n = slots.numel()
            self._free[self._nfree : self._nfree + n] = slots.flip(0)
            self._nfree += n
            raise

    def _read_rows(self, logical: torch.Tensor, slots: torch.Tensor, rec: torch.Tensor) -> None:
        """Rows of `logical` (on disk at records `rec`) into cache `slots`: from the prefetched ones where
        staged, else the file (in file order)."""
        if self._staged:
            rest = ~self._take_staged(logical, slots)
            if not bool(rest.any()):
                return
            logical, slots, rec = logical[rest], slots[rest], rec[rest]
        order = rec.argsort()
        self.file.read_rows(rec[order], self._rows, slots[order])
        self.stats["rows_read"] += logical.numel()
