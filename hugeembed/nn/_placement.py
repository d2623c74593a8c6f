"""Where a collection's tables live, decided once when it is built: groups, lookup order, spans.

A collection's tables go into table groups (store/_grouping.py: one per kind and row layout; a
tiered table alone).  The fused lookup sees the tables in group order, so a group's tables are
consecutive there and its part of every batch array is one span::

    tables (user order)   a(dyn)  s(static)  b(dyn)        groups  0: [a, b]   1: [s]
    lookup order          a  b  s                          spans   0: tables 0..1, 1: table 2

The outputs keep the user's order (features are listed as given); only the layout of the
batch's unique keys follows the lookup order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._tensors import repeat_each
from ..optim import SparseOptimizer
from ..store import TableSettings
from ._config import TableConfig

__all__ = ["table_settings", "Span", "Placement", "segment_column"]


def table_settings(cfg: TableConfig, rule: SparseOptimizer | None, collection_seed: int, **changes) -> TableSettings:
    """What table `cfg`'s group keeps of it (`changes`: a shard's own, e.g. its share of the rows)."""
    common = dict(initializer=cfg.initializer, init_state=None if rule is None else rule.init_state,
                  seed=cfg.resolved_seed(collection_seed))
    if cfg.num_rows is not None:
        s = TableSettings(cfg.name, cfg.row_layout(rule), num_rows=cfg.num_rows, **common)
    else:
        s = TableSettings(cfg.name, cfg.row_layout(rule), capacity=cfg.capacity, on_full=cfg.on_full,
                          eviction_policy=cfg.eviction_policy, admit_min_count=cfg.admit_min_count,
                          admit_probability=cfg.admit_probability, max_pending=cfg.max_pending, **common)
    return s.replace(**changes) if changes else s


@dataclass(frozen=True)
class Span:
    """Group `group`'s tables: lookup positions ``first .. first + len(tables) - 1``, which are the
    collection's tables `tables` (its local table i is ``tables[i]``)."""

    group: int
    first: int
    tables: tuple[int, ...]

    @property
    def last(self) -> int:
        return self.first + len(self.tables) - 1


class Placement:
    """Tables -> groups, and the lookup order (tables grouped, user order within a group).

    Args:
        where: per table, (group index, its index in the group), or None for a table this
            collection holds no rows of (a shard held by another rank).
    """

    def __init__(self, where: list[tuple[int, int] | None]) -> None:
        self.where = list(where)
        held = [t for t, w in enumerate(where) if w is not None]
        self.order = sorted(held, key=lambda t: where[t]) + [t for t, w in enumerate(where) if w is None]
        self.position = {t: p for p, t in enumerate(self.order)}
        groups = sorted({w[0] for w in where if w is not None})
        self.spans: list[Span] = []
        for g in groups:
            ts = tuple(t for t in self.order if where[t] is not None and where[t][0] == g)
            self.spans.append(Span(g, self.position[ts[0]], ts))
        self.span_of = {s.group: s for s in self.spans}
        # per lookup position: (table, its group, its index in the group); None for a table held elsewhere
        self.at = [(t, *where[t]) if where[t] is not None else (t, None, None) for t in self.order]

    def row_groups(self) -> list[int | None]:
        """Per lookup position, its group (None: held by no group here): FusedEmbeddingLookup's row_groups."""
        return [self.where[t][0] if self.where[t] is not None else None for t in self.order]

    def group_of(self, t: int) -> int:
        return self.where[t][0]


def segment_column(bases: list[int], counts: list[int], lo: int, hi: int, device) -> torch.Tensor:
    """int64 ``[hi - lo]``: the table column of a span of a batch's unique keys: table i's keys at
    ``[bases[i], bases[i] + counts[i])`` (positions in the whole array) hold i, the gaps between
    tables -1.  Built from host-known sizes: no read of the device; by numpy, no Python per table."""
    b, n = np.asarray(bases, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    k = len(b)
    if k == 0:
        return repeat_each([-1], [hi - lo], device)
    # runs: gap before table 0, table 0, gap before table 1, ..., table k-1, gap to hi
    values = np.full(2 * k + 1, -1, dtype=np.int64)
    values[1::2] = np.arange(k)
    sizes = np.empty(2 * k + 1, dtype=np.int64)
    ends = b + n
    sizes[0], sizes[1::2], sizes[2:-1:2], sizes[-1] = b[0] - lo, n, b[1:] - ends[:-1], hi - ends[-1]
    return repeat_each(values, sizes, device)
