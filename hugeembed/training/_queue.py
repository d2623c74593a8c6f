"""``--data-queue ROWS``: ranks take the next chunk of the epoch's rows from a shared queue as they finish one.

Without it, rank r reads a fixed slice of every global batch.  With it, the epoch's training rows
are cut into chunks of at most ROWS rows (never across a shard file), and a rank that needs rows
takes the next chunk: index ``store.add(key, 1) - 1`` of the default group's store, an atomic
counter, so every chunk goes to exactly one rank.  Batches are cut from a rank's stream of chunks;
each rank's last one of the epoch may be short.

Every rank must still run the same training steps (each is a collective), so before each step the
ranks all-reduce how many rows they hold: a rank that ran out trains an empty batch, and the epoch
ends when the sum is 0 -- every row trained exactly once per epoch.  The loss is summed over the
batch and divided by the batch size the run asked for, so a short batch weighs by its rows.

A snapshot records the rows not trained yet (the chunks nobody took, and the rest of each rank's
taken chunks), as row ranges: a resumed run continues from there with any number of processes
and any batch size.  Which rank trains which row, and when, depends on timing: runs are equal in
distribution, not bit for bit.
"""

from __future__ import annotations

import collections
import uuid
from typing import Callable, Iterator

import torch.distributed as dist

from ..data import CAT_NAMES, Batch, Block, rank_range, rebatch
from ..distributed import Comm
from ..distributed._liveness import default_store
from ..errors import CheckpointError, ConfigError
from ._sources import DataSource, FileSource, SyntheticSource

__all__ = ["QueueSource", "queue_source", "chunk_ranges", "subtract_ranges", "intersect_ranges", "check_queue_state"]

Range = tuple[int, int]


def subtract_ranges(ranges: list[Range], holes: list[Range]) -> list[Range]:
    """`ranges` (in their order) without the rows of `holes`."""
    out = []
    for a, b in ranges:
        pieces = [(a, b)]
        for h0, h1 in holes:
            pieces = [p for x, y in pieces for p in ((x, min(y, h0)), (max(x, h1), y)) if p[0] < p[1]]
        out.extend(pieces)
    return out


def intersect_ranges(ranges: list[Range], keep: list[Range]) -> list[Range]:
    """The rows of `ranges` (in their order) that lie in `keep`."""
    return [(max(a, k0), min(b, k1)) for a, b in ranges for k0, k1 in sorted(keep) if max(a, k0) < min(b, k1)]


def chunk_ranges(ranges: list[Range], cuts: list[int], size: int) -> list[Range]:
    """`ranges` cut at every row of `cuts` (shard boundaries) and into pieces of at most `size` rows."""
    bounds = sorted(set(cuts))
    out = []
    for a, b in ranges:
        inner = [c for c in bounds if a < c < b]
        for x, y in zip([a, *inner], [*inner, b]):
            out.extend((s, min(s + size, y)) for s in range(x, y, size))
    return out


def merge_ranges(ranges: list[Range]) -> list[Range]:
    """Adjacent ranges joined (a snapshot's list stays short: the chunks nobody took are contiguous)."""
    out: list[list[int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1][1] = b
        elif a < b:
            out.append([a, b])
    return [(a, b) for a, b in out]


def check_queue_state(value, where: str) -> dict | None:
    """A snapshot's ``train_state.data_queue`` ({"epoch": e, "ranges": [[a, b], ...]} or None), checked."""
    if value is None:
        return None
    ok = isinstance(value, dict) and set(value) == {"epoch", "ranges"} and isinstance(value["epoch"], int) \
        and not isinstance(value["epoch"], bool) and value["epoch"] >= 0 and isinstance(value["ranges"], list) \
        and all(isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                    for x in r) and 0 <= r[0] < r[1]
                for r in value["ranges"])
    if not ok:
        text = repr(value)
        raise CheckpointError(f"{where}: train_state.data_queue must be null or {{'epoch': e, 'ranges': [[start, stop], "
                              f"...]}} with 0 <= start < stop, got {text[:80]}")
    return {"epoch": value["epoch"], "ranges": [[int(a), int(b)] for a, b in value["ranges"]]}


