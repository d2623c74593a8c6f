"""The fetch stage of an EmbeddingCollection: one call per table group.

A group's part of a prepared batch is one span of its arrays (the lookup sees a group's tables
consecutively, nn/_placement.py), so a group's fetch is its span of the unique keys with a table
column beside them; the slots it gives index the group's rows.  Callers that hold keys per table
(the sharded owners) fetch through :meth:`FetchStage.fetch_slots`, one call per group too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from .._device import host_to_device
from .._tensors import repeat_each
from ._inflight import InFlight
from ._placement import segment_column
from ._rare import SHARED_ROW_KEY

__all__ = ["FetchStage", "SpanRules", "OwnerFetch"]


class OwnerFetch(NamedTuple):
    """What :meth:`FetchStage.fetch_slots` gives, per table asked for."""

    slots: list[torch.Tensor]  # row slots (-1: reads zeros)
    hits: list[torch.Tensor | None]  # each key's hit count after the fetch (training, lr_count_scale), else None
    shared: list[int]  # its shared row's slot here (-1: none, or not held here)


@dataclass(frozen=True)
class SpanRules:
    """What a group's fetch and expiry do beyond find-or-insert, from its tables' configs (decided
    at build, read every step)."""

    tail: tuple[int, ...]  # local tables with a shared row (its key goes at the end of the fetch)
    tail_admit: tuple[int, ...]  # their admission counts (a shared row is admitted at once)
    hits: bool  # some table scales its lr by hit counts: the fetch returns them
    expires: bool  # some table has ttl or norm eviction

    @classmethod
    def of(cls, span, tables) -> "SpanRules":
        cfgs = [tables[t] for t in span.tables]
        tail = tuple(i for i, c in enumerate(cfgs) if c.shared_row)
        return cls(tail, tuple(cfgs[i].admit_min_count for i in tail),
                   any(c.lr_count_scale is not None for c in cfgs),
                   any(c.ttl is not None or c.evict_norm_below is not None for c in cfgs))


class FetchStage:
    """Mixin of EmbeddingCollection (its groups, placement, tables and their SpanRules)."""

    def _span(self, prep, span) -> tuple[int, int]:
        """The positions of a span's tables' unique keys in the batch's arrays: [lo, hi)."""
        return prep.unique_base[span.first], prep.unique_base[span.last] + prep.unique_count[span.last]

    def _span_column(self, prep, span, lo: int, hi: int) -> torch.Tensor:
        """The table column of a span's part [lo, hi) of the batch's unique keys: the group's local table
        of each key, -1 in the gaps between tables."""
        if prep.unique_tables is not None:  # each key's table, from the prepare (no gaps): no pass per table
            column = prep.unique_tables[lo:hi]
            return column - span.first if span.first else column
        return segment_column(prep.unique_base[span.first : span.last + 1],
                              prep.unique_count[span.first : span.last + 1], lo, hi, prep.unique_keys.device)

    def _fetch(self, prep, training: bool, step: int, flight: InFlight | None) -> torch.Tensor:
        """Row slots of every unique id of a prepared batch (-1 where a row reads zeros): one call
        per group, its keys a span of the batch's arrays with a table column beside them."""
        dev = prep.unique_keys.device
        slots = torch.empty(prep.capacity, dtype=torch.int64, device=dev)
        counts = prep.unique_counts.to(torch.int64) if training else None
        work = []
        for span in self.placement.spans:
            lo, hi = self._span(prep, span)
            if hi > lo:
                work.append((span, lo, hi, self._span_column(prep, span, lo, hi)))
        if training:  # disk writes first: a full disk fails before any table changed
            for span, lo, hi, column in work:
                self.groups[span.group].reserve(column, prep.unique_keys[lo:hi])
        for span, lo, hi, column in work:
            hits = self._span_rules[span.group].hits and flight is not None
            got = self._fetch_group(span, column, prep.unique_keys[lo:hi], step, training,
                                    None if counts is None else counts[lo:hi], hits,
                                    within=prep.id_bounds[span.first : span.last + 1] or None, out=slots[lo:hi])
            if got[0].data_ptr() != slots[lo:hi].data_ptr():  # (the group wrote the slots in place: no copy)
                slots[lo:hi] = got[0]
            if flight is not None:
                flight.pin(span.group, slots, lo, hi)
                flight.shared[span.group] = got[1]
                if hits:
                    flight.hits[span.group] = got[2]
        return slots

    def _fetch_group(self, span, column, keys, step: int, training: bool, counts=None, hits: bool = False,
                     tail: tuple[int, ...] | None = None, within: tuple | None = None, out=None):
        """(slots, shared rows, hit counts) of group span's keys: slots -1 where a row reads zeros
        (tables with a shared row: ids without a row of their own get it); shared rows: per table of
        the group its shared row's slot (-1: none); hit counts: each key's after the fetch, or None.
        `tail`: the local tables whose shared row this fetch reads (default: every one of the group).
        `within`: the prepare's proof for the keys (Prepared.id_bounds of the span's tables), or None.
        `out`: where a training fetch without shared rows may write the slots (int64 [n])."""
        group = self.groups[span.group]
        rules = self._span_rules[span.group]
        n = keys.numel()
        tail = list(rules.tail if tail is None else tail)
        if tail:  # the shared rows' key goes into the same call (seen with every batch, admitted at once)
            dev = keys.device
            keys = torch.cat([keys, torch.full((len(tail),), SHARED_ROW_KEY, dtype=torch.int64, device=dev)])
            # (host-made: copied from page-locked memory, never waited for)
            column = torch.cat([column, host_to_device(tail, torch.int64, dev)])
            if counts is not None:
                admit = [rules.tail_admit[rules.tail.index(i)] for i in tail]
                counts = torch.cat([counts, host_to_device(admit, torch.int64, dev)])
        out_hits = torch.empty_like(keys) if hits else None
        within = None if tail else within  # (the shared rows' key is none the prepare checked)
        got = group.fetch(column, keys, step, counts, out=None if tail else out, hits=out_hits, within=within) \
            if training else group.find(column, keys)
        shared = None
        if tail:
            shared = torch.full((len(span.tables),), -1, dtype=torch.int64, device=keys.device)
            shared[host_to_device(tail, torch.int64, keys.device)] = got[n:]
            col = column[:n]
            got = torch.where((got[:n] < 0) & (col >= 0), shared[col.clamp(min=0)], got[:n])
        return got, shared, None if out_hits is None else out_hits[:n]

    def fetch_slots(self, ts: Sequence[int], keys: Sequence[torch.Tensor], step: int, training: bool,
                    counts: Sequence[torch.Tensor] | None = None, *, shared_rows: bool = True) -> OwnerFetch:
        """Row slots (into :meth:`rows_of`) of the distinct ids ``keys[i]`` of table ``ts[i]``, -1
        where a row reads zeros: the fetch stage for callers holding keys per table (the sharded
        owners); one call per group.  Training: new ids get rows, hits counted by `counts` (and
        returned for tables with lr_count_scale).

        `shared_rows`: the tables' shared rows (TableConfig.shared_row) are held here (a whole table,
        a replica): fetched with the keys, ids without a row of their own read them, as in one
        process.  False (a row-wise shard): the shared row is the key SHARED_ROW_KEY on its own owner,
        asked for like any key; ids without a row here get -1."""
        out: list[torch.Tensor | None] = [None] * len(ts)
        out_hits: list[torch.Tensor | None] = [None] * len(ts)
        shared_out = [-1] * len(ts)
        by_group: dict[int, list[int]] = {}
        for i, t in enumerate(ts):
            by_group.setdefault(self.group_index(t), []).append(i)
        span_of = self.placement.span_of
        dev = self.device
        if training:
            for g, idx in by_group.items():
                self.groups[g].reserve(*self._column(span_of[g], [ts[i] for i in idx], [keys[i] for i in idx]))
        for g, idx in by_group.items():
            span = span_of[g]
            column, k = self._column(span, [ts[i] for i in idx], [keys[i] for i in idx])
            c = torch.cat([counts[i] for i in idx]).to(torch.int64) if counts is not None and idx else None
            local = [span.tables.index(ts[i]) for i in idx]
            tail = tuple(j for j in self._span_rules[g].tail if j in local) if shared_rows else ()
            hits = training and any(self.tables[ts[i]].lr_count_scale is not None for i in idx)
            got, shared, h = self._fetch_group(span, column, k, step, training, c, hits, tail)
            sizes = [keys[i].numel() for i in idx]
            for j, (i, part) in enumerate(zip(idx, got.split(sizes))):
                out[i] = part
                if shared is not None:
                    shared_out[i] = int(shared[local[j]])
            if h is not None:
                for i, part in zip(idx, h.split(sizes)):
                    out_hits[i] = part
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        slots = [o if o is not None else empty for o in out]
        return OwnerFetch(slots, out_hits, shared_out)

    def _column(self, span, ts: list[int], keys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        local = {t: i for i, t in enumerate(span.tables)}
        k = torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64, device=self.device)
        return repeat_each([local[t] for t in ts], [x.numel() for x in keys], self.device), k
