"""Which tables share a group: decided once, from their settings, when a collection is built.

Tables share a group when they are of one kind (static / dynamic), one row layout (weight dtype,
state dtype, dim, state width, stochastic rounding) and hold rows (a tiered table's key index is a
group of its own): the group keeps one rows tensor and one key index for all of them, and every
stage of a step is one call per group (TorchRec's ``group_tables``, FBGEMM's table-batched
embedding).  Nothing regroups later: growing a group is a re-layout of that group.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._dynamic import DynamicGroup
from ._settings import TableSettings
from ._static import StaticGroup

__all__ = ["group_tables", "group_key"]


def group_key(s: TableSettings) -> tuple:
    """What tables of one group must share."""
    return ("static" if s.static else "dynamic", s.layout)


def group_tables(tables: Sequence[TableSettings], device: torch.device | str,
                 backend: str | None = None) -> tuple[list, list[tuple[int, int]]]:
    """(groups, where each table went: (group index, its index in the group)), groups in the order of
    their first table, tables in a group in the given order."""
    keys: dict[tuple, int] = {}
    members: list[list[int]] = []
    for i, s in enumerate(tables):
        g = keys.setdefault(group_key(s), len(members))
        if g == len(members):
            members.append([])
        members[g].append(i)
    groups, where = [], [(0, 0)] * len(tables)
    for g, idx in enumerate(members):
        ts = [tables[i] for i in idx]
        groups.append(StaticGroup(ts, device=device) if ts[0].static else
                      DynamicGroup(ts, device=device, backend=backend))
        for local, i in enumerate(idx):
            where[i] = (g, local)
    return groups, where
