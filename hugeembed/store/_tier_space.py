"""Where the disk tier keeps each row: records appended in segments, garbage reclaimed by cleaning.

A row written back to the tier goes to a *fresh* record, never over a live one: the
write-back of a batch of evicted rows is then one sequential run of records (a few
large ``pwrite`` calls) instead of one small write per row at the row's fixed place.
Measured on this project's 2-core VM: 10.7 k rows of 260 B written one per record at
random places of a 1.5 GiB file cost ~75 ms of kernel time (a page-cache walk per row);
written as one run, ~2-4 ms.  This is OneFlow's persistent table (rows appended to chunk
files, the key index in memory) rather than a rewrite-in-place file or an LSM store.

The file is a sequence of segments of S records (about 1 MiB each).  Per logical row
(the key index's slot) ``rec`` holds its record (-1: none on disk); per segment ``live``
counts the records that are some row's current one.  Writes fill the open segment,
then empty segments (every record garbage), then new segments at the end of the file.
When the file would grow past ``(1 + SLACK)`` times the live records and the room left is
short, the emptiest segments are cleaned first: their live rows are read (whole segments)
and written to a second stream of segments before the batch (so their segments become
empty), which keeps the disk near 1.5x the rows it holds.

A row whose cached copy is dirty has no record (``release``): its old record is garbage
from the moment the cache holds a newer value, so segments drain as rows are read back.

Nothing here touches the file: TieredStore reads and writes records with RowFile and
calls ``commit`` only after a write succeeded, so a failed write (the disk full) leaves
every row where it was.
"""

from __future__ import annotations

import torch

from ..errors import StoreError

__all__ = ["RecordSpace", "SLACK", "EVICTED", "MOVED"]

EVICTED, MOVED = 0, 1  # the write streams (see RecordSpace.open_seg)
# Garbage the file may hold beside its live records before segments are cleaned.  At 0.25 the
# cleaner moved ~1.6 rows per row written back (bench/tiered.py d64, the emptiest segments ~60 %
# live); at 0.5 the disk holds up to ~1.5x the rows for far fewer moves.
SLACK = 0.5
_SEGMENT_BYTES = 1 << 20
_MAX_RECORDS = 2**31 - 1  # rec is int32
_AHEAD = 4  # room kept ahead, in write-backs
_CLEAN_MAX_LIVE = 0.875  # a segment fuller than this is not worth cleaning: the file grows instead
_PAST_BOUND = 0.125  # past the bound by this much, any segment with garbage is cleaned


class Plan:
    """Records for a write of n rows, and the allocator's state once they are committed."""

    __slots__ = ("records", "stream", "open_seg", "open_next", "free", "nseg")

    def __init__(self, records, stream, open_seg, open_next, free, nseg) -> None:
        self.records, self.stream, self.open_seg, self.open_next = records, stream, open_seg, open_next
        self.free, self.nseg = free, nseg


