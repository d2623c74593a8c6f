"""One lookup's run through autograd: the pooled forward of a prepared batch over its storages and
slots, and its backward (per-unique-row gradients to a hook, as sparse gradients, or fused into the
triton update), for FusedEmbeddingLookup.lookup (functional/_lookup.py)."""

from __future__ import annotations

from itertools import accumulate

import torch

from typing import TYPE_CHECKING

from .. import _native
from ..errors import ConfigError
from ._native_stages import backward_native, can_use_native_storages, pool_native, unpooled_native, unpooled_rows
from ._grad_rows import GradRows, blocks_of_tables, compact_slots, row_starts, tables_of_blocks
from ._outputs import JaggedEmbeddings, PooledEmbeddings
from ._plan import LookupPlan, Prepared
from ._reference import backward_torch, gradient_rows_torch, pool_torch, unpooled_torch, weights_backward_torch
from ._triton_backward import FusedGrads, fuses, gradient_rows_triton, sums_on_triton
from ._triton_stages import pool_triton

if TYPE_CHECKING:
    from ._lookup import FusedEmbeddingLookup

__all__ = ["LookupRun", "LookupFunction", "runs_of", "weights_need_grad"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # half-precision tables accumulate in float32 (as FBGEMM does), then cast back
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class LookupRun:
    """State of one lookup between forward and backward."""

    def __init__(self, owner: "FusedEmbeddingLookup", prep: Prepared, storages, slots, params, hook,
                 unsure: list[int], runs_hold: bool = False) -> None:
        self.owner, self.prep, self.storages, self.slots = owner, prep, storages, slots
        # the tables whose ids may have no row (slot -1): the backward looks for those in them only
        self.params, self.hook, self.runs, self.unsure = params, hook, owner._runs, unsure
        self.native = prep.native and _storages_native_ok(storages)
        self.triton = not self.native and owner.triton_pools(prep.offsets.device)
        self.dtypes = owner.output_dtypes(storages, runs_hold)
        # a training lookup over tables that give every id a row, laid end to end: no slot is -1
        self.every_row = prep.packed and not unsure and hook is not None
        self.read = None  # (rows, slots into them) as the forward read them, when the backward reads rows
        self.weights_grad = False  # the per-id weights get a gradient (set by lookup)

    def forward(self) -> list[torch.Tensor]:
        plan, prep = self.owner.plan, self.prep
        outs = []
        for g, group in enumerate(plan.groups):
            cdt = _compute_dtype(self.dtypes[g])
            if group.pooled:
                o = (pool_native(plan, prep, self.storages, self.slots, group) if self.native
                     else pool_triton(plan, prep, self.storages, self.slots, group) if self.triton else None)
                if o is None:  # (what the triton kernel does not take)
                    o = pool_torch(plan, prep, self.storages, self.slots, group, cdt, self.runs, self.every_row)
                outs.append(o.to(self.dtypes[g]))
            if group.unpooled:
                o = (unpooled_native(plan, prep, self.storages, self.slots, group) if self.native
                     else unpooled_torch(plan, prep, self.storages, self.slots, group, cdt, self.runs, self.every_row))
                outs.append(o.to(self.dtypes[g]))
        self._keep_rows_read()
        return outs

    def _keep_rows_read(self) -> None:
        """Copies the rows this forward read when its backward differentiates at them (max_norm's
        clip, the per-id weights' gradient): another batch's update may change the tables before
        this backward runs (several batches in flight), and the gradient is the one at the rows
        the forward read."""
        plan, prep = self.owner.plan, self.prep
        trains = self.hook is not None or any(p.requires_grad for p in self.params)
        if not (self.weights_grad or (trains and plan.clipped)):
            return
        storages, slots = list(self.storages), self.slots.clone()
        for t in range(plan.num_tables):
            b, n = prep.unique_base[t], prep.unique_count[t]
            if n == 0 or self.storages[t].size(0) == 0:  # nothing read (an empty table reads zeros)
                continue
            own = self.slots[b : b + n]
            storages[t] = self.storages[t].index_select(0, own.clamp(min=0))
            slots[b : b + n] = torch.where(own >= 0, torch.arange(n, device=own.device), -1)
        self.read = (storages, slots)

    def backward(self, grads: tuple[torch.Tensor, ...], weights_grad: bool) -> tuple[torch.Tensor | None, list]:
        """(gradient of the kept per-id weights or None, gradient per param)."""
        plan, prep = self.owner.plan, self.prep
        pooled, unpooled = [], []
        it = iter(grads)
        for g, group in enumerate(plan.groups):
            cdt = _compute_dtype(self.dtypes[g])
            pooled.append(next(it).to(cdt) if group.pooled else None)
            unpooled.append(next(it).to(cdt) if group.unpooled else None)
        # at the rows the forward read (a copy, when the gradient depends on them)
        storages, slots, runs = (self.storages, self.slots, self.runs) if self.read is None else \
            (*self.read, None)
        gw = (weights_backward_torch(plan, prep, storages, slots, pooled, unpooled, runs)
              if weights_grad else None)
        if self.hook is None and not self.params:
            return gw, []
        if self.triton and getattr(self.hook, "fused", None) is not None and \
                fuses(plan, prep, pooled, unpooled, self.unsure) and self.hook.fusable():
            # (the triton backward: each row's gradient summed and its rule applied in the same kernel)
            self.hook.fused(FusedGrads(plan, prep, self.slots, pooled))
            return gw, [None] * len(self.params)
        if self.native and (self.read is None or _storages_native_ok(storages)):
            blocks, row0 = backward_native(plan, prep, storages, slots, pooled, unpooled)
            table_grads = None
        else:
            # (the triton kernels sum each row in batch order, with no [ids, D] product and no float atomics)
            rows = (gradient_rows_triton(plan, prep, pooled) if self.triton and sums_on_triton(prep, pooled, unpooled)
                    else gradient_rows_torch(plan, prep, pooled, unpooled))
            if len(plan.tables_by_dim) == 1 and not plan.clipped and (prep.packed or (
                    prep.capacity == sum(prep.unique_count) and
                    prep.unique_base == list(accumulate(prep.unique_count[:-1], initial=0)))):
                # one dim, nothing clipped, tables end to end from 0: the dim's gradient rows are the block
                blocks, row0, table_grads = rows, prep.unique_base, None
            else:
                table_grads = backward_torch(plan, prep, storages, slots, pooled, unpooled, rows)
                blocks = row0 = None
        out: list[torch.Tensor | None] = [None] * len(self.params)
        # ids that read zeros (slot -1: not admitted, unknown in eval) get no update: one check for
        # the tables whose ids may lack a row (one host sync per step, none when none may), per
        # table only when some id has no row
        table_slots = prep.per_table(self.slots) if self.unsure else None
        unsure = [table_slots[t] for t in self.unsure if table_slots[t].numel()] if self.unsure else []
        some_unknown = bool((torch.cat(unsure) < 0).any()) if unsure else False
        # a hook with a `spans` method takes every table's rows by dim, end to end (when every id
        # has a row); one with `many` every table's rows in one call (it may update tables that
        # share storage together)
        spans = getattr(self.hook, "spans", None)
        if spans is not None and not some_unknown:
            if blocks is None:
                blocks, (row0, _) = blocks_of_tables(plan, table_grads), row_starts(plan, prep)
            spans(GradRows(blocks, compact_slots(plan, prep, self.slots, row0), row0, prep.unique_count))
            return gw, out
        if table_grads is None:
            table_grads = tables_of_blocks(plan, blocks, prep.unique_count)
        if table_slots is None:
            table_slots = prep.per_table(self.slots)
        many = getattr(self.hook, "many", None)
        items = []
        for t, grad in enumerate(table_grads):
            slots = table_slots[t]
            if some_unknown and slots.numel() and t in self.unsure:
                known = slots >= 0
                slots, grad = slots[known], grad[known]
            if self.hook is not None:
                if slots.numel():
                    if many is not None:
                        items.append((t, slots, grad))
                    else:
                        self.hook(t, slots, grad)
            elif self.params and slots.numel():  # a table no id reached gets no gradient at all
                p = self.params[t]
                out[t] = torch.sparse_coo_tensor(slots.unsqueeze(0), grad.to(p.dtype), p.shape, check_invariants=False)
        if items:
            many(items)
        return gw, out

    def wrap(self, outs) -> PooledEmbeddings:
        plan, prep = self.owner.plan, self.prep
        it = iter(outs)
        groups, unpooled = [], {}
        for group in plan.groups:
            if group.pooled:
                groups.append(next(it))
            else:
                groups.append(torch.zeros(prep.batch_size, 0, group.dim, device=prep.offsets.device))
            if group.unpooled:
                rows = next(it)
                start = 0
                for f, n in zip(group.unpooled, unpooled_rows(prep, group)):
                    B = prep.batch_size
                    offs = prep.offsets[f * B : (f + 1) * B + 1]
                    unpooled[plan.features[f].name] = JaggedEmbeddings(rows[start : start + n], offs - offs[0])
                    start += n
        return PooledEmbeddings(plan.pooled_names(), groups, self.owner._where, unpooled)


def runs_of(plan: LookupPlan, row_groups) -> dict[int, list[tuple[int, int]]] | None:
    """Per dim, the runs (first, last) of consecutive tables reading one storage (``row_groups``)."""
    if row_groups is None:
        return None
    groups = list(row_groups)
    if len(groups) != plan.num_tables:
        raise ConfigError(f"row_groups has {len(groups)} entries for {plan.num_tables} tables")
    seen, runs = set(), {}
    for t, (spec, g) in enumerate(zip(plan.tables, groups)):
        prev = groups[t - 1] if t else None
        if g is not None and g == prev and plan.tables[t - 1].dim == spec.dim:
            runs[spec.dim][-1] = (runs[spec.dim][-1][0], t)
            continue
        if g is not None and g in seen:
            raise ConfigError(f"row_groups: the tables of group {g} are not consecutive (table {spec.name!r})")
        seen.add(g)
        runs.setdefault(spec.dim, []).append((t, t))
    return runs


def weights_need_grad(weights: torch.Tensor | None) -> bool:
    return weights is not None and weights.requires_grad and torch.is_grad_enabled()



def _storages_native_ok(storages) -> bool:
    return _native.available() and can_use_native_storages(storages)


class LookupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: LookupRun, weights, *params):  # type: ignore[override]
        ctx.run = run
        return tuple(run.forward())

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        run = ctx.run
        gw, gp = run.backward(grads, ctx.needs_input_grad[1])
        if gw is not None:
            gw = gw.to(run.prep.weights.dtype)
        return (None, gw, *(gp if gp else [None] * len(run.params)))
