"""Fused multi-table lookup with TF semantics and row-sparse autograd.

Stages (docs/architecture.md): clean + dedup (``prepare``), fetch (slots: identity for static
tables, a store for dynamic ones), pool, and in backward the per-unique-row
gradient handed to a hook (an optimizer applied in place) or returned as a sparse
gradient.  Native kernels on CPU float32, the triton pool on CUDA (when triton imports), the torch
twin everywhere else.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from .. import _native, _triton
from ..errors import ConfigError, InputError
from ._native_stages import NativeScratch, batch_arrays, can_use_native, pool_direct, prepare_native
from ._outputs import PooledEmbeddings
from ._plan import LookupPlan, Prepared
from ._specs import FeatureSpec, TableSpec
from ._reference import prepare_torch
from ._triton_prepare import prepare_triton
from ._triton_stages import forward_direct_triton, triton_runs_on
from ._lookup_run import LookupFunction, LookupRun, runs_of, weights_need_grad

__all__ = ["FusedEmbeddingLookup", "RowGradHook"]

# Called in backward per table with (table index, slots, gradient rows).  A hook that also has
# a method ``many(items)`` gets every table's ``(t, slots, grad)`` in one call instead.
RowGradHook = Callable[[int, torch.Tensor, torch.Tensor], None]
"""Called in backward once per table with rows touched: ``hook(table_index, slots [U], grad [U, D])``.

