"""Estimates the planner balances: bytes of a table (rows x (D + optimizer state) x dtype + index)
and its lookup cost (ids per step x D), and how they split over the ranks of a placement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..nn import TableConfig
from ..optim import SparseOptimizer
from ..store._dynamic import MAX_LOAD
from ..types import ShardKind
from .._format import human_bytes, human_count

__all__ = ["TableEstimate", "Share", "estimate_table", "text_table", "fmt_bytes", "fmt_num",
           "HASH_INDEX_BYTES_PER_ROW", "ARRAY_META_BYTES_PER_ROW"]

# Bytes a dynamic (hash) table spends per live row beyond the row itself: a 32-byte
# bucket record (key, table, code + hit count, last step) at the index's load target.
HASH_INDEX_BYTES_PER_ROW = 32.0 / MAX_LOAD
# A static table keeps a hit count and a last step (int64 each) per row.
ARRAY_META_BYTES_PER_ROW = 16.0


@dataclass(frozen=True)
class Share:
    rows: float
    bytes: float
    ids: float  # ids looked up per step on that rank (the lookup cost is ids x dim)


@dataclass(frozen=True)
class TableEstimate:
    """What one table costs: rows, bytes (rows x (D + state) x dtype + index), ids per global step.

    `bounded` is False for a dynamic table with neither a capacity nor an expected_rows hint.
    `index_bytes`: the part of `bytes` every column block keeps whole (hash index or counts);
    `bags_per_step`: bags per global step (global batch x features), pooled vectors' count.
    """

    name: str
    rows: float
    bytes: float
    ids_per_step: float
    dim: int
    bounded: bool
    index_bytes: float = 0.0
    bags_per_step: float = 0.0

    @property
    def cost(self) -> float:
        """Lookup cost per global step: ids x dim (row elements read and written)."""
        return self.ids_per_step * self.dim

    def share(self, placement, world_size: int) -> Share:
        """Rows, bytes and ids per step held / served by each rank of `placement`."""
        n = len(placement.ranks)
        if placement.kind is ShardKind.DATA_PARALLEL:
            return Share(self.rows, self.bytes, self.ids_per_step / world_size)
        if placement.kind is ShardKind.ROW_WISE:
            return Share(self.rows / n, self.bytes / n, self.ids_per_step / n)
        if placement.kind is ShardKind.COLUMN_WISE:  # every row's block, and the whole index; every id
            return Share(self.rows, (self.bytes - self.index_bytes) / n + self.index_bytes, self.ids_per_step)
        return Share(self.rows, self.bytes, self.ids_per_step)

    def exchange_bytes(self, kind: ShardKind, n: int) -> float:
        """Estimated bytes a training step sends between ranks for this table spread over `n` ranks,
        float32 rows and no duplicate ids within a rank's batch (an upper bound: dedup sends less):
        row-wise sends each id's key and count (12 B) and gets its row and sends its gradient (4 D
        each); column-wise sends each id (key, count, index: 16 B) and each bag's length (4 B) to
        all n block owners, and gets each bag's pooled vector and sends its gradient (4 D each, in
        n blocks).  Of either, the share (n-1)/n of another rank's crosses the network."""
        if kind is ShardKind.ROW_WISE:
            total = self.ids_per_step * (12.0 + 8.0 * self.dim)
        elif kind is ShardKind.COLUMN_WISE:
            total = n * (16.0 * self.ids_per_step + 4.0 * self.bags_per_step) + 8.0 * self.dim * self.bags_per_step
        else:
            raise ValueError(f"exchange_bytes: no estimate for {kind.value}")
        return total * (n - 1) / n


def estimate_table(table: TableConfig, optimizer: SparseOptimizer | None = None, *,
                   expected_rows: Mapping[str, int] | None = None, ids_per_step: Mapping[str, int] | None = None,
                   batch_size: int = 1024, world_size: int = 1) -> TableEstimate:
    """Bytes and lookup cost of one table.

    Args:
        table: its config (rows: ``num_rows``, else ``capacity``, else ``expected_rows[name]``).
        optimizer: the collection's default optimizer (for the state width of tables without one).
        expected_rows: hint of rows per dynamic table.
        ids_per_step: ids of the table per global step (default: global batch x features reading it).
        batch_size: per-rank batch size (the global batch is batch_size x world_size).
    """
    rule = table.optimizer if table.optimizer is not None else (optimizer if table.trainable else None)
    row_bytes = table.row_layout(rule).row_bytes  # weights + state, each in its own dtype
    hint = (expected_rows or {}).get(table.name)
    if table.num_rows is not None:
        rows, per_row, bounded = float(table.num_rows), row_bytes + ARRAY_META_BYTES_PER_ROW, True
    else:
        known = hint if hint is not None else table.capacity
        rows = float(known) if known is not None else 0.0
        per_row, bounded = row_bytes + HASH_INDEX_BYTES_PER_ROW, known is not None
    bags = float(batch_size * world_size * len(table.features))
    ids = (ids_per_step or {}).get(table.name)
    if ids is None:
        ids = bags
    return TableEstimate(table.name, rows, rows * per_row, float(ids), table.dim, bounded,
                         index_bytes=rows * (per_row - row_bytes), bags_per_step=bags)


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return out


def fmt_bytes(n: float) -> str:
    return human_bytes(n, digits=2)


def fmt_num(n: float) -> str:
    return human_count(n, small=1e4)