class RecordSpace:
    """The tier file's record map and allocator (see the module docstring)."""

    def __init__(self, record_bytes: int, table: str, segment_bytes: int | None = None) -> None:
        self.table = table
        self.S = max(16, int(segment_bytes or _SEGMENT_BYTES) // int(record_bytes))
        self.rec = torch.zeros(0, dtype=torch.int32)  # logical row -> record (-1: not on disk)
        self.live = torch.zeros(0, dtype=torch.int64)  # per segment
        self.owner = torch.zeros(0, dtype=torch.int32)  # record -> the logical row written there last
        self.n_live = 0
        self.nseg = 0
        # Per stream (EVICTED: rows written back; MOVED: rows a cleaning moved, the ones that stayed
        # live in their segment: colder), its open segment and the next record to write there.  Two
        # streams keep cold rows apart from rows likely to be read back soon, so segments of the
        # first stay full and segments of the second drain: cleaning then finds more garbage.
        self.open_seg, self.open_next = [-1, -1], [0, 0]
        self.free: list[int] = []  # empty segments (not an open one), reused last in, first out

    # ----------------------------------------------------------------- sizes
    def grow(self, n_logical: int) -> None:
        have = self.rec.numel()
        if n_logical > have:
            self.rec = torch.cat([self.rec, torch.full((n_logical - have,), -1, dtype=torch.int32)])

    def bind(self, rec: torch.Tensor) -> None:
        """Keeps the record of each logical row in `rec` (int32, may be a column of a wider map: the
        tier map's per-row record) from now on; it holds the current ones already."""
        self.rec = rec

    @property
    def records(self) -> int:
        """Records the file spans (live or garbage)."""
        return self.nseg * self.S

    def memory_bytes(self) -> int:
        return self.rec.numel() * 4 + self.owner.numel() * 4 + self.live.numel() * 8

    # ----------------------------------------------------------------- reading
    def records_of(self, logical: torch.Tensor) -> torch.Tensor:
        """int64 records of `logical` rows (-1: not on disk)."""
        return self.rec[logical].to(torch.int64)

    def on_disk(self, logical: torch.Tensor) -> torch.Tensor:
        return self.rec[logical] >= 0

    # ----------------------------------------------------------------- changes
    def release(self, logical: torch.Tensor) -> None:
        """These rows' records become garbage (the row is dirty in the cache, or gone)."""
        if logical.numel() == 0:
            return
        old = self.rec[logical]
        had = old >= 0
        if not bool(had.any()):
            return
        old = old[had].to(torch.int64)
        self.rec[logical[had]] = -1
        self._drop(old)

    def dropped(self, n: int, emptied: list[int]) -> None:
        """A native loop (he_tier_admit) released `n` records itself (``rec`` and ``live`` updated);
        `emptied`: the segments it left without a live record."""
        self.n_live -= n
        self._add_free(emptied)

    def _drop(self, records: torch.Tensor) -> None:
        segs = records // self.S
        self.live.index_add_(0, segs, torch.full_like(segs, -1))
        self.n_live -= records.numel()
        touched = torch.unique(segs)
        self._add_free(touched[self.live[touched] == 0].tolist())

    def _add_free(self, empty: list[int]) -> None:
        """Empty segments join the free list (not the open one, none twice)."""
        if empty:
            have = set(self.free)
            self.free.extend(s for s in empty if s not in self.open_seg and s not in have)

    def plan(self, logical: torch.Tensor, stream: int = EVICTED) -> Plan:
        """Records for the rows `logical` of `stream` (EVICTED or MOVED): the rest of its open segment,
        then empty segments, then new ones at the end of the file.  Changes nothing until ``commit``."""
        n = logical.numel()
        parts = []
        open_seg, open_next = self.open_seg[stream], self.open_next[stream]
        free, nseg = list(self.free), self.nseg
        left = n
        while left > 0:
            if open_seg < 0 or open_next >= self.S:
                if free:
                    open_seg = free.pop()
                else:
                    open_seg, nseg = nseg, nseg + 1
                    if nseg * self.S > _MAX_RECORDS:
                        raise StoreError(f"table '{self.table}': the tier file would pass {_MAX_RECORDS} records")
                open_next = 0
            take = min(left, self.S - open_next)
            start = open_seg * self.S + open_next
            parts.append(torch.arange(start, start + take, dtype=torch.int64))
            open_next += take
            left -= take
        records = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return Plan(records, stream, open_seg, open_next, free, nseg)

    def commit(self, plan: Plan, logical: torch.Tensor) -> None:
        """Rows `logical` now live at ``plan.records`` (written); their old records become garbage."""
        if self.live.numel() < plan.nseg:  # grown by half at a time: a file grows a segment at a time
            have = self.live.numel()
            keep = max(plan.nseg, have + have // 2 + 16)
            live = torch.zeros(keep, dtype=torch.int64)
            live[:have] = self.live
            owner = torch.full((keep * self.S,), -1, dtype=torch.int32)
            owner[: self.owner.numel()] = self.owner
            self.live, self.owner = live, owner
        old = self.rec[logical]
        had = old >= 0
        was_open = self.open_seg[plan.stream]
        self.open_seg[plan.stream], self.open_next[plan.stream] = plan.open_seg, plan.open_next
        self.free, self.nseg = plan.free, plan.nseg
        self.rec[logical] = plan.records.to(torch.int32)
        self.owner[plan.records] = logical.to(torch.int32)
        segs = plan.records // self.S
        self.live.index_add_(0, segs, torch.ones_like(segs))
        self.n_live += plan.records.numel()
        if bool(had.any()):
            self._drop(old[had].to(torch.int64))
        if 0 <= was_open != plan.open_seg and int(self.live[was_open]) == 0:  # emptied while it was open
            self._add_free([was_open])

    # ----------------------------------------------------------------- cleaning
    def to_clean(self, n: int) -> torch.Tensor:
        """Logical rows to move before a write of n rows, so that the file stays within ~(1 + SLACK) x
        its live records: the rows of the emptiest segments.  Empty while the file may still grow, or
        the room there is (open segment, empty segments) holds this write and a reserve of a few
        more: cleaning as late as that finds the most garbage in the segments it cleans.

        The caller writes the moved rows first (their segments are then empty), then the n rows.
        Enough segments are cleaned to keep room for a few write-backs ahead, so that a move finds
        its room; a call moves at most that room's worth (bounded work per step).  The file stops
        growing once the emptiest segments are at most ~7/8 live (at the latest near 1.7x: 1/8 past the bound)."""
        room = len(self.free) * self.S + sum(self.S - nx for sg, nx in zip(self.open_seg, self.open_next) if sg >= 0)
        bound = int((self.n_live + n) * (1 + SLACK)) + 2 * self.S
        reserve = _AHEAD * n + self.S
        if self.records + max(0, n - room) <= bound or room >= reserve + n or self.nseg == 0:
            return torch.zeros(0, dtype=torch.int64)  # grow within the bound, or write into the room

        live = self.live[: self.nseg].clone()
        for sg in self.open_seg:
            if sg >= 0:
                live[sg] = self.S  # never an open one
        if self.free:
            live[torch.tensor(self.free, dtype=torch.int64)] = self.S
        lv, order = torch.sort(live, stable=True)
        # Segments nearly full are not worth their moves while the file is near its bound; past it
        # by 1/8, any segment with garbage is (the disk is the harder limit).
        full = self.S - 1 if self.records > bound * (1 + _PAST_BOUND) else int(self.S * _CLEAN_MAX_LIVE)
        worth = int((lv <= full).sum())
        if worth == 0:  # every segment full: the file grows
            return torch.zeros(0, dtype=torch.int64)
        moved = lv[:worth].cumsum(0)
        gain = self.S * torch.arange(1, worth + 1) - moved
        # Keep room ahead (a next write-back and a full move fit without growing the file), but
        # move at most what that room (or 4 write-backs) holds per call: bounded work per step.
        need = n + reserve - room
        k_max = max(1, int((moved <= max(room, _AHEAD * n)).sum()))
        ok = (gain[:k_max] >= need).nonzero()
        k = int(ok[0]) + 1 if ok.numel() else k_max
        segs = order[:k]
        recs = (segs.unsqueeze(1) * self.S + torch.arange(self.S)).reshape(-1)
        lg = self.owner[recs].to(torch.int64)
        ok = lg >= 0
        lg, recs = lg[ok], recs[ok]
        moved = lg[self.rec[lg].to(torch.int64) == recs]  # the record is still that row's current one
        return moved
