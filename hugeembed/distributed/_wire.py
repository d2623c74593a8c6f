"""Byte-level packing of the exchange: many typed segments per destination in one uint8 buffer.

One all-to-all carries every table's keys, counts, bag lengths, weights, rows or
gradients for a stage.  Segments are written in a fixed order (table order, then
field order) and read back in the same order, each padded to 8 bytes so that a
received segment can be viewed as int64/float64 without a copy::

    to rank 0: | keys t0 (8n) | counts t0 (4n, pad) | keys t2 ... |
    to rank 1: | keys t0      | counts t0           | ...         |
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import ShardingError

__all__ = ["Packer", "Reader", "readers", "padded", "segments", "union_received", "Received", "DTYPE_CODE",
           "CODE_DTYPE"]

DTYPE_CODE = {None: 0, torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}
CODE_DTYPE = {v: k for k, v in DTYPE_CODE.items()}


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of 8."""
    return nbytes + (-nbytes) % 8


class Packer:
    """Collects typed tensors per destination rank; ``buffer()`` lays them out for all_to_all_single."""

    def __init__(self, world_size: int) -> None:
        self.parts: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        self.sizes = [0] * world_size

    def add(self, dest: int, t: torch.Tensor) -> None:
        b = t.reshape(-1).view(torch.uint8)
        n = b.numel()
        if n == 0:
            return
        self.parts[dest].append(b)
        pad = (-n) % 8
        if pad:
            self.parts[dest].append(torch.zeros(pad, dtype=torch.uint8, device=b.device))
        self.sizes[dest] += n + pad

    def add_all(self, t: torch.Tensor) -> None:
        """The same segment to every rank (replicated tables)."""
        for d in range(len(self.parts)):
            self.add(d, t)

    def buffer(self, device: torch.device) -> torch.Tensor:
        flat = [p for parts in self.parts for p in parts]
        if not flat:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return torch.cat(flat) if len(flat) > 1 else flat[0]


class Reader:
    """Reads one source's segments in the order they were packed."""

    def __init__(self, buf: torch.Tensor, start: int, size: int, source: int, stage: str) -> None:
        self.buf, self.pos, self.end = buf, start, start + size
        self.source, self.stage = source, stage

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The next segment: `n` elements of `dtype` (a view into the received buffer)."""
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dtype, device=self.buf.device)
        seg = self.buf[self.pos : self.pos + nbytes]
        self.pos += padded(nbytes)
        if self.pos > self.end:
            raise ShardingError(f"{self.stage}: rank {self.source} sent fewer bytes than its header announced "
                                "(ranks disagree on the plan or the batch layout)")
        return seg.view(dtype)

    def finish(self) -> None:
        if self.pos != self.end:
            raise ShardingError(f"{self.stage}: rank {self.source} sent {self.end - self.pos} bytes more than its "
                                "header announced (ranks disagree on the plan or the batch layout)")


def readers(buf: torch.Tensor, sizes: list[int], stage: str) -> list[Reader]:
    """One Reader per source rank over a received buffer laid out by `sizes`."""
    out, start = [], 0
    for r, n in enumerate(sizes):
        out.append(Reader(buf, start, n, r, stage))
        start += n
    return out


def segments(starts: list[int], sizes: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, segment index): the concatenation of ``arange(starts[i], starts[i] + sizes[i])``."""
    n = torch.tensor(sizes, dtype=torch.int64, device=device)
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=device), n)
    first = torch.cumsum(n, 0) - n
    pos = torch.arange(sum(sizes), device=device) - first[seg] + torch.tensor(starts, dtype=torch.int64,
                                                                                device=device)[seg]
    return pos, seg


class Received(NamedTuple):
    """The union of the (table, key) pairs an owner received from all ranks in one stage."""

    per_src: list[int]  # keys received from each source rank
    inv: torch.Tensor  # received position -> index into `uniq`
    uniq: torch.Tensor  # distinct keys, grouped by table in table order, sorted within a table
    per_table: list[int]  # distinct keys per table
    counts: torch.Tensor | None  # summed hit counts per distinct key (None when no counts were sent)


def union_received(readers: list[Reader], sizes: torch.Tensor, device, with_counts: bool) -> Received | None:
    """Reads each source's keys (int64, then int32 counts when `with_counts`) for the tables of
    `sizes` ([world, T] keys per source and table) and merges them: one find-or-insert per
    distinct (table, key), in an order every rank computes the same way.  None when nothing came."""
    per_src = sizes.sum(1).tolist()
    T = sizes.shape[1]
    keys = [readers[r].take(n, torch.int64) for r, n in enumerate(per_src)]
    hits = [readers[r].take(n, torch.int32) for r, n in enumerate(per_src)] if with_counts else None
    total = sum(per_src)
    if total == 0:
        return None
    keys = torch.cat(keys).to(device)
    tid = torch.repeat_interleave(torch.arange(T, device=device).repeat(len(per_src)),
                                  sizes.reshape(-1).to(device))
    # sort by key, then stably by table: distinct pairs are adjacent, grouped by table
    order = torch.argsort(keys, stable=True)
    order = order[torch.argsort(tid[order], stable=True)]
    ks, ts = keys[order], tid[order]
    new = torch.ones(total, dtype=torch.bool, device=device)
    new[1:] = (ks[1:] != ks[:-1]) | (ts[1:] != ts[:-1])
    inv = torch.empty(total, dtype=torch.int64, device=device)
    inv[order] = torch.cumsum(new.to(torch.int64), 0) - 1
    uniq = ks[new]
    per_table = torch.bincount(ts[new], minlength=T).tolist()
    counts = None
    if hits is not None:
        counts = torch.zeros(uniq.numel(), dtype=torch.int64, device=device).index_add_(
            0, inv, torch.cat(hits).to(device, torch.int64))
    return Received(per_src, inv, uniq, per_table, counts)
