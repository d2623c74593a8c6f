"""The backward's gradient rows by dim: each dim's tables' unique rows end to end, in table order,
with their slots beside them.  A row-grad hook with a ``spans`` method takes them so: the tables
that one update applies to (consecutive, of one dim) are then one slice, not a join of per-table
parts (the per-table Python of a step)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from operator import sub

import torch

from .._tensors import joined, repeat_each
from ._plan import LookupPlan, Prepared

__all__ = ["GradRows", "row_starts", "compact_slots", "blocks_of_tables", "tables_of_blocks"]


@dataclass
class GradRows:
    """grads[D]: [n_D, D] the gradient rows of dim D's tables; slots[D]: int64 [n_D] their row
    slots; row0[t]: table t's first row in its dim's arrays; count[t]: its rows."""

    grads: dict[int, torch.Tensor]
    slots: dict[int, torch.Tensor]
    row0: list[int]
    count: list[int]

    def of_tables(self, first: int, last: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, grads) of tables first..last (consecutive, of dim `dim`): views, no copy."""
        lo, hi = self.row0[first], self.row0[last] + self.count[last]
        return self.slots[dim][lo:hi], self.grads[dim][lo:hi]


def row_starts(plan: LookupPlan, prep: Prepared) -> tuple[list[int], dict[int, int]]:
    """(row0, rows per dim): each table's first row in its dim's arrays, tables in order."""
    if len(plan.tables_by_dim) == 1:  # one dim: the counts' running sum (no Python per table)
        ends = list(accumulate(prep.unique_count, initial=0))
        return ends[:-1], {plan.tables[0].dim: ends[-1]}
    row0, at = [0] * plan.num_tables, {}
    for t, (spec, n) in enumerate(zip(plan.tables, prep.unique_count)):
        row0[t] = at.get(spec.dim, 0)
        at[spec.dim] = row0[t] + n
    return row0, at


def compact_slots(plan: LookupPlan, prep: Prepared, slots: torch.Tensor, row0: list[int]) -> dict[int, torch.Tensor]:
    """Per dim, `slots` (laid out like ``prep.unique_keys``) of its tables end to end: one gather
    per dim (the native prepare leaves room between tables), sizes known on the host."""
    if prep.packed and len(plan.tables_by_dim) == 1:  # every table, end to end from 0 (torch, triton): a view
        return {plan.tables[0].dim: slots[: sum(prep.unique_count)]}
    out = {}
    dev = slots.device
    for D, ts in plan.tables_by_dim.items():
        if len(ts) == plan.num_tables:  # every table of this dim (no Python per table)
            counts, shifts = prep.unique_count, list(map(sub, prep.unique_base, row0))
        else:
            counts = [prep.unique_count[t] for t in ts]
            shifts = [prep.unique_base[t] - row0[t] for t in ts]
        n = sum(counts)
        shift = repeat_each(shifts, counts, dev)
        out[D] = slots.index_select(0, shift + torch.arange(n, device=dev))
    return out


def blocks_of_tables(plan: LookupPlan, table_grads: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per dim, its tables' gradient rows end to end (a view when they already are)."""
    return {D: joined([table_grads[t] for t in ts]) for D, ts in plan.tables_by_dim.items()}


def tables_of_blocks(plan: LookupPlan, blocks: dict[int, torch.Tensor], count: list[int]) -> list[torch.Tensor]:
    """Per table its gradient rows: views of the dim blocks (one split per dim)."""
    out: list[torch.Tensor] = [None] * plan.num_tables  # type: ignore[list-item]
    for D, ts in plan.tables_by_dim.items():
        parts = blocks[D].split([count[t] for t in ts]) if len(ts) > 1 else (blocks[D],)
        for t, g in zip(ts, parts):
            out[t] = g
    return out
