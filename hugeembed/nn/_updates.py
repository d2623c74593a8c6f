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

import torch

from .._tensors import joined, repeat_each
from ..optim import SparseOptimizer
from ._rare import coalesce, count_lr_scale, update_scaled

__all__ = ["UpdateUnit", "make_units", "apply_unit", "RowUpdates"]


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
    scaled: bool = field(init=False)  # some table has lr_count_scale
    index: dict[int, int] = field(init=False)  # table -> its place in `tables`

    def __post_init__(self) -> None:  # read per table and step: computed once
        object.__setattr__(self, "scaled", any(x is not None for x in self.scale_by))
        object.__setattr__(self, "index", {t: i for i, t in enumerate(self.tables)})


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
                              settings[ts[0]].layout.stochastic_rounding)
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
        if any(unit.shared):
            # rare ids all read their table's shared row: one summed gradient per row, for every
            # table at once (their slots are apart in the group)
            slots, grad, scale, keys, seeds = coalesce(slots, grad, scale, keys, seeds)
        if scale is None:  # the group's own slots of this step: in range
            unit.rule.update(group, slots, grad, lr=lr, step=step, slots_checked=True, keys=keys, seeds=seeds)
        else:
            update_scaled(unit.rule, group, slots, grad, lr=lr, step=step, scale=scale)


class RowUpdates:
    """A training lookup's row_grad_hook: every unit's rule applied to the rows its batch read, once
    each group's rows are confirmed still where the forward read them."""

    def __init__(self, coll, flight: InFlight, prep, slots: torch.Tensor) -> None:
        self.coll, self.flight, self.prep, self.slots = coll, flight, prep, slots

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
        coll, flight = self.coll, self.flight
        at = coll.placement.at  # per lookup position: (table, group, its index in the group)
        units = coll._units
        by_unit: dict[int, tuple] = {}
        touched: dict[int, None] = {}
        for p, slots, grad in items:
            t, g, local = at[p]
            touched[g] = None
            unit = units.get(t)
            if unit is not None:
                by_unit.setdefault(id(unit), (unit, []))[1].append(self._part(p, t, local, slots, grad, unit))
        for g in touched:  # before any update: a failure changes no table
            flight.check(g, coll.groups[g], coll.groups[g].names)
        failed: set[int] = set()
        groups = coll.optimizer.param_groups
        lr_of = coll.optimizer.group_of_table
        try:
            for unit, parts in by_unit.values():
                failed.add(unit.group)
                apply_unit(unit, coll.groups[unit.group], parts, [groups[lr_of[part[0]]]["lr"] for part in parts],
                           flight.step, flight.shared.get(unit.group))
                failed.discard(unit.group)
        finally:  # the rows of the groups updated may go (an update that raised keeps its pins)
            for g in touched:
                if g not in failed:
                    flight.release(g)
