"""The backward's update stage: one rule call per (group, rule, learning rate), decided at build.

An update unit is the tables of one group trained by one rule (and alike in lr_count_scale):
their rows are rows of one tensor, so the unit's rows of a step are updated by one call of the
rule on the group's rows.  What a collection does for rare ids is a property of the unit:

* shared row (TableConfig.shared_row): rare ids of a table all read its shared row, whose
  gradient is their sum (``coalesce``: one unique over the unit's slots);
* lr_count_scale: each row's step scaled by min(1, hits / scale) (``update_scaled``);
* global Adam: rows it did not touch lag until touched (the rule catches them up itself);
* stochastic rounding: draws by (the table's seed, step, key): the unit passes each row's key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING

import torch

from .._tensors import joined, repeat_each
from ..optim import SparseOptimizer
from ._fused_updates import fused_update, unit_fuses
from ._rare import coalesce, count_lr_scale, update_scaled

if TYPE_CHECKING:  # annotations only
    from ._inflight import InFlight

__all__ = ["UpdateUnit", "make_units", "apply_unit", "update", "RowUpdates"]


@dataclass(frozen=True, eq=False)
class UpdateUnit:
    """Tables `tables` (collection indices, lookup order) of group `group`, trained by `rule`."""

    group: int
    rule: SparseOptimizer
    tables: tuple[int, ...]
    scale_by: tuple[int | None, ...]  # per table, its lr_count_scale
    shared: tuple[bool, ...]  # per table, whether it has a shared row
    seeds: tuple[int, ...]  # per table, its seed (stochastic rounding)
    rounds: bool  # its group's weights are rounded stochastically (draws by key)
    positions: tuple[int, ...]  # per table, its lookup position
    dim: int
    scaled: bool = field(init=False)  # some table has lr_count_scale
    coalesces: bool = field(init=False)  # some table has a shared row
    index: dict[int, int] = field(init=False)  # table -> its place in `tables`
    run: tuple[int, int] | None = field(init=False)  # (first, last) lookup position when consecutive

    def __post_init__(self) -> None:  # read per table and step: computed once
        object.__setattr__(self, "scaled", any(x is not None for x in self.scale_by))
        object.__setattr__(self, "coalesces", any(self.shared))
        object.__setattr__(self, "index", {t: i for i, t in enumerate(self.tables)})
        p = self.positions
        object.__setattr__(self, "run", (p[0], p[-1]) if p == tuple(range(p[0], p[0] + len(p))) else None)


def make_units(spans, configs, rules, settings) -> dict[int, UpdateUnit]:
    """Table index -> its unit, for every trainable table of the spans (store/_grouping: groups)."""
    units: dict[int, UpdateUnit] = {}
    for span in spans:
        by_key: dict[tuple, list[int]] = {}
        for t in span.tables:
            if rules[t] is not None:
                by_key.setdefault((id(rules[t]), configs[t].lr_count_scale is not None), []).append(t)
        for ts in by_key.values():
            unit = UpdateUnit(span.group, rules[ts[0]], tuple(ts), tuple(configs[t].lr_count_scale for t in ts),
                              tuple(configs[t].shared_row for t in ts), tuple(settings[t].seed for t in ts),
                              settings[ts[0]].layout.stochastic_rounding,
                              tuple(span.first + span.tables.index(t) for t in ts), configs[ts[0]].dim)
            units.update(dict.fromkeys(ts, unit))
    return units


def apply_unit(unit: UpdateUnit, group, parts: list[tuple], lrs: list[float], step: int,
               shared: torch.Tensor | None = None) -> None:
    """Applies `unit`'s rule to its tables' rows of one step.

    `parts`: per table of the unit with rows this step, ``(table, local, slots, grad, keys, hits)``
    (local: its index in the group; keys: the rows' keys, for stochastic rounding, else None; hits:
    their hit counts, for lr_count_scale, else None); `lrs` their learning rates; `shared`: per
    table of the group its shared row's slot (-1: none), or None.  Tables of one lr share one rule
    call."""
    if all(lr == lrs[0] for lr in lrs):  # (the usual case: one lr)
        by_lr = {lrs[0]: parts}
    else:
        by_lr = {}
        for part, lr in zip(parts, lrs):
            by_lr.setdefault(lr, []).append(part)
    pos = unit.index if unit.rounds or unit.scaled else None
    for lr, mine in by_lr.items():
        slots = joined([p[2] for p in mine])
        grad = joined([p[3] for p in mine])
        keys = seeds = scale = None
        if unit.rounds:
            sizes = [p[2].numel() for p in mine]
            keys = joined([p[4] for p in mine])
            seeds = repeat_each([unit.seeds[pos[p[0]]] for p in mine], sizes, slots.device)
        if unit.scaled:
            sizes = [p[2].numel() for p in mine]
            hits = joined([p[5] for p in mine])
            by = repeat_each([unit.scale_by[pos[p[0]]] for p in mine], sizes, slots.device)
            scale = count_lr_scale(hits, by)
            if shared is not None:  # the shared row takes every rare id's gradient at the full lr
                own = shared[repeat_each([p[1] for p in mine], sizes, slots.device)]
                scale = torch.where(slots == own, 1.0, scale)
        update(unit, group, slots, grad, lr, step, keys, seeds, scale)


def update(unit: UpdateUnit, group, slots: torch.Tensor, grad: torch.Tensor, lr: float, step: int,
           keys: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> None:
    """`unit`'s rule on its rows at `slots` (its tables' rows end to end, one lr)."""
    if unit.coalesces:
        # rare ids all read their table's shared row: one summed gradient per row, for every
        # table at once (their slots are apart in the group)
        slots, grad, scale, keys, seeds = coalesce(slots, grad, scale, keys, seeds)
    if scale is None:  # the group's own slots of this step: in range
        unit.rule.update(group, slots, grad, lr=lr, step=step, slots_checked=True, keys=keys, seeds=seeds)
    else:
        update_scaled(unit.rule, group, slots, grad, lr=lr, step=step, scale=scale)


def unit_lrs(unit: UpdateUnit, optimizer) -> set[float]:
    """The learning rates of a unit's tables now (one param group per table: schedulers drive them),
    read by C-level maps: no Python per table."""
    groups, lr_of = optimizer.param_groups, optimizer.group_of_table
    return set(map(itemgetter("lr"), map(groups.__getitem__, map(lr_of.__getitem__, unit.tables))))


class RowUpdates:
    """A training lookup's row_grad_hook: every unit's rule applied to the rows its batch read, once
    each group's rows are confirmed still where the forward read them."""

    def __init__(self, coll, flight: InFlight, prep, slots: torch.Tensor) -> None:
        self.coll, self.flight, self.prep, self.slots = coll, flight, prep, slots
        self._fused_work: list[tuple] = []  # (unit, lr) of the units with rows, once fusable() said yes

    def __call__(self, p: int, slots: torch.Tensor, grad: torch.Tensor) -> None:
        self.many([(p, slots, grad)])

    def _part(self, p: int, t: int, local: int, slots: torch.Tensor, grad: torch.Tensor, unit) -> tuple:
        """(table, its index in the group, slots, grad, keys, hits) of one table's rows; keys and hits
        only for the units that read them (stochastic rounding, lr_count_scale)."""
        if not (unit.rounds or unit.scaled):
            return t, local, slots, grad, None, None
        prep, flight = self.prep, self.flight
        b, n = prep.unique_base[p], prep.unique_count[p]
        known = None if slots.numel() == n else self.slots[b : b + n] >= 0  # the lookup dropped ids without rows
        pick = (lambda x: x) if known is None else (lambda x: x[known])
        keys = pick(prep.unique_keys[b : b + n]) if unit.rounds else None
        hits = None
        if unit.scale_by[unit.index[t]] is not None:
            lo = prep.unique_base[self.coll.placement.span_of[unit.group].first]
            hits = pick(flight.hits[unit.group][b - lo : b - lo + n])
        return t, local, slots, grad, keys, hits

    def many(self, items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Per table (lookup position) with rows, its slots and gradient rows."""
        at = self.coll.placement.at  # per lookup position: (table, group, its index in the group)
        units = self.coll._units
        by_unit: dict[int, tuple] = {}
        touched: dict[int, None] = {}
        for p, slots, grad in items:
            t, g, local = at[p]
            touched[g] = None
            unit = units.get(t)
            if unit is not None:
                by_unit.setdefault(id(unit), (unit, []))[1].append(self._part(p, t, local, slots, grad, unit))
        self._apply([(unit, parts, None) for unit, parts in by_unit.values()], touched)

    def spans(self, rows) -> None:
        """Every table's rows by dim, end to end (functional/_grad_rows.GradRows; every id has a
        row): a unit of consecutive tables of one lr is one slice of them, no join."""
        coll = self.coll
        count = rows.count
        touched = {s.group: None for s in coll.placement.spans if any(count[s.first : s.first + len(s.tables)])}
        work = []
        for unit in coll._unit_list:
            if unit.group not in touched:
                continue
            lrs = unit_lrs(unit, coll.optimizer)
            if unit.run is not None and len(lrs) == 1 and not (unit.rounds or unit.scaled):
                slots, grad = rows.of_tables(*unit.run, unit.dim)
                if slots.numel():
                    work.append((unit, None, (slots, grad, lrs.pop())))
                continue
            parts = []
            for t, p in zip(unit.tables, unit.positions):
                if count[p]:
                    slots, grad = rows.of_tables(p, p, unit.dim)
                    parts.append(self._part(p, t, coll.placement.at[p][2], slots, grad, unit))
            if parts:
                work.append((unit, parts, None))
        self._apply(work, touched)

    def fusable(self) -> bool:
        """Whether every unit with rows this step takes the fused triton update (nn/_fused_updates.py)."""
        coll, count = self.coll, self.prep.unique_count
        work = []
        for unit in coll._unit_list:
            if not any(map(count.__getitem__, unit.positions)):
                continue
            lrs = unit_lrs(unit, coll.optimizer)
            if not unit_fuses(unit, coll.groups[unit.group].layout, lrs):
                return False
            work.append((unit, lrs.pop()))
        self._fused_work = work
        return True

    def fused(self, grads) -> None:
        """Applies every unit's rule on the triton kernels, reading the step's pooled gradients through
        `grads` (functional's FusedGrads); after :meth:`fusable` said yes."""
        coll, flight, count = self.coll, self.flight, self.prep.unique_count
        touched = {s.group: None for s in coll.placement.spans if any(count[s.first : s.first + len(s.tables)])}
        for g in touched:  # before any update: a failure changes no table
            flight.check(g, coll.groups[g], coll.groups[g].names)
        failed: set[int] = set()
        try:
            for unit, lr in self._fused_work:
                failed.add(unit.group)
                fused_update(unit, coll.groups[unit.group], grads, len(coll.placement.at), lr, flight.step)
                failed.discard(unit.group)
        finally:
            for g in touched:
                if g not in failed:
                    flight.release(g)

    def _apply(self, work: list[tuple], touched: dict[int, None]) -> None:
        """Applies each (unit, parts, joined) of `work` (joined: (slots, grad, lr) of a unit whose
        tables' rows are end to end, else its per-table parts), once every touched group's rows are
        confirmed still where the forward read them; releases the groups updated."""
        coll, flight = self.coll, self.flight
        for g in touched:  # before any update: a failure changes no table
            flight.check(g, coll.groups[g], coll.groups[g].names)
        failed: set[int] = set()
        groups = coll.optimizer.param_groups
        lr_of = coll.optimizer.group_of_table
        try:
            for unit, parts, whole in work:
                failed.add(unit.group)
                group = coll.groups[unit.group]
                if whole is not None:
                    update(unit, group, whole[0], whole[1], whole[2], flight.step)
                else:
                    apply_unit(unit, group, parts, [groups[lr_of[part[0]]]["lr"] for part in parts], flight.step,
                               flight.shared.get(unit.group))
                failed.discard(unit.group)
        finally:  # the rows of the groups updated may go (an update that raised keeps its pins)
            for g in touched:
                if g not in failed:
                    flight.release(g)
