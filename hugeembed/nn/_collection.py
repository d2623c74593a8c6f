"""EmbeddingCollection: many embedding tables behind one fused lookup, trained in backward.

Its tables live in table groups decided when it is built (nn/_placement.py): one rows tensor and
one key index per group.  One training step (docs/architecture.md)::

    batch ── prepare (clean + dedup per table)          ──► unique ids per table
          ── fetch   (one call per group: rows created, counted, admitted) ──► row slots
          ── pool    (one reduction per dim)             ──► PooledEmbeddings
    loss.backward() ── per group and rule: unique rows + summed gradient ──► the rule applied
                       in place to weight and state inside the group (no dense gradient)
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import nn

from .._device import canonical_device
from ..errors import ConfigError, InputError
from ..features import SparseFeatures
from ..functional import FeatureSpec, FusedEmbeddingLookup, PooledEmbeddings, TableSpec
from ..optim import SparseOptimizer
from ..store import TieredGroup, TieredStore, group_tables
from . import _ops
from ._config import TableConfig
from ._edges import TableEdges
from ._fetch import FetchStage, SpanRules
from ._inflight import InFlight
from ._optimizer import EmbeddingOptimizer
from ._placement import Placement, table_settings
from ._rare import check_count_scalable
from ._updates import RowUpdates, apply_unit, make_units

__all__ = ["EmbeddingCollection"]


def output_names(tables: Sequence[TableConfig]) -> list[tuple[str, str, str]]:
    """(output name, input feature, table) per lookup output, in table then feature order."""
    readers: dict[str, int] = {}
    for t in tables:
        for f in t.features:
            readers[f] = readers.get(f, 0) + 1
    return [(f if readers[f] == 1 else f"{f}@{t.name}", f, t.name) for t in tables for f in t.features]


class EmbeddingCollection(FetchStage, TableEdges, nn.Module):
    """Embedding tables (static or dynamic) looked up together and trained in backward.

    Args:
        tables: one :class:`TableConfig` per table.
        optimizer: the sparse optimizer of tables whose config names none.
        device: where rows live (``"cpu"``, ``"cuda"``, or ``"meta"`` for shape checks).
        seed: base seed of the initializers (rows are deterministic per id).
        backend: ``"auto" | "native" | "torch" | "triton"`` for the lookup and the hash tables
            (``"triton"``: the lookup's triton pool, see FusedEmbeddingLookup; the hash tables then pick
            their own backend, as with ``"auto"``).

    In training mode (``module.train()`` with grad enabled) a lookup inserts unseen ids into
    dynamic tables, counts hits, and ``loss.backward()`` applies each table's optimizer to the
    rows the batch touched.  In eval mode unknown ids read as zeros and nothing is inserted,
    counted or updated.

    Several forwards may precede their backwards (gradient accumulation, pipelined training):
    the rows of every batch whose backward has not run are pinned, so eviction (capacity, ttl,
    norm) never hands their slots to other ids.  A forward refused by validation (a bad id,
    offsets, dtype) changes nothing; any forward that raises takes no step.  A training-mode
    output kept without ever running its backward keeps its rows pinned until it is dropped:
    detach predictions collected for metrics, or compute them under ``torch.no_grad()``.

    Example::

        ec = EmbeddingCollection(
            [TableConfig("user", dim=16, combiner="sum"),                 # dynamic: any int64 id
             TableConfig("country", dim=16, num_rows=250, features=("country",))],
            optimizer=Adagrad(lr=0.05))
        out = ec(batch)                  # PooledEmbeddings
        out["user"]                      # [B, 16]
        out.stacked()                    # [B, 2, 16], no copy
        loss(out).backward()             # Adagrad applied to the touched rows

    ``ec.optimizer`` is a ``torch.optim.Optimizer`` (one param group per trainable table), so
    learning-rate schedulers drive the learning rates used in backward.
    """

    def __init__(self, tables: Sequence[TableConfig], *, optimizer: SparseOptimizer | None = None,
                 device: torch.device | str = "cpu", seed: int = 0, backend: str = "auto",
                 storage_owner: str | None = None) -> None:
        super().__init__()
        tables = list(tables)
        if not tables:
            raise ConfigError("EmbeddingCollection needs at least one table")
        for t in tables:
            if not isinstance(t, TableConfig):
                raise ConfigError(f"tables must be TableConfig, got {type(t).__name__}")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate table names {sorted({n for n in names if names.count(n) > 1})}")
        if optimizer is not None and not isinstance(optimizer, SparseOptimizer):
            raise ConfigError(f"optimizer must be a hugeembed.optim rule, got {type(optimizer).__name__}")
        if backend not in FusedEmbeddingLookup.BACKENDS:
            raise ConfigError(f"backend must be one of {FusedEmbeddingLookup.BACKENDS}, got {backend!r}")
        self.tables: tuple[TableConfig, ...] = tuple(tables)
        self.seed, self.backend, self.device = int(seed), backend, canonical_device(device)
        # names the run in a tiered table's directory: a crashed run's leftovers are reused by it only
        self.storage_owner = storage_owner
        self.rules: list[SparseOptimizer | None] = []
        for t in tables:
            rule = t.optimizer if t.optimizer is not None else (optimizer if t.trainable else None)
            if t.trainable and rule is None:
                raise ConfigError(f"table {t.name!r} is trainable but has no optimizer: give one in its "
                                  f"TableConfig or EmbeddingCollection(optimizer=...), or set trainable=False")
            if rule is not None and t.lr_count_scale is not None:
                check_count_scalable(rule, t.name)
            self.rules.append(rule)
        # tables whose rule moves rows a batch did not touch (global Adam): their rows lag until caught up
        self._moving = [t for t, r in enumerate(self.rules) if r is not None and r.moves_untouched_rows]
        self.outputs = output_names(tables)
        self._build_groups()
        # the lookup sees the tables in group order (a group's tables consecutive); outputs as given
        order = self.placement.order
        feats = [FeatureSpec(out, table, source=feature, combiner=tables[names.index(table)].combiner,
                             default_id=tables[names.index(table)].default_id,
                             out_of_range=tables[names.index(table)].out_of_range,
                             prune_negative=tables[names.index(table)].prune_negative)
                 for out, feature, table in self.outputs]
        specs = [TableSpec(tables[t].name, tables[t].dim, num_rows=tables[t].num_rows, max_norm=tables[t].max_norm)
                 for t in order]
        row_groups = self.placement.row_groups()
        complete = [self._every_id_has_a_row(tables[t]) for t in order]
        self.lookup = FusedEmbeddingLookup(specs, feats, backend=backend, row_groups=row_groups, complete=complete)
        # pools from rows other than a static table's num_rows: caught-up copies (global Adam's
        # eval) or a tiered table's memory cache
        self._tiered = any(g.kind == "tiered" for g in self.groups)
        self._slots_lookup = FusedEmbeddingLookup(
            [TableSpec(s.name, s.dim, max_norm=s.max_norm) for s in specs], feats, backend=backend,
            row_groups=row_groups, complete=complete) if self._moving or self._tiered else None
        self.lookup.ready(self.device)
        # Autograd needs one tensor that requires grad to route backward into the lookup; it is
        # not a Parameter, so dense optimizers and DDP never see it.
        self._anchor = torch.zeros(0, requires_grad=True, device=self.device)
        self._step = 0
        self._tables_version = 0  # see tables_version
        self._write_stamp = self._stamp()
        self._inflight: weakref.WeakSet[InFlight] = weakref.WeakSet()  # training forwards not yet applied
        self._tables_in_state_dict = True
        self.optimizer = EmbeddingOptimizer(self)
        self._handle = _ops.register(self)  # names this collection in the custom ops (torch.compile)

    # -- construction (the sharded collection overrides the table hooks) -----------------

    def _table_settings(self, t: int):
        """Table `t`'s settings in its group, or None when this collection holds none of its rows."""
        return table_settings(self.tables[t], self.rules[t], self.seed)

    def _build_groups(self) -> None:
        """The table groups, decided once (store/_grouping.py): tiered tables alone, the others by
        kind and row layout; each table's edge view (a RowStore) in ``_stores``."""
        settings = [self._table_settings(t) for t in range(len(self.tables))]
        self._settings = settings
        plain = [t for t, s in enumerate(settings) if s is not None and not
                 (self.tables[t].tiered and self.device.type != "meta")]
        groups, placed = group_tables([settings[t] for t in plain], self.device, self._index_backend())
        where: list = [None] * len(settings)
        for t, w in zip(plain, placed):
            where[t] = w
        for t, s in enumerate(settings):
            if s is not None and where[t] is None:  # a tiered table: a group of its own
                where[t] = (len(groups), 0)
                groups.append(TieredGroup(self._make_tiered(t, s)))
        self.groups = groups
        self.placement = Placement(where)
        self._units = make_units(self.placement.spans, self.tables, self.rules, settings)
        self._unit_list = list({id(u): u for u in self._units.values()}.values())
        self._span_rules = {span.group: SpanRules.of(span, self.tables) for span in self.placement.spans}
        self._refresh_views()

    def _index_backend(self) -> str | None:
        """The hash tables' backend (store/_dynamic.py::pick_backend): None picks their own."""
        return None if self.backend in ("auto", "triton") else self.backend

    def _make_tiered(self, t: int, settings) -> TieredStore:
        cfg = self.tables[t]
        if self.device.type != "cpu":
            raise ConfigError(f"table {cfg.name!r}: a disk-tiered table (storage_dir) lives on the CPU, "
                              f"the collection is on {self.device}")
        index_group = group_tables([settings], self.device, self._index_backend())[0][0]
        index = type(index_group)([settings], device=self.device, rows=False,
                                  **({} if settings.static else {"backend": index_group.backend}))
        return TieredStore(index.view(0), initializer=settings.initializer, init_state=settings.init_state,
                           seed=settings.seed, memory_budget=cfg.memory_budget, storage_dir=self._tier_dir(cfg),
                           cache_policy=cfg.cache_policy, owner=self.storage_owner)

    def _tier_dir(self, cfg: TableConfig) -> str:
        """The directory table `cfg`'s tier lives in (a subdirectory per table is made in it)."""
        return cfg.storage_dir

    def _absent_store(self, t: int):
        raise ConfigError(f"table {self.tables[t].name!r} has no rows in this collection (internal error)")

    def _refresh_views(self) -> None:
        """Each table's RowStore view, after the groups were built, loaded or moved."""
        w = self.placement.where
        self._stores = [self.groups[w[t][0]].view(w[t][1]) if w[t] is not None else self._absent_store(t)
                        for t in range(len(self.tables))]
        self._pos_group = [self.placement.where[t][0] if self.placement.where[t] is not None else None
                           for t in self.placement.order]
        self._static_weights = None

    # -- accessors ----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Training steps taken (training-mode forwards)."""
        return self._step

    def group_index(self, t: int) -> int:
        """The group holding table `t`'s rows."""
        return self.placement.group_of(t)

    def rows_of(self, t: int) -> torch.Tensor:
        """The rows table `t`'s slots (from :meth:`fetch_slots`) index: its group's lookup rows."""
        return self.groups[self.group_index(t)].lookup_rows()

    def _storages(self) -> list[torch.Tensor]:
        """What the lookup reads, per lookup position: its group's rows (one tensor per group)."""
        rows = [g.lookup_rows() for g in self.groups]
        if None not in self._pos_group:  # every table held here: one C-level pass
            return list(map(rows.__getitem__, self._pos_group))
        return [rows[g] if g is not None else self._dummy(p) for p, g in enumerate(self._pos_group)]

    def _dummy(self, p: int) -> torch.Tensor:
        cfg = self.tables[self.placement.order[p]]
        return torch.empty(0, cfg.dim, dtype=cfg.dtype, device=self.device)

    def group_dtypes(self) -> list[torch.dtype]:
        """The dtype of each dim group's pooled output (its tables' dtypes promoted)."""
        return self.lookup.output_dtypes(self._storages())

    # -- forward ----------------------------------------------------------------------------

    def forward(self, features: SparseFeatures) -> PooledEmbeddings:
        if not isinstance(features, SparseFeatures):
            raise InputError(f"EmbeddingCollection takes a SparseFeatures batch, got {type(features).__name__}")
        if self.device.type == "meta":
            return self._meta_forward(features)
        if features.device != self.device:
            raise InputError(f"batch {list(features.keys())} is on {features.device} but the tables are on "
                             f"{self.device}: move it with batch.to(device) (pin_memory + non_blocking on GPU)")
        training = self.training and torch.is_grad_enabled()
        if torch.compiler.is_compiling():  # one custom op in the graph (nn/_ops.py), the same lookup inside
            w = features.weights_or_none()
            if w is not None and w.requires_grad and torch.is_grad_enabled():  # (the op gives them no gradient)
                raise NotImplementedError(f"features {list(features.keys())}: per-id weights that require grad "
                                          "inside torch.compile are not supported yet; run the collection eagerly")
            return self.lookup.pooled_from_groups(_ops.lookup_op(self, self._handle, features, training))
        return self._op_forward(features, training)

    def _op_forward(self, features: SparseFeatures, training: bool, runs: list | None = None) -> PooledEmbeddings:
        """The eager forward (also what the custom op runs, with `runs`: the lookup's state for the
        backward op goes there instead of into an autograd graph)."""
        step = self._step + 1 if training else self._step
        out = self._lookup_batch(features, training, step, runs)
        if training:  # only once the lookup succeeded: a failed forward takes no step
            self._step = step
        return out

    def _lookup_batch(self, features: SparseFeatures, training: bool, step: int,
                      runs: list | None = None) -> PooledEmbeddings:
        """prepare -> fetch per group -> pool (the sharded collection overrides this)."""
        static_only = all(g.kind == "static" for g in self.groups)
        if not training and static_only and not self._moving:  # forward only: one pass over the batch
            out = self.lookup.forward_static(self._static_table_weights(), features)
            if out is not None:
                return out
        # dedup serves the backward (one gradient row per id) and the hash tables (one probe per id)
        prep = self.lookup.prepare(features, self._storages(), deduplicate=training or not static_only)
        if training:
            self._evict_expired(step)
        flight = self._in_flight(step, prep.unique_keys) if training and any(self.rules) else None
        slots = self._fetch(prep, training, step, flight)
        storages = self._storages()  # inserts may have grown the rows
        pool = self._slots_lookup if self._tiered else self.lookup
        if not training and self._moving:
            storages, slots = self._current(prep, storages, slots)
            return self._slots_lookup.lookup(prep, storages, slots)
        if flight is None:
            return pool.lookup(prep, storages, slots)
        return pool.lookup(prep, storages, slots, params=[self._anchor],
                           row_grad_hook=RowUpdates(self, flight, prep, slots), runs=runs)

    def _static_table_weights(self) -> list[torch.Tensor]:
        """Per lookup position, a static table's weights (its rows of its group): made once."""
        if self._static_weights is None:
            self._static_weights = [self._stores[t].weights() for t in self.placement.order]
        return self._static_weights

    @staticmethod
    def _every_id_has_a_row(cfg: TableConfig) -> bool:
        """Whether a training fetch gives every id of table `cfg` a row (no slot -1), from its settings
        alone: static tables (ids range-checked by prepare), and dynamic ones that admit every id at
        once or map the others to their shared row.  Tiered tables and admission filters may not."""
        if cfg.tiered:
            return False
        return cfg.num_rows is not None or cfg.shared_row or (
            cfg.admit_min_count == 1 and (cfg.admit_probability is None or cfg.admit_probability >= 1.0))

    # -- the update stage -------------------------------------------------------------------

    def _lr(self, t: int) -> float:
        """Table `t`'s learning rate now (its param group's: schedulers drive it)."""
        return self.optimizer.param_groups[self.optimizer.group_of_table[t]]["lr"]

    def update_rows(self, t: int, slots: torch.Tensor, grad: torch.Tensor, flight: InFlight,
                    keys: torch.Tensor | None = None, hits: torch.Tensor | None = None,
                    shared_slot: int = -1) -> None:
        """Applies table `t`'s rule to its rows at `slots` (one gradient row each; several ids reading
        the shared row may share a slot: their gradients add up) at `flight`'s step: the update stage
        for callers holding rows per table (the sharded owners).  `keys`: their keys (stochastic
        rounding); `hits`: their hit counts after the fetch (lr_count_scale); `shared_slot`: the
        table's shared row here (it moves at the full lr), -1 if none."""
        g = self.group_index(t)
        flight.check(g, self.groups[g], [self.tables[t].name])
        unit = self._units.get(t)
        if unit is not None and slots.numel():
            span = self.placement.span_of[g]
            local = span.tables.index(t)
            shared = None
            if shared_slot >= 0:
                shared = torch.full((len(span.tables),), -1, dtype=torch.int64, device=slots.device)
                shared[local] = shared_slot
            lr = self._lr(t) if flight.lrs is None else flight.lrs[t]
            apply_unit(unit, self.groups[g], [(t, local, slots, grad, keys, hits)], [lr], flight.step, shared)

    def _in_flight(self, step: int, keys: torch.Tensor | None = None) -> InFlight:
        """A new training forward's InFlight: the rows it reads get pinned in it (see InFlight)."""
        flight = InFlight(step, self.groups, keys)
        self._inflight.add(flight)
        return flight

    def applied_step(self) -> int:
        """The last step every backward before it has applied (rows are current as of it)."""
        pending = [f.step for f in list(self._inflight) if not f.applied]
        return min([self._step, *(s - 1 for s in pending)])

    def settled_step(self) -> int:
        """The newest step S such that a row last seen at step S or before changes only when its id
        is seen again: the step, or one before the oldest training forward whose graph is still
        alive (its backward may still run, or run again through a retained graph).  Snapshot deltas
        hold the rows seen after their parent's settled step."""
        alive = [f.step for f in list(self._inflight)]
        return min([self._step, *(s - 1 for s in alive)])
