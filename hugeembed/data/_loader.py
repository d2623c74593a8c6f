"""Loader: batches from data files (Criteo TSV/.gz, or CSV/TSV/Parquet under a schema) or converted
shards, read, parsed and cut into batches in a background thread.

Work is planned per epoch as a list of row ranges for this rank, read block by block,
cut into batches, and handed over through a bounded queue by a background thread:

    files/shards --read--> Block (~64k rows) --cut--> Batch --queue(prefetch)--> training loop
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from ._batch import Batch
from ._block import Block, rebatch
from ._criteo import PathLike, ReadSummary, as_paths
from ._prefetch import Prefetcher as _Prefetcher
from ._reader import TableReader
from ._schema import Schema, criteo_schema
from ._shards import ShardSet

__all__ = ["Loader", "rank_range"]


def rank_range(total: int, rank: int, world_size: int, equal: bool) -> tuple[int, int]:
    """Rows [start, stop) of `rank` out of `total`: contiguous, balanced to one row.

    With ``equal`` every rank gets exactly ``total // world_size`` rows (up to
    ``world_size - 1`` rows at the end are dropped), so all ranks run the same number of steps.
    """
    base, extra = divmod(total, world_size)
    if equal:
        return rank * base, (rank + 1) * base
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class Loader:
    """Iterates over :class:`Batch` es from data files or converted shards.

    Args:
        source: a converted shard directory (or its manifest.json), or one or more data
            files: Criteo TSV (plain or .gz), or CSV / TSV / Parquet under `schema`.
        batch_size: rows per batch.
        drop_last: drop the last, shorter batch; with shards and ``world_size > 1`` also
            give every rank exactly ``rows // world_size`` rows, so all run the same steps.
        shuffle: shards only: rows are read in windows of `shuffle_window` rows made of
            random chunks, permuted inside the window; seeded by ``(seed, epoch)``.
        seed: shuffle seed (the same on every rank).
        rank, world_size: this process reads only its slice.  Shards: a contiguous
            ``1/world_size`` of the (shuffled) row order.  Text: lines ``i % world_size == rank``.
            Together the ranks read every row exactly once.
        prefetch: batches prepared ahead by a background thread (0 = no thread).
        pin_memory: put batches in page-locked memory (needs CUDA).
        on_error: text only: "raise" or "skip" malformed lines (see :attr:`summary`).
        chunk_rows: rows read from a shard at a time.
        verify: shards only: when files are checked against the manifest's checksums
            (``"open"``: each shard when first read; ``"all"``: all now; ``"none"``), see ShardSet.
        schema: how the files' columns become batches (default: the built-in Criteo schema); shards
            carry their own (a schema given with them must agree, statistics aside).  Its
            standardize columns must be fitted (``fit_stats``).

    Example::

        loader = Loader("shards/", batch_size=4096, shuffle=True, seed=0, rank=r, world_size=w)
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:          # Batch(dense [B, 13], sparse C1..C26, labels [B])
                ...
    """

    def __init__(self, source: PathLike | Sequence[PathLike], batch_size: int, *, drop_last: bool = False,
                 shuffle: bool = False, seed: int = 0, rank: int = 0, world_size: int = 1, prefetch: int = 2,
                 pin_memory: bool = False, on_error: str = "raise", chunk_rows: int = 1 << 16,
                 shuffle_window: int = 1 << 18, chunk_bytes: int = 8 << 20, native: bool | None = None,
                 verify: bool | str = "open", schema: Schema | None = None) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if prefetch < 0 or chunk_rows < 1 or shuffle_window < 1:
            raise ConfigError("prefetch must be >= 0, chunk_rows and shuffle_window >= 1")
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError("pin_memory=True needs CUDA, which is not available here")
        self.batch_size, self.drop_last, self.shuffle, self.seed = int(batch_size), drop_last, shuffle, int(seed)
        self.rank, self.world_size, self.prefetch, self.pin_memory = int(rank), int(world_size), int(prefetch), pin_memory
        self.chunk_rows, self.shuffle_window = int(chunk_rows), int(shuffle_window)
        self.epoch = 0
        self.summary: ReadSummary | None = None
        self.shards: ShardSet | None = None
        self._reader: TableReader | None = None
        if _is_shard_dir(source):
            self.shards = ShardSet(source, verify=verify)  # type: ignore[arg-type]
            if schema is not None and schema.fingerprint() != self.shards.schema.fingerprint():
                raise ConfigError(f"{self.shards.root} was converted under another schema than the one given; "
                                  f"leave the schema out (shards carry theirs) or convert again")
            self.schema = self.shards.schema
        else:
            if shuffle:
                raise ConfigError("shuffle=True needs converted shards (`hugeembed convert`); text files are read in order")
            self.schema = schema or criteo_schema()
            self._reader = TableReader(as_paths(source), self.schema, on_error=on_error, chunk_bytes=chunk_bytes,
                                       chunk_rows=chunk_rows, rank=self.rank, world_size=self.world_size,
                                       native=native)

    def set_epoch(self, epoch: int) -> None:
        """Selects the shuffle order of the next iteration (call it with the same value on every rank)."""
        self.epoch = int(epoch)

    def rows(self) -> int:
        """Rows this rank reads per epoch (shards only)."""
        if self.shards is None:
            raise TypeError("the row count of a text source is unknown before reading it; convert it to shards")
        start, stop = rank_range(self.shards.rows, self.rank, self.world_size, self.drop_last and self.world_size > 1)
        return stop - start

    def __len__(self) -> int:
        """Batches this rank yields per epoch (shards only)."""
        n = self.rows()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> "_BatchIterator":
        make = self._batches
        if self.prefetch == 0:
            return _BatchIterator(make(), None)
        return _BatchIterator(None, _Prefetcher(make, self.prefetch))

    # -- producing batches (runs in the prefetch thread) ----------------------------

    def _batches(self) -> Iterator[Batch]:
        blocks = self._shard_blocks(self.epoch) if self.shards is not None else self._text_blocks()
        for blk in rebatch(blocks, self.batch_size, self.drop_last):
            batch = Batch.from_block(blk, self.schema)
            yield batch.pin_memory() if self.pin_memory else batch

    def _text_blocks(self) -> Iterator[Block]:
        assert self._reader is not None
        self.summary = self._reader.summary
        for blk in self._reader:
            self.summary = self._reader.summary
            yield blk
        self.summary = self._reader.summary

    def _units(self, epoch: int) -> list[list[tuple[int, int, int]]]:
        """The epoch's reading units: lists of (shard, start, stop) chunks read and mixed together."""
        assert self.shards is not None
        chunks = [(i, a, min(a + self.chunk_rows, s.rows)) for i, s in enumerate(self.shards.shards)
                  for a in range(0, s.rows, self.chunk_rows)]
        if not self.shuffle:
            return [[c] for c in chunks]
        order = np.random.default_rng([self.seed, epoch]).permutation(len(chunks))
        units, cur, size = [], [], 0
        for k in order:
            cur.append(chunks[k])
            size += chunks[k][2] - chunks[k][1]
            if size >= self.shuffle_window:
                units.append(cur)
                cur, size = [], 0
        if cur:
            units.append(cur)
        return units

    def _shard_blocks(self, epoch: int) -> Iterator[Block]:
        assert self.shards is not None
        units = self._units(epoch)
        lengths = [sum(c[2] - c[1] for c in u) for u in units]
        start, stop = rank_range(self.shards.rows, self.rank, self.world_size, self.drop_last and self.world_size > 1)
        pos = 0
        for u, (unit, n) in enumerate(zip(units, lengths)):
            lo, hi = max(start - pos, 0), min(stop - pos, n)
            pos += n
            if lo >= hi:
                continue
            if not self.shuffle:
                shard, a, _ = unit[0]
                yield self.shards.read_shard_rows(shard, a + lo, a + hi)
                continue
            rows = Block.concat([self.shards.read_shard_rows(s, a, b) for s, a, b in unit])
            perm = np.random.default_rng([self.seed, epoch, u]).permutation(n)
            yield rows.take(perm[lo:hi])


def _is_shard_dir(source) -> bool:
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        return p.is_dir() or p.name == "manifest.json"
    return False


class _BatchIterator:
    """The iterator a Loader returns; ``close()`` (or leaving a ``with`` block) stops the thread."""

    def __init__(self, gen: Iterator[Batch] | None, prefetcher: _Prefetcher | None) -> None:
        self._gen, self._pre, self._done = gen, prefetcher, False

    def __iter__(self) -> "_BatchIterator":
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        if self._gen is not None:
            try:
                return next(self._gen)
            except BaseException:
                self._done = True
                raise
        assert self._pre is not None
        kind, value = self._pre.get()
        if kind == "item":
            return value
        self._done = True
        self._pre.close()
        if kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        self._done = True
        if self._pre is not None:
            self._pre.close()
        if self._gen is not None and hasattr(self._gen, "close"):
            self._gen.close()

    def __enter__(self) -> "_BatchIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # an abandoned iterator must not leave its thread blocked on the queue
        self.close()