`slots` are unique row slots (for static tables, the row ids) and `grad` the exact sum
of the gradients of every use of each row.  An optimizer applies its update here, in place.
"""

_BACKENDS = ("auto", "native", "torch", "triton")


class FusedEmbeddingLookup:
    """One fused lookup over many features and tables, built once and called per batch.

    Args:
        tables: the tables (:class:`TableSpec`), in order.
        features: the outputs (:class:`FeatureSpec`), in order.
        backend: ``"auto"`` (native kernels on CPU float32, triton on CUDA when triton imports, torch
            otherwise), ``"native"`` (raise if they cannot run), ``"triton"`` (raise if triton does not
            import or the tensors are on neither CUDA nor, under ``TRITON_INTERPRET=1``, the CPU) or
            ``"torch"``.  The triton backend pools (functional/_triton_stages.py: pooled features of
            fp32/fp16/bf16 rows, float32 or no weights; forward-only static lookups straight from the
            batch) and cleans + dedups (functional/_triton_prepare.py); unpooled features, float64 rows
            or weights run on the torch reference, and so does the backward unless a row_grad_hook takes the fused triton
            update (functional/_triton_backward.py: an EmbeddingCollection's training step).

        row_groups: per table, the group of tables whose rows it reads from one storage (a table
            group's rows: each call then gives every table of the group that same tensor, and
            the slots index it), or None for a table alone.  A group's tables are consecutive.
            The torch path gathers a group's rows with one op.
        complete: per table, whether every id of a training lookup gets a row (no slot -1: a
            table that creates or shares a row for every id); the backward then looks for ids
            without a row only in the other tables.

    Example (static tables, plain tensors)::

        lookup = FusedEmbeddingLookup(
            [TableSpec("users", dim=16, num_rows=1000), TableSpec("items", dim=16, num_rows=500)],
            [FeatureSpec("user", "users", combiner="sum"), FeatureSpec("item", "items")])
        out = lookup([user_weight, item_weight], batch)        # PooledEmbeddings
        out.stacked()                                          # [B, 2, 16]
    """

    BACKENDS = _BACKENDS

    def __init__(self, tables: Sequence[TableSpec], features: Sequence[FeatureSpec], *, backend: str = "auto",
                 row_groups: Sequence[int | None] | None = None, complete: Sequence[bool] | None = None) -> None:
        if backend not in _BACKENDS:
            raise ConfigError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if backend == "triton" and not _triton.available():
            raise ConfigError("backend='triton' needs triton: pip install 'hugeembed[triton]'")
        self.plan = LookupPlan(tables, features)
        self.backend = backend
        self._runs = runs_of(self.plan, row_groups)
        # per dim group, the tables its features read
        self._group_tables = [sorted({self.plan.feature_table[f] for f in g.pooled + g.unpooled})
                              for g in self.plan.groups]
        # the tables reading one storage, as (first, last, dim, rows needed): a step checks each once
        self._storage_runs = None if self._runs is None else [
            (a, b, D, max(-1 if t.num_rows is None else t.num_rows for t in self.plan.tables[a : b + 1]))
            for D, runs in self._runs.items() for a, b in runs]
        # per dim group, the first table of each storage run its tables lie in: where those runs hold (each
        # run's tables read one tensor, as _check_storages finds), the group's dtypes are theirs
        first_of = {t: a for a, b, _, _ in self._storage_runs or () for t in range(a, b + 1)}
        self._group_run_firsts = None if self._runs is None else [sorted({first_of[t] for t in ts})
                                                                  for ts in self._group_tables]
        if complete is not None and len(complete) != self.plan.num_tables:
            raise ConfigError(f"complete has {len(complete)} entries for {self.plan.num_tables} tables")
        self._complete = [False] * self.plan.num_tables if complete is None else [bool(c) for c in complete]
        # the tables whose ids may read zeros (slot -1), given slots looked up / the ids themselves
        self._unsure = [t for t in range(self.plan.num_tables) if not self._complete[t]]
        self._unsure_by_ids = [t for t in self._unsure if self.plan.tables[t].num_rows is None]
        self._scratch: NativeScratch | None = None
        self._where: dict[str, tuple[int, int]] = {}
        for g, group in enumerate(self.plan.groups):
            for k, f in enumerate(group.pooled):
                self._where[self.plan.features[f].name] = (g, k)

    def ready(self, device: torch.device | str) -> None:
        """Makes the plan's constants on `device` now (a collection calls it when built or moved), so
        that its first step copies nothing to the device."""
        if torch.device(device).type != "meta":
            self.plan.arrays(device)

    # -- stages ------------------------------------------------------------------------

    def _native_checked(self, sf, storages, ends: bool) -> bool:
        """Whether the native kernels take this batch (:meth:`_native_ok`), with what they leave
        to their caller checked: the bags the plan does not read, and with `ends` where the
        offsets start and end (:meth:`LookupPlan.check_ends`; he_lookup_count checks those
        itself, and the torch prepare checks all of it).  A bad batch reports its offsets
        before backend='native' refuses its tables."""
        try:
            ok = self._native_ok(sf, storages)
            if ok and not ends:
                self.plan.check_unread_bags(sf)  # (raises when a feature the plan needs is missing)
        except InputError:
            if sf.values().is_cpu:
                self.plan.check_ends(sf)
            raise
        if ok and ends:
            self.plan.check_ends(sf)
        return ok

    def _native_ok(self, sf, storages) -> bool:
        if self.backend in ("torch", "triton"):
            return False
        if weights_need_grad(sf.weights_or_none()):
            # the kernels compute no gradient for per-id weights; the torch path does
            if self.backend == "native":
                raise InputError(f"features {list(sf.keys())}: backend='native' computes no gradient for per-id "
                                 "weights that require grad; use backend='auto' or 'torch'")
            return False
        ok = can_use_native(sf, storages)
        if self.backend == "native" and not ok:
            if not _native.available():
                _native.lib()  # raises ImportError saying how to build the kernels
            got = ", ".join(f"{t.name!r} {getattr(s, 'dtype', type(s).__name__)} on {getattr(s, 'device', '-')}"
                            for t, s in zip(self.plan.tables, storages))
            raise InputError(f"features {list(sf.keys())}, tables {got or '(none given)'}: backend='native' needs CPU "
                             "float32 tables and a CPU batch with float32 (or no) weights")
        return ok

    def triton_pools(self, device: torch.device) -> bool:
        """Whether the triton kernels pool tensors on `device`: backend 'triton' (which raises where they
        cannot run), or 'auto' on CUDA when triton imports."""
        if self.backend == "triton":
            if not triton_runs_on(device):
                raise InputError(f"backend='triton' runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1, "
                                 f"set before triton is imported); the batch is on {device}")
            return True
        return self.backend == "auto" and device.type == "cuda" and triton_runs_on(device)

    def prepare(self, sf, storages: Sequence[torch.Tensor] = (), *, deduplicate: bool = True) -> Prepared:
        """Clean + dedup a batch: unique keys per table and each id's index into them.

        ``deduplicate=False`` gives every id its own entry: cheaper for a forward-only
        lookup (inference), which sums no gradient per row; such a batch refuses a backward.
        """
        self.plan.check_batch(sf, ends=False)
        on_triton = self.triton_pools(sf.device)  # (backend='triton' refuses a device it cannot run on, first)
        prep = None
        if self._native_checked(sf, storages, ends=False):
            if self._scratch is None:
                self._scratch = NativeScratch()
            prep = prepare_native(self.plan, sf, self._scratch, deduplicate)
        elif on_triton:
            prep = prepare_triton(self.plan, sf, deduplicate)
        if prep is None:
            prep = prepare_torch(self.plan, sf, deduplicate)
        w = sf.weights_or_none()
        prep.weights_require_grad = w is not None and w.requires_grad
        prep.id_bounds = self.plan.id_bounds  # (every prepare checks each static id against its table's rows)
        return prep

    def _check_storages(self, storages: Sequence[torch.Tensor], device: torch.device) -> bool:
        """Each table: a float tensor of the plan's shape on the batch's `device` (O(tables), no sync).
        True when the tables of each storage run read one tensor (the row groups hold)."""
        if len(storages) != self.plan.num_tables:
            raise ConfigError(f"lookup of tables {[t.name for t in self.plan.tables]} needs {self.plan.num_tables} "
                              f"tables, got {len(storages)}")
        runs = self._storage_runs
        if runs is not None:  # the tables of a group read one tensor: checked once per group, when they do
            ids = list(map(id, storages))
            for a, b, dim, rows in runs:
                s = storages[a]
                if ids[a : b + 1].count(ids[a]) != b + 1 - a or not _rows_fit(s, dim, rows, device):
                    break  # (the per-table pass below names the table at fault)
            else:
                return True
        # per table: one read of the shape (s.size(i) costs twice as much); consecutive tables of one
        # tensor checked once for their dim and rows
        last, shape = _UNSET, ()
        for spec, s in zip(self.plan.tables, storages):
            if s is last and spec.dim <= shape[1] and (spec.num_rows is None or shape[0] >= spec.num_rows):
                continue
            last = s
            if not isinstance(s, torch.Tensor):
                raise InputError(f"table {spec.name!r}: rows must be a tensor, got {type(s).__name__}")
            shape = s.shape
            if len(shape) != 2 or shape[1] < spec.dim:
                raise InputError(f"table {spec.name!r}: rows must be 2-D with >= {spec.dim} columns, got {tuple(shape)}")
            if spec.num_rows is not None and shape[0] < spec.num_rows:
                raise InputError(f"table {spec.name!r}: has {shape[0]} rows, spec says {spec.num_rows}")
            if not s.dtype.is_floating_point:  # an integer table would pool into truncated means
                raise InputError(f"table {spec.name!r}: rows must be floating point, got {s.dtype}")
            if s.device != device:
                raise InputError(f"table {spec.name!r} is on {s.device} but the batch is on {device}: "
                                 "move one of them (batch.to(device))")
        return False

    def pooled_from_groups(self, groups: Sequence[torch.Tensor]) -> PooledEmbeddings:
        """The output of this lookup from blocks pooled elsewhere: one ``[B, F_g, D_g]`` per dim group of
        ``self.plan`` (its pooled features in plan order).  A frozen export (hugeembed.serving) pools
        the rows itself and hands them to the model's dense part through this."""
        if len(groups) != len(self.plan.groups):
            raise InputError(f"pooled_from_groups: the plan has {len(self.plan.groups)} dim groups, got "
                             f"{len(groups)} blocks")
        return PooledEmbeddings(self.plan.pooled_names(), list(groups), self._where)

    def forward_static(self, storages: Sequence[torch.Tensor], sf) -> PooledEmbeddings | None:
        """Forward-only lookup of static tables in one native pass over the batch (inference,
        evaluation): no dedup, no intermediate arrays, the same numbers as prepare + lookup.

        None when this path does not apply (a dynamic table, a sequence feature, weights that
        need grad, no native kernels or tables they cannot read); the caller then takes
        prepare + lookup.  A bad batch raises here, as prepare would (with its details).
        """
        plan = self.plan
        if any(t.num_rows is None for t in plan.tables) or any(g.unpooled for g in plan.groups):
            return None
        plan.check_batch(sf, ends=False)
        self._check_storages(storages, sf.device)
        if self.triton_pools(sf.device):
            return self._forward_static_triton(storages, sf)
        if not self._native_checked(sf, storages, ends=True):
            return None
        groups, arrays = [], batch_arrays(sf)  # the batch's arrays once, not per dim group
        for group in plan.groups:
            out = pool_direct(plan, sf, storages, group, arrays)
            if out is None:  # a bag holds bad offsets, an id or a weight: prepare raises with the details
                self.prepare(sf, storages, deduplicate=False)
                return None
            groups.append(out)
        return PooledEmbeddings(plan.pooled_names(), groups, self._where, {})

    def _forward_static_triton(self, storages, sf) -> PooledEmbeddings | None:
        """forward_static on the triton kernel (pooled features, no weights that need grad)."""
        if weights_need_grad(sf.weights_or_none()):
            return None  # the direct kernel gives the weights no gradient: prepare + lookup does
        self.plan.check_unread_bags(sf)
        got = forward_direct_triton(self.plan, sf, storages)
        if got is None:
            return None
        outs, bad = got
        if bad:  # prepare raises the error with its details
            self.prepare(sf, storages, deduplicate=False)
            return None
        dtypes = self.output_dtypes(storages)
        return PooledEmbeddings(self.plan.pooled_names(), [o.to(dt) for o, dt in zip(outs, dtypes)], self._where, {})

    def output_dtypes(self, storages: Sequence[torch.Tensor], runs_hold: bool = False) -> list[torch.dtype]:
        """Per dim group, the dtype of its outputs: its tables' row dtypes promoted.  `runs_hold`: each storage
        run's tables read one tensor (_check_storages said so): one read per run, not per table."""
        out = []
        for ts in (self._group_run_firsts if runs_hold and self._group_run_firsts is not None else
                   self._group_tables):
            read = list(map(storages.__getitem__, ts))  # (the distinct tensors below: no Python per table)
            dts = {s.dtype for s in dict(zip(map(id, read), read)).values()}
            dt = dts.pop() if dts else torch.float32
            for other in dts:  # (promote_types is an op: only where the tables' dtypes differ)
                dt = torch.promote_types(dt, other)
            out.append(dt)
        return out

    def static_slots(self, prep: Prepared) -> torch.Tensor:
        """Slots of static tables: the ids themselves (already range-checked by prepare)."""
        return prep.unique_keys

    def lookup(self, prep: Prepared, storages: Sequence[torch.Tensor], slots: torch.Tensor, *,
               params: Sequence[torch.Tensor] = (), row_grad_hook: RowGradHook | None = None,
               runs: list | None = None) -> PooledEmbeddings:
        """Pools the prepared batch from the row storages, with autograd.

        Args:
            prep: from :meth:`prepare`.
            storages: per table, ``[R_t, W_t]`` rows (weight in the first D_t columns).
            slots: int64 ``[prep.capacity]``: row slot of each unique key (-1: reads zeros).
            params: tensors autograd should track (the static weights for sparse
                gradients, or any one tensor that requires grad when a hook is given).
            row_grad_hook: if given, called in backward per table with
                ``(table_index, slots, grad_rows)`` and no gradient is returned for params;
                otherwise ``params[t]`` receives a sparse COO gradient ``[R_t, D_t]``.
            runs: with a hook, no autograd graph: the lookup's state is appended here and its
                ``backward(grads, False)`` later runs the hook (a custom op's backward, nn/_ops.py).
        """
        runs_hold = self._check_storages(storages, prep.offsets.device)
        if row_grad_hook is None and params:
            if len(params) != self.plan.num_tables:
                raise ConfigError("without a row_grad_hook, params must be the table weights, one per table")
            for spec, p in zip(self.plan.tables, params):
                if p.dim() != 2 or p.size(1) != spec.dim:
                    raise ConfigError(f"table {spec.name!r}: sparse gradients need a [rows, {spec.dim}] weight")
        if not prep.deduplicated and (row_grad_hook is not None or any(p.requires_grad for p in params)):
            raise ConfigError("this batch was prepared with deduplicate=False (forward only): its rows repeat, so "
                              "no gradient or optimizer may be applied to it; prepare it with deduplicate=True")
        weights_grad = weights_need_grad(prep.weights)
        if prep.weights_require_grad and torch.is_grad_enabled() and not weights_grad:
            # prepared under no_grad: its weights lost their graph, their gradient would be lost silently
            raise InputError("the batch's per-id weights require grad but it was prepared with grad disabled, so "
                             "their gradient cannot be computed: call prepare() with grad enabled")
        # static tables read through static_slots(): the slots are the ids prepare range-checked,
        # so none is -1 (the backward's check would be a pass over every slot for nothing)
        unsure = self._unsure_by_ids if slots is prep.unique_keys else self._unsure
        run = LookupRun(self, prep, list(storages), slots, list(params), row_grad_hook, unsure, runs_hold)
        run.weights_grad = weights_grad  # (known here: a Function's forward runs with grad disabled)
        if runs is not None and row_grad_hook is not None and not weights_grad:
            runs.append(run)
            return run.wrap(run.forward())
        outs = LookupFunction.apply(run, prep.weights if weights_grad else None, *params)
        return run.wrap(outs)

    def __call__(self, weights: Sequence[torch.Tensor] | Mapping[str, torch.Tensor], sf, *,
                 row_grad_hook: RowGradHook | None = None) -> PooledEmbeddings:
        """Lookup over static tables given as plain weight tensors ``[num_rows, D]``."""
        if isinstance(weights, Mapping):
            missing = [t.name for t in self.plan.tables if t.name not in weights]
            if missing:
                raise ConfigError(f"no weight given for tables {missing}")
            weights = [weights[t.name] for t in self.plan.tables]
        elif not isinstance(weights, (list, tuple)):
            raise ConfigError(f"tables {[t.name for t in self.plan.tables]}: weights must be a list (or a dict by "
                              f"table name) of [num_rows, D] tensors, got {type(weights).__name__}")
        weights = list(weights)
        if not all(isinstance(w, torch.Tensor) for w in weights):  # .requires_grad is read below
            got = [type(w).__name__ for w in weights]
            raise ConfigError(f"tables {[t.name for t in self.plan.tables]}: weights must be tensors, got {got}")
        for spec in self.plan.tables:
            if spec.num_rows is None:
                raise ConfigError(f"table {spec.name!r} is dynamic: look it up through an EmbeddingCollection")
        # no gradient will be taken: skip the dedup, which only serves the backward
        needs_grad = row_grad_hook is not None or (torch.is_grad_enabled() and any(w.requires_grad for w in weights))
        if not needs_grad:
            out = self.forward_static(weights, sf)
            if out is not None:
                return out
        prep = self.prepare(sf, weights, deduplicate=needs_grad)
        return self.lookup(prep, weights, self.static_slots(prep), params=weights, row_grad_hook=row_grad_hook)


_UNSET = object()


def _rows_fit(s, dim: int, rows: int, device: torch.device) -> bool:
    """Whether `s` passes _check_storages for tables of `dim` needing `rows` rows (-1: any)."""
    if not isinstance(s, torch.Tensor):
        return False
    shape = s.shape
    return len(shape) == 2 and shape[1] >= dim and shape[0] >= rows and s.dtype.is_floating_point and \
        s.device == device