class QueueSource(DataSource):
    """The training batches of one rank under ``--data-queue``; held-out batches from `base` as without it.

    Args:
        base: the run's DataSource (synthetic or shards): descriptions, notes and evaluation.
        read: rows [a, b) of the epoch's row space -> Block, for `epoch`: ``read(epoch, a, b)``.
        rows: the epoch's training rows, as ranges of that space; cuts: rows where a chunk must end.
        keys: the batch's sparse feature names (Batch.from_block's second argument).
        chunk_rows: a chunk's most rows; batch_size: rows per batch (per rank).
    """

    def __init__(self, base, read: Callable[[int, int, int], Block] | None, rows: list[Range], cuts: list[int], keys,
                 chunk_rows: int, batch_size: int, rank: int, world_size: int,
                 timeout: float, readers: int | None = None, server_batch: Batch | None = None) -> None:
        self.base, self.read, self.rows, self.cuts, self.keys = base, read, rows, cuts, keys
        self.chunk_rows, self.batch_size, self.rank, self.world = chunk_rows, batch_size, rank, world_size
        self.description = f"{base.description}; ranks take chunks of {chunk_rows} rows from a shared queue"
        self.notes = base.notes
        self.steps_per_epoch = None  # depends on who takes what
        total = sum(b - a for a, b in rows)
        # readers: the ranks that take chunks (--servers: the workers); a server (server_batch, its empty
        # batch) takes none and joins every step's count with 0 rows
        self.estimated_steps_per_epoch = -(-total // (batch_size * (readers or world_size)))
        self.takes = server_batch is None
        self._empty = Batch.from_block(read(0, 0, 0), keys) if server_batch is None else server_batch
        self.comm = Comm(dist.group.WORLD, timeout) if world_size > 1 else None
        self.store = default_store() if world_size > 1 else None
        if world_size > 1 and self.store is None:
            raise ConfigError("--data-queue needs the default process group's store (torchrun or --nproc)")
        # the queue's keys are this run's alone (a restarted run may share the store with the failed one)
        self.token = self.comm.all_gather_object("data queue", uuid.uuid4().hex)[0] if self.comm else "local"
        self._restored: dict | None = None
        self._epoch: int | None = None
        self._items: list[Range] = []
        self._claimed: list[Range] = []
        self._trained = 0  # rows of this rank's claimed chunks trained, in claim order
        self._counter = 0  # one process: the queue is a plain counter
        self._global_rows: collections.deque[int] = collections.deque()

    # -- the queue -----------------------------------------------------------------------

    def _key(self) -> str:
        return f"hugeembed/data-queue/{self.token}/{self._epoch}"

    def _take(self) -> int:
        if self.store is None:
            self._counter += 1
            return self._counter - 1
        return int(self.store.add(self._key(), 1)) - 1

    def _blocks(self) -> Iterator[Block]:
        while self.takes:
            i = self._take()
            if i >= len(self._items):
                return
            a, b = self._items[i]
            self._claimed.append((a, b))
            yield self.read(self._epoch, a, b)

    def restore(self, state: dict | None) -> None:
        """Continue from a snapshot's position (``position()``'s value) in its epoch."""
        self._restored = state

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        """This rank's batches of `epoch` (`skip` is ignored: the queue position says what is left), then
        empty ones until every rank has run out."""
        resumed = self._restored is not None and self._restored["epoch"] == epoch
        ranges = [tuple(r) for r in self._restored["ranges"]] if resumed else self.rows
        if resumed:  # rows held out by this run (another world size holds out others) are not trained
            ranges = intersect_ranges(ranges, self.rows)
        self._restored = None
        self._epoch, self._items = epoch, chunk_ranges(ranges, self.cuts, self.chunk_rows)
        self._claimed, self._trained, self._counter = [], 0, 0
        self._global_rows.clear()
        local = (Batch.from_block(blk, self.keys) for blk in rebatch(self._blocks(), self.batch_size, False))
        while True:
            batch = next(local, None)
            n = 0 if batch is None else batch.batch_size
            total = self.comm.all_reduce_sum("data queue rows", n) if self.comm else n
            if total == 0:
                return
            self._global_rows.append(total)
            yield batch if batch is not None else self._empty

    def trained(self, batch: Batch, world_size: int) -> int:
        """Called once per training step, in order: this rank trained `batch`; returns the step's rows over all ranks."""
        self._trained += batch.batch_size
        return self._global_rows.popleft()

    def position(self) -> dict | None:
        """The rows of the epoch in progress not trained yet (collective: every rank's chunks in hand)."""
        if self._epoch is None:
            return None
        left, skip = [], self._trained
        for a, b in self._claimed:
            take = min(skip, b - a)
            skip -= take
            if a + take < b:
                left.append((a + take, b))
        counter = int(self.store.add(self._key(), 0)) if self.store is not None else self._counter
        parts = self.comm.all_gather_object("data queue position", (counter, left)) if self.comm else [(counter, left)]
        untaken = min(len(self._items), max(c for c, _ in parts))
        ranges = [r for _, mine in parts for r in mine] + self._items[untaken:]
        return {"epoch": self._epoch, "ranges": [list(r) for r in merge_ranges(ranges)]}

    def eval_batches(self):
        return self.base.eval_batches()

    def bayes(self):
        return self.base.bayes()



def queue_source(base: DataSource, chunk_rows: int, batch_size: int, rank: int, world_size: int,
                 timeout: float, readers: int | None = None) -> QueueSource:
    """`base`'s data (synthetic, or converted shards) through a shared queue of chunks of `chunk_rows` rows;
    `readers`: the ranks 0..readers-1 that read data (default all; the others are --servers)."""
    readers = readers or world_size
    if isinstance(base, SyntheticSource):
        per_epoch, gen = base.cfg.synthetic_rows, base.gen
        return QueueSource(base, lambda epoch, a, b: gen.rows(epoch * per_epoch + a, b - a), [(0, per_epoch)], [],
                           list(CAT_NAMES), chunk_rows, batch_size, rank, world_size, timeout, readers)
    if not isinstance(base, FileSource) or base.loader.shards is None:
        raise ConfigError("--data-queue hands out chunks of converted shards (or of the synthetic data): text files are "
                          "read line by line, so convert them first (`hugeembed convert FILES -o DIR`, then --data DIR)")
    shards = base.loader.shards
    total = shards.rows
    # the rows each rank holds out for evaluation (FileSource: its first batches), never trained
    held = [(start, start + base.holdout * batch_size) for start in
            (rank_range(total, r, readers, readers > 1)[0] for r in range(readers))] if base.holdout else []
    rows = subtract_ranges([(0, total)], held)
    cuts = [info.start for info in shards.shards] + [total]
    return QueueSource(base, lambda epoch, a, b: shards.read(a, b), rows, cuts, base.schema, chunk_rows, batch_size,
                       rank, world_size, timeout, readers)
