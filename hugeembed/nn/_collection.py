"""EmbeddingCollection: many embedding tables behind one fused lookup, trained in backward.

One training step (docs/architecture.md)::

    batch ── prepare (clean + dedup per table, native kernels) ──► unique ids per table
          ── fetch   (store.find_or_insert: rows created, counted, admitted) ──► row slots
          ── pool    (one reduction per dim) ──► PooledEmbeddings
    loss.backward() ── per table: unique rows + summed gradient ──► optimizer rule applied
                       in place to weight and state inside the store (no dense gradient)
"""

from __future__ import annotations

import copy
import weakref
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from .._device import canonical_device
from ..errors import ConfigError, InputError
from ..features import SparseFeatures
from ..functional import FeatureSpec, FusedEmbeddingLookup, PooledEmbeddings, TableSpec, joined, repeat_each
from ..optim import SparseOptimizer
from ..store import (EXPORT_FIELDS, ArrayStore, HashStore, RowBlock, RowLayout, RowStore, StoreExport, TieredStore,
                     find_many, find_or_insert_many)
from ..store._hash_group import DynamicRows
from ..store._layout import LayoutViews
from . import _ops
from ._config import TableConfig
from ._inflight import InFlight
from ._optimizer import EmbeddingOptimizer
from ._rare import SHARED_ROW_KEY, check_count_scalable, coalesce, count_lr_scale, update_scaled

__all__ = ["EmbeddingCollection"]



class _RowUpdates:
    """A training lookup's row_grad_hook: applies each table's rule to the rows its batch read.

    ``many`` (the whole backward at once) first checks every table's rows are still where the
    forward read them, then updates the tables that share a RowBlock, a rule and an lr in one
    rule call on the block, the others one by one.
    """

    def __init__(self, collection: "EmbeddingCollection", flight: InFlight) -> None:
        self.collection, self.flight = collection, flight

    def __call__(self, t: int, slots: torch.Tensor, grad: torch.Tensor) -> None:
        self.collection.update_rows(t, slots, grad, self.flight)
        self.flight.release(t)

    def many(self, items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        c, flight = self.collection, self.flight
        for t, _, _ in items:  # before any update: a failure changes no table
            flight.check(t, c._stores[t], c.tables[t].name)
        shared: dict[tuple, list] = {}
        alone = []
        for item in items:
            key = c._block_update_key(item[0])
            (alone if key is None else shared.setdefault(key, [])).append(item)
        blocks = [group for group in shared.values() if len(group) > 1]
        alone += [item for group in shared.values() if len(group) == 1 for item in group]
        done: list[int] = []
        try:
            for group in blocks:
                c._update_block(group, flight.step)
                done += [t for t, _, _ in group]
            for t, slots, grad in alone:
                c.update_rows(t, slots, grad, flight)
                done.append(t)
        finally:  # the rows of the tables updated may go (an update that raised keeps its pins)
            for t in done:
                flight.release(t)


def output_names(tables: Sequence[TableConfig]) -> list[tuple[str, str, str]]:
    """(output name, input feature, table) per lookup output, in table then feature order."""
    readers: dict[str, int] = {}
    for t in tables:
        for f in t.features:
            readers[f] = readers.get(f, 0) + 1
    return [(f if readers[f] == 1 else f"{f}@{t.name}", f, t.name) for t in tables for f in t.features]


class EmbeddingCollection(nn.Module):
    """Embedding tables (static or dynamic) looked up together and trained in backward.

    Args:
        tables: one :class:`TableConfig` per table.
        optimizer: the sparse optimizer of tables whose config names none.
        device: where rows live (``"cpu"``, ``"cuda"``, or ``"meta"`` for shape checks).
        seed: base seed of the initializers (rows are deterministic per id).
        backend: ``"auto" | "native" | "torch"`` for the lookup and the hash tables.

    In training mode (``module.train()`` with grad enabled) a lookup inserts unseen ids
    into dynamic tables, counts hits, and ``loss.backward()`` applies each table's
    optimizer to the rows the batch touched.  In eval mode unknown ids read as zeros
    and nothing is inserted, counted or updated.

    Several forwards may precede their backwards (gradient accumulation, pipelined
    training): the rows of every batch whose backward has not run are pinned, so
    eviction (capacity, ttl, norm) never hands their slots to other ids.  A forward
    refused by validation (a bad id, offsets, dtype) changes nothing; any forward that raises
    takes no step (a CapacityError in one table leaves the rows that earlier tables of the
    same batch inserted: valid rows, not pinned).  A training-mode output kept without ever
    running its backward keeps its rows pinned until it is dropped: detach predictions
    collected for metrics, or compute them under ``torch.no_grad()``.

    Example::

        ec = EmbeddingCollection(
            [TableConfig("user", dim=16, combiner="sum"),                 # dynamic: any int64 id
             TableConfig("country", dim=16, num_rows=250, features=("country",))],
            optimizer=Adagrad(lr=0.05))
        out = ec(batch)                  # PooledEmbeddings
        out["user"]                      # [B, 16]
        out.stacked()                    # [B, 2, 16], no copy
        loss(out).backward()             # Adagrad applied to the touched rows

    ``ec.optimizer`` is a ``torch.optim.Optimizer`` (one param group per trainable table),
    so learning-rate schedulers drive the learning rates used in backward.
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
        self.tables: tuple[TableConfig, ...] = tuple(tables)
        self.seed = int(seed)
        self.backend = backend
        # names the run in a tiered table's directory: a crashed run's leftovers are reused by it only
        self.storage_owner = storage_owner
        self.device = canonical_device(device)
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
        specs = [TableSpec(t.name, t.dim, num_rows=t.num_rows, max_norm=t.max_norm) for t in tables]
        feats = []
        for out_name, feature, table in self.outputs:
            t = tables[names.index(table)]
            feats.append(FeatureSpec(out_name, table, source=feature, combiner=t.combiner, default_id=t.default_id,
                                     out_of_range=t.out_of_range, prune_negative=t.prune_negative))
        self.lookup = FusedEmbeddingLookup(specs, feats, backend=backend)
        # Pools a batch prepared by self.lookup from rows at given slots, fewer than a static
        # table's num_rows: caught-up copies (global Adam's eval, see current_rows) or the
        # memory cache of a tiered table.
        self._tiered = any(t.tiered for t in tables)
        self._slots_lookup = FusedEmbeddingLookup(
            [TableSpec(t.name, t.dim, max_norm=t.max_norm) for t in tables], feats, backend=backend) \
            if self._moving or self._tiered else None
        blocks = self._static_blocks(tables, self.rules)
        self._stores: list[RowStore] = [self._make_store(t, r, blocks.get(i))
                                        for i, (t, r) in enumerate(zip(tables, self.rules))]
        self._shared = [t.shared_row for t in tables]  # tables whose rare / unknown ids read one shared row
        # Autograd needs one tensor that requires grad to route backward into the
        # lookup; it is not a Parameter, so dense optimizers and DDP never see it.
        self._anchor = torch.zeros(0, requires_grad=True, device=self.device)
        self._step = 0
        self._tables_version = 0  # see tables_version
        self._write_stamp = max(getattr(s, "write_stamp", 0) for s in self._stores)
        self._inflight: weakref.WeakSet[InFlight] = weakref.WeakSet()  # training forwards not yet applied
        self._tables_in_state_dict = True
        self.optimizer = EmbeddingOptimizer(self)
        self._handle = _ops.register(self)  # names this collection in the custom ops (torch.compile)

    # -- construction -----------------------------------------------------------------

    # static tables of one row width and dtype keep their rows in one RowBlock (off in the
    # sharded collection, whose stores are shards)
    _share_static_storage = True
    # dynamic tables on the torch backend likewise keep their rows in one DynamicRows block
    # (off in the sharded collection, like the above)
    _share_dynamic_storage = True

    def _static_blocks(self, tables: Sequence[TableConfig],
                       rules: Sequence[SparseOptimizer | None]) -> dict[int, tuple[RowBlock, int]]:
        """Table index -> (block, first row) for static tables that share a RowBlock: those of one
        row width and storage dtype, at least two of them (not tiered: their rows are in a tier)."""
        if not self._share_static_storage or self.device.type == "meta":
            return {}
        kinds: dict[tuple, list[int]] = {}
        for i, (t, rule) in enumerate(zip(tables, rules)):
            if t.num_rows is not None and not t.tiered:
                lay = t.row_layout(rule)
                kinds.setdefault((lay.width, lay.storage_dtype), []).append(i)
        out = {}
        for (width, dtype), members in kinds.items():
            if len(members) > 1:
                places = RowBlock.for_tables([tables[i].num_rows for i in members], width, dtype, self.device)
                out.update(zip(members, places))
        return out

    def _make_store(self, t: TableConfig, rule: SparseOptimizer | None,
                    block: tuple[RowBlock, int] | None = None) -> RowStore:
        """Table `t`'s store: its key index with the rows, or, for a disk-tiered table, the index
        without rows under a TieredStore holding them (the sharded collection overrides
        ``_make_index`` and ``_tier_dir``).  `block`: where a static table keeps its rows."""
        if self.device.type == "meta":
            return _MetaStore(t.name, t.row_layout(rule))
        if t.tiered and self.device.type != "cpu":
            raise ConfigError(f"table {t.name!r}: a disk-tiered table (storage_dir) lives on the CPU, "
                              f"the collection is on {self.device}")
        # a tiered table's rows live in its tier
        index = self._make_index(t, rule, rows=not t.tiered, **({} if block is None else {"block": block}))
        if not t.tiered:
            return index
        return TieredStore(index, initializer=index.initializer, init_state=None if rule is None else rule.init_state,
                           seed=index.seed, memory_budget=t.memory_budget, storage_dir=self._tier_dir(t),
                           cache_policy=t.cache_policy, owner=self.storage_owner)

    def _store_options(self, t: TableConfig, rule: SparseOptimizer | None, rows: bool) -> dict:
        """The keyword arguments every store kind takes for table `t`."""
        return dict(initializer=t.initializer, init_state=None if rule is None else rule.init_state, dtype=t.dtype,
                    layout=t.row_layout(rule), device=self.device, seed=t.resolved_seed(self.seed), rows=rows)

    def _make_index(self, t: TableConfig, rule: SparseOptimizer | None, rows: bool,
                    block: tuple[RowBlock, int] | None = None) -> RowStore:
        """Table `t`'s key index (with its rows unless `rows` is False)."""
        common = self._store_options(t, rule, rows)
        state = common["layout"].state_width
        if t.num_rows is not None:
            return ArrayStore(t.name, t.num_rows, t.dim, state, block=block, **common)
        backend = None if self.backend == "auto" else self.backend
        return HashStore(t.name, t.dim, state, capacity=t.capacity, on_full=t.on_full,
                         eviction_policy=t.eviction_policy, admit_min_count=t.admit_min_count, backend=backend,
                         admit_probability=t.admit_probability, max_pending=t.max_pending, **common)

    def _tier_dir(self, t: TableConfig) -> str:
        """The directory table `t`'s tier lives in (a subdirectory per table is made in it)."""
        return t.storage_dir

    # -- accessors ----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Training steps taken (training-mode forwards)."""
        return self._step

    @property
    def tables_version(self) -> int:
        """Times the rows (or the step) were replaced or changed other than by a training step:
        ``load_state_dict`` of tables or of the step, ``catch_up_rows``.

        A snapshot delta holds the rows whose ids were seen since its parent: it may only
        follow a parent taken at the same version (``hugeembed.checkpoint`` checks it).
        Writes straight into a store (``store.import_`` / ``scatter`` / ``remove``) count too
        (each leaves a new ``write_stamp`` on the store); writes through a raw view
        (``store.storage()[...] = ...``) cannot be seen: write a full snapshot after them.
        """
        stamp = max(getattr(s, "write_stamp", 0) for s in self._stores)
        if stamp != self._write_stamp:  # stamps never repeat: any direct write since moves it
            self._write_stamp = stamp
            self._tables_version += 1
        return self._tables_version

    def store(self, table: str) -> RowStore:
        return self._stores[self._table_index(table)]

    def stores(self) -> Iterator[tuple[TableConfig, RowStore]]:
        return zip(self.tables, self._stores)

    def store_at(self, t: int) -> RowStore:
        """The store of table `t` (its index in ``tables``: lookup routes address tables by index)."""
        return self._stores[t]

    def _table_index(self, table: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == table:
                return i
        raise KeyError(f"no table {table!r}; tables: {[t.name for t in self.tables]}")

    def output_keys(self) -> list[str]:
        """Names of the outputs, pooled and unpooled, in order."""
        return [o for o, _, _ in self.outputs]

    def feature_names(self) -> list[str]:
        """Input features the collection reads."""
        seen: dict[str, None] = {}
        for _, f, _ in self.outputs:
            seen[f] = None
        return list(seen)

    def num_rows(self) -> dict[str, int]:
        return {t.name: len(s) for t, s in self.stores()}

    def memory_bytes(self) -> dict[str, int]:
        return {t.name: s.memory_bytes() for t, s in self.stores()}

    def extra_repr(self) -> str:
        parts = []
        for t, rule in zip(self.tables, self.rules):
            kind = f"{t.num_rows} rows" if t.num_rows is not None else "dynamic"
            opt = rule.name if rule is not None else "frozen"
            parts.append(f"{t.name}: dim {t.dim}, {kind}, {t.combiner.value}, {opt}")
        return "\n".join(parts)

    # -- forward / backward ---------------------------------------------------------

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
            return self.lookup.pooled_from_groups(_ops.lookup_op(self, self._op_handle(), features, training))
        step = self._step + 1 if training else self._step
        out = self._lookup_batch(features, training, step)
        if training:  # only once the lookup succeeded: a failed forward takes no step
            self._step = step
        return out

    def _op_handle(self) -> int:
        return self._handle

    def _op_forward(self, features: SparseFeatures, training: bool, runs: list) -> PooledEmbeddings:
        """The eager forward as the custom op runs it: the lookup's state for the backward op is
        appended to `runs` (no autograd graph: the op's registered backward applies it).  forward
        checked the batch's device while tracing."""
        step = self._step + 1 if training else self._step
        out = self._lookup_batch(features, training, step, runs=runs)
        if training:
            self._step = step
        return out

    def group_dtypes(self) -> list[torch.dtype]:
        """The dtype of each dim group's pooled output (its tables' dtypes promoted)."""
        return self.lookup.output_dtypes([s.lookup_rows() for s in self._stores])

    def _lookup_batch(self, features: SparseFeatures, training: bool, step: int,
                      runs: list | None = None) -> PooledEmbeddings:
        """The lookup of one checked batch at `step` (the sharded collection overrides this).
        `runs`: the training lookup's state goes there instead of into an autograd graph."""
        storages = [s.lookup_rows() for s in self._stores]
        # Dedup serves the backward (one gradient row per id) and the hash tables (one
        # probe per distinct id); a forward over static tables alone needs neither.
        # (global Adam's rows are read through caught-up copies, which need the slots: no one-pass path)
        dedup = training or any(t.num_rows is None for t in self.tables) or bool(self._moving) or self._tiered
        if not dedup:  # static tables, forward only: one pass over the batch
            out = self.lookup.forward_static([s.weights() for s in self._stores], features)
            if out is not None:
                return out
        prep = self.lookup.prepare(features, storages, deduplicate=dedup)  # checks the batch; changes nothing
        if training:
            self._evict_expired(step)
        slots = self._fetch(prep, training, step)
        self._join_dynamic_rows()
        storages = [s.lookup_rows() for s in self._stores]  # inserts may have grown them
        pool = self._slots_lookup if self._tiered else self.lookup
        if not training and self._moving:
            for t in self._moving:
                b, n = prep.unique_base[t], prep.unique_count[t]
                storages[t], slots[b : b + n] = self.current_rows(t, slots[b : b + n])
            return self._slots_lookup.lookup(prep, storages, slots)
        blocks = self._row_blocks()
        if not training or not any(self.rules):
            return pool.lookup(prep, storages, slots, row_blocks=blocks)
        flight = self._in_flight(step)
        for t, (b, n) in enumerate(zip(prep.unique_base, prep.unique_count)):
            flight.pin(t, slots, b, b + n)
            scale_by = self.tables[t].lr_count_scale
            if scale_by is not None and n:
                # hits so far, this batch included; in the order the hook gets the rows (ids with a row)
                scale = count_lr_scale(self._stores[t].hit_counts(prep.keys_of(t)), scale_by)
                shared = self.shared_slot(t)
                if shared is not None:  # the shared row takes every rare id's gradient at the full lr
                    scale[slots[b : b + n] == shared] = 1.0
                flight.lr_scales[t] = scale[slots[b : b + n] >= 0]
        return pool.lookup(prep, storages, slots, params=[self._anchor], row_grad_hook=self._hook(flight), runs=runs,
                           row_blocks=blocks, slots_known=self._every_id_has_a_row(prep))

    def _every_id_has_a_row(self, prep) -> bool:
        """Whether a training fetch gave every id of `prep` a row (no slot -1), known from the
        tables' settings alone: static tables (ids range-checked by prepare), and dynamic ones
        that admit every id at once or map the others to their shared row.  Tiered tables and
        admission filters may leave ids without a row."""
        for t, cfg in enumerate(self.tables):
            if not prep.unique_count[t]:
                continue
            if cfg.tiered:
                return False
            if cfg.num_rows is None and not cfg.shared_row and (
                    cfg.admit_min_count > 1 or (cfg.admit_probability is not None and cfg.admit_probability < 1.0)):
                return False
        return True

    def _join_dynamic_rows(self) -> None:
        """Dynamic tables on the torch backend (a GPU's) of one row width and dtype keep their rows
        in one DynamicRows block (joined again after a table outgrew its part, a load or a move),
        so their gather and update are one op each, as static tables' in a RowBlock."""
        if not self._share_dynamic_storage:
            return
        kinds: dict[tuple, list] = {}
        for s in self._stores:
            if type(s) is HashStore and s._ops.name == "torch" and s.has_rows and not s.layout.packed and \
                    s._storage.shape[0]:
                kinds.setdefault((s._storage.shape[1], s._storage.dtype, s._storage.device), []).append(s)
        for members in kinds.values():
            if len(members) > 1:
                DynamicRows.join(members)

    def _row_blocks(self) -> list[tuple[torch.Tensor, int] | None] | None:
        """Per table, (its RowBlock's or DynamicRows' storage, first row) while its rows are that
        block's view; None when no table's are (FusedEmbeddingLookup.lookup's row_blocks)."""
        out = []
        for s in self._stores:
            # a packed table's rows are decoded before they are read: not the block's
            b = s.block_rows() if type(s) in (ArrayStore, HashStore) and not s.layout.packed else None
            out.append(None if b is None else (b[0].storage, b[1]))
        return out if any(b is not None for b in out) else None

    def _fetch(self, prep, training: bool, step: int) -> torch.Tensor:
        """Row slots of every unique id of a prepared batch: -1 where a row reads zeros.

        The per-table parts of the batch's arrays are views made by one split each (no op per
        table), and the stores write the slots straight into their part of the result."""
        if training or not any(t.num_rows is not None and not t.tiered for t in self.tables):
            slots = torch.empty(prep.capacity, dtype=torch.int64, device=prep.unique_keys.device)
        else:  # static tables' slots are their ids (range checked by prepare); the rest are overwritten
            slots = prep.unique_keys.clone()
        ts = [t for t, cfg in enumerate(self.tables) if prep.unique_count[t] and
              (training or cfg.num_rows is None or cfg.tiered)]
        if not ts:
            return slots
        keys, into = prep.per_table(prep.unique_keys), prep.per_table(slots)
        counts = prep.per_table(prep.unique_counts.to(torch.int64)) if training else None
        self.fetch_slots(ts, [keys[t] for t in ts], step, training, None if counts is None else [counts[t] for t in ts],
                         out=[into[t] for t in ts], keys_checked=True)
        return slots

    # -- the fetch and update stages of every route --------------------------------------
    # (this collection's lookup and the owners of each sharded route call these two)

    def fetch_slots(self, ts: Sequence[int], keys: Sequence[torch.Tensor], step: int, training: bool,
                    counts: Sequence[torch.Tensor] | None = None,
                    out: Sequence[torch.Tensor] | None = None, keys_checked: bool = False) -> list[torch.Tensor]:
        """Row slots of the distinct ids ``keys[i]`` of table ``ts[i]``, -1 where a row reads zeros
        (a table with a shared row: ids without a row of their own get the shared row's slot).

        Training: one find_or_insert_many over the tables (the native hash tables run side by
        side; new ids get rows, hits counted by `counts`; a tiered table brings rows into its
        cache).  The caller pins the slots (InFlight) before anything else fetches.  Otherwise
        find: nothing inserted or counted (readers of global Adam tables go through
        :meth:`current_rows`).  `out`: int64 tensors the slots are written into (returned).
        `keys_checked`: the keys come from this collection's prepare (static ids range-checked,
        counts >= 1): the static tables' range check is not repeated (a read of the device)."""
        stores = [self._stores[t] for t in ts]
        keys = list(keys)
        counts = None if counts is None else list(counts)
        outs = [None] * len(ts) if out is None else list(out)
        shared = [i for i, t in enumerate(ts) if self._shared[t]]
        for i in shared:
            # The shared row's key goes into the same store call as the batch's ids (a second call
            # could move a tiered table's cached rows); seen with every batch, admitted at once.
            keys[i] = _with_shared_key(keys[i])
            if counts is not None:
                counts[i] = torch.cat([counts[i], counts[i].new_full((1,), self.tables[ts[i]].admit_min_count)])
        into = [None if i in shared else o for i, o in enumerate(outs)]
        if training:
            for s, k in zip(stores, keys):  # disk writes first: a full disk fails before any table changed
                if hasattr(s, "reserve"):
                    s.reserve(k)
            got = find_or_insert_many(stores, keys, step, counts=counts, out=into, keys_checked=keys_checked)
        else:
            got = find_many(stores, keys)
        for i in shared:  # ids without a row of their own (rare, unknown) read the shared row, if any yet
            g = got[i]
            got[i] = torch.where(g[:-1] < 0, g[-1], g[:-1])
        for i, o in enumerate(outs):
            if o is not None and got[i] is not o:
                o.copy_(got[i])
                got[i] = o
        return got

    def update_rows(self, t: int, slots: torch.Tensor, grad: torch.Tensor, flight: InFlight) -> None:
        """Applies table `t`'s optimizer rule to its rows at `slots` (one gradient row each) at
        `flight`'s step, once `flight` confirms those rows are still where the forward read them."""
        store = self._stores[t]
        flight.check(t, store, self.tables[t].name)
        rule = self.rules[t]
        if rule is None:  # a frozen table
            return
        scale = flight.lr_scales.pop(t, None)
        if self._shared[t]:  # rare ids all read the shared row: one summed gradient for it
            slots, grad, scale = coalesce(slots, grad, scale)
        # the store's own slots of this step (pinned by `flight`, unknown ids dropped): in range
        if scale is None:
            rule.update(store, slots, grad, lr=self._lr(t), step=flight.step, slots_checked=True)
        else:
            update_scaled(rule, store, slots, grad, lr=self._lr(t), step=flight.step, scale=scale)

    def shared_slot(self, t: int) -> int | None:
        """The slot of table `t`'s shared row (TableConfig.shared_row), None if it has none (yet)."""
        if not self._shared[t]:
            return None
        slot = int(self._stores[t].find(_with_shared_key(torch.empty(0, dtype=torch.int64, device=self.device)))[0])
        return slot if slot >= 0 else None

    def _protected(self, t: int) -> torch.Tensor | None:
        """Slots eviction must spare beyond the pinned ones: the shared row (norm or LFU would take it)."""
        slot = self.shared_slot(t)
        return None if slot is None else torch.tensor([slot], dtype=torch.int64, device=self.device)

    # -- rows in flight and rows brought current ------------------------------------------

    def _lr(self, t: int) -> float:
        """Table `t`'s learning rate now (its param group's: schedulers drive it)."""
        return self.optimizer.param_groups[self.optimizer.group_of_table[t]]["lr"]

    def _in_flight(self, step: int) -> InFlight:
        """A new training forward's InFlight: the rows it reads get pinned in it (see InFlight)."""
        flight = InFlight(step, self._stores)
        self._inflight.add(flight)
        return flight

    def _hook(self, flight: InFlight) -> "_RowUpdates":
        return _RowUpdates(self, flight)

    def _block_update_key(self, t: int) -> tuple | None:
        """What table `t`'s update may share with other tables' (one rule call on their RowBlock):
        the block, the rule and the lr; None when it takes its own (``update_rows``)."""
        rule, store = self.rules[t], self._stores[t]
        if rule is None or self.tables[t].lr_count_scale is not None or rule.moves_untouched_rows or \
                type(store) not in (ArrayStore, HashStore):
            return None
        lay, b = store.layout, store.block_rows()
        if b is None or lay.packed or lay.stochastic_rounding:  # update() reads these through the store
            return None
        return id(b[0]), id(rule), self._lr(t)

    def _update_block(self, items: list[tuple[int, torch.Tensor, torch.Tensor]], step: int) -> None:
        """One rule call for tables that share a RowBlock, a rule and an lr (``_block_update_key``):
        each table's slots offset by its first row in the block."""
        t0 = items[0][0]
        block = self._stores[t0].block_rows()[0]
        offset = repeat_each([self._stores[t].block_rows()[1] for t, _, _ in items], [s.numel() for _, s, _ in items],
                             block.storage.device)
        # the tables' slots and gradients are parts of one array each (unless some were filtered)
        slots = joined([s for _, s, _ in items]) + offset
        grad = joined([g for _, _, g in items])
        if any(self._shared[t] for t, _, _ in items):
            # rare ids all read their table's shared row: one summed gradient per row, found for
            # every table at once (the tables' slots are apart in the block)
            slots, grad, _ = coalesce(slots, grad, None)
        # the stores' own slots of this step: in range
        self.rules[t0].apply(block.storage, slots, grad, lr=self._lr(t0), step=step, slots_checked=True)

    def applied_step(self) -> int:
        """The last step every backward before it has applied (rows are current as of it)."""
        pending = [f.step for f in list(self._inflight) if not f.applied]
        return min([self._step, *(s - 1 for s in pending)])

    def settled_step(self) -> int:
        """The newest step S such that a row last seen at step S or before changes only when its
        id is seen again: the step, or one before the oldest training forward whose graph is
        still alive (its backward may still run, or run again through a retained graph).

        Snapshot deltas hold the rows seen after their parent's settled step.  Unlike
        :meth:`applied_step` it also waits for graphs already applied once: safe, at the cost
        of a few more rows in a delta while such a graph is kept.
        """
        alive = [f.step for f in list(self._inflight)]
        return min([self._step, *(s - 1 for s in alive)])

    def current_rows(self, t: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(lookup rows, slots) to read table `t`'s rows at `slots` as they are now, for anything
        but a training step (eval, inference).  Global Adam's rows lag the dense update until
        touched: they are read from a caught-up copy (slots renumbered into it), so reading
        changes no row, and a run's numbers never depend on when it evaluated.  Other rules:
        the store's own rows (``store.lookup_rows()``) and `slots` as given."""
        store = self._stores[t]
        rule, step = self.rules[t], self.applied_step()
        if rule is None or not rule.moves_untouched_rows or step < 1:
            return store.lookup_rows(), slots
        known = slots >= 0
        copy = _RowsCopy(store, slots[known])
        rule.catch_up(copy, torch.arange(copy.rows.shape[0], device=slots.device), step, lr=self._lr(t))
        out = torch.full_like(slots, -1)
        out[known] = torch.arange(copy.rows.shape[0], device=slots.device)
        return copy.lookup_rows(), out

    def catch_up_rows(self) -> None:
        """Brings every row of the tables current in place (global Adam replays the steps each row
        skipped): for an export of the rows.  A no-op for every other optimizer.

        Training never needs it (a row is caught up when next touched), nor do eval and
        snapshots: eval reads a caught-up copy (:meth:`current_rows`), and a snapshot keeps each
        row with its step counter, which is lossless and resumes bit-identically; bringing the
        live rows current at a save would make a run's numbers depend on when it saved.
        """
        step = self.applied_step()
        for t in self._moving:
            store, rule = self._stores[t], self.rules[t]
            if step < 1:
                continue
            if isinstance(store, TieredStore):  # through the cache, a chunk of rows at a time
                store.update_all(lambda slots: rule.catch_up(store, slots, step, lr=self._lr(t)))
            else:
                slots = store.export_index().slots
                if not slots.numel():
                    continue
                rule.catch_up(store, slots, step, lr=self._lr(t))
            self._tables_version += 1  # rows moved without their ids being seen: no delta can follow

    # -- eviction -----------------------------------------------------------------------

    def _evict_expired(self, step: int) -> None:
        for t, (cfg, store) in enumerate(self.stores()):
            if (cfg.ttl is not None or cfg.evict_norm_below is not None) and step % cfg.evict_interval == 0:
                store.evict(step, ttl=cfg.ttl, min_norm=cfg.evict_norm_below, protect=self._protected(t))

    @property
    def has_tiered_tables(self) -> bool:
        """True when some table's rows live on disk (TableConfig.storage_dir)."""
        return self._tiered

    def tier_stats(self) -> dict | None:
        """The disk tier's figures, or None without tiered tables: ``cache_hit_rate`` (id occurrences
        served from memory, all tiered tables), ``table_bytes_resident`` (rows in memory: every
        in-memory table's storage and the tiered tables' caches), ``table_bytes_stored`` (rows in
        the tiers' files) and ``tables`` (per tiered table: resident and stored rows, hit rate, rows
        read / written / prefetched)."""
        if not self._tiered:
            return None
        per, acc, hits, resident, stored = {}, 0, 0, 0, 0
        for cfg, store in self.stores():
            if isinstance(store, TieredStore):
                st = store.cache_stats()
                per[cfg.name] = st
                acc, hits = acc + st["accesses"], hits + st["hits"]
                resident += store.memory_breakdown()["resident_rows"]
                stored += store.stored_bytes()
            else:
                resident += store.storage().numel() * store.storage().element_size()
        return {"cache_hit_rate": hits / acc if acc else 0.0, "table_bytes_resident": resident,
                "table_bytes_stored": stored, "tables": per}

    def prefetch(self, features: SparseFeatures) -> dict[str, int]:
        """Starts reading, in the background, the rows of a coming batch that its tiered tables hold
        on disk only (call it with batch t+1 before running step t).  Changes nothing a lookup
        could see: no count, no row, no step.  Returns rows being read per tiered table."""
        if not isinstance(features, SparseFeatures):
            raise InputError(f"prefetch takes a SparseFeatures batch, got {type(features).__name__}")
        out: dict[str, int] = {}
        for t, (cfg, store) in enumerate(self.stores()):
            if not isinstance(store, TieredStore):
                continue
            ids = [features.feature(f).values for _, f, tb in self.outputs if tb == cfg.name and f in features]
            keys = torch.unique(torch.cat(ids)) if ids else torch.empty(0, dtype=torch.int64)
            # only ids a lookup could read: invalid ones are dropped or refused there
            keys = keys[(keys >= 0) | (not cfg.prune_negative and cfg.num_rows is None)]
            if cfg.num_rows is not None:
                keys = keys[keys < cfg.num_rows]
            out[cfg.name] = store.prefetch(self._keys_held_here(cfg.name, keys))
        return out

    def _keys_held_here(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """`keys` of `table` whose rows this collection holds (all of them; a shard holds some)."""
        return keys

    def evict(self, ttl: int | None = None, max_rows: int | None = None, policy: str | None = None,
              tables: Sequence[str] | None = None, min_norm: float | None = None) -> dict[str, int]:
        """Evicts rows of dynamic tables now; returns rows removed per table.

        `policy` ("lfu" | "lru") picks the victims beyond `max_rows`; default each table's
        own eviction_policy.  Rows of batches whose backward has not run are never evicted.
        """
        out = {}
        for t, (cfg, store) in enumerate(self.stores()):
            if cfg.num_rows is None and (tables is None or cfg.name in tables):
                out[cfg.name] = store.evict(self._step, ttl=ttl, max_rows=max_rows, policy=policy, min_norm=min_norm,
                                            protect=self._protected(t))
        return out

    def _meta_forward(self, features: SparseFeatures) -> PooledEmbeddings:
        """Shapes only: zeros-free meta tensors with the output layout of a real lookup."""
        from ..functional._outputs import JaggedEmbeddings

        B = features.batch_size
        plan = self.lookup.plan
        groups = [torch.empty(B, len(g.pooled), g.dim, device="meta") for g in plan.groups]
        unpooled = {}
        for g in plan.groups:
            for f in g.unpooled:
                unpooled[plan.features[f].name] = JaggedEmbeddings(
                    torch.empty(0, g.dim, device="meta"), torch.zeros(B + 1, dtype=torch.int64, device="meta"))
        return PooledEmbeddings(plan.pooled_names(), groups, self.lookup._where, unpooled)

    # -- devices ----------------------------------------------------------------------

    def _apply(self, fn, recurse: bool = True):
        # .to(device) / .cuda() / .cpu(): move the stores (only the device changes;
        # a table keeps the dtype of its config).
        target = fn(torch.empty(0, device=self.device)).device
        if target != self.device and self.device.type != "meta" and target.type != "meta":
            moved: dict[int, RowBlock] = {}  # a RowBlock's tables move into one block there
            for i, s in enumerate(self._stores):
                b = s.block_rows() if isinstance(s, ArrayStore) else None
                if b is None:
                    self._stores[i] = s.to(target)
                else:
                    block = moved.setdefault(id(b[0]), b[0].like(target))
                    self._stores[i] = s.to(target, block)
            self.device = target
            self._anchor = torch.zeros(0, requires_grad=True, device=target)
        return super()._apply(fn, recurse)

    # -- state_dict ---------------------------------------------------------------------

    @contextmanager
    def tables_left_out_of_state_dict(self):
        """Within this context ``state_dict()`` holds no table rows (snapshots save them per shard)."""
        self._tables_in_state_dict = False
        try:
            yield
        finally:
            self._tables_in_state_dict = True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self._tables_in_state_dict:
            return
        destination[prefix + "step"] = torch.tensor(self._step, dtype=torch.int64)
        for cfg, store in self.stores():
            ex = store.export()
            for field in EXPORT_FIELDS:
                destination[f"{prefix}tables.{cfg.name}.{field}"] = getattr(ex, field)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        mine = {prefix + "step"}
        if prefix + "step" in state_dict:
            self._step = int(state_dict[prefix + "step"])
            self._tables_version += 1  # rows last seen "later" than the new step may exist now
        else:
            missing_keys.append(prefix + "step")
        for i, (cfg, store) in enumerate(self.stores()):
            keys = {f: f"{prefix}tables.{cfg.name}.{f}" for f in EXPORT_FIELDS}
            mine.update(keys.values())
            absent = [k for k in keys.values() if k not in state_dict]
            if absent:
                missing_keys.extend(absent)
                continue
            export = StoreExport(**{f: state_dict[k].to(store.device) for f, k in keys.items()})
            if export.width != store.width:
                error_msgs.append(
                    f"table {cfg.name!r}: saved rows have {export.width} columns, this table needs {store.width} "
                    f"(layout {store.layout.describe()}); dim, dtypes or optimizer differ")
                continue
            if isinstance(store, ArrayStore) and store.block_rows() is not None and \
                    torch.equal(export.keys, torch.arange(store.num_rows, device=export.keys.device)):
                # every row of a table in a RowBlock: written over in place, in a new store object
                # (a backward in flight sees the table replaced); a second copy of every table
                # in memory at once would double the peak of a load
                fresh = copy.copy(store)
            else:
                fresh = self._make_store(cfg, self.rules[i])
            fresh.import_(export)
            self._stores[i] = fresh
            self._tables_version += 1
        # nn.Module marks every key that is not a registered tensor as unexpected: ours
        # are expected; keys of tables this collection does not have stay unexpected.
        unexpected_keys[:] = [k for k in unexpected_keys if k not in mine]


def _with_shared_key(keys: torch.Tensor) -> torch.Tensor:
    """`keys` and, last, the key of the table's shared row."""
    return torch.cat([keys, keys.new_full((1,), SHARED_ROW_KEY)])


class _RowsCopy(LayoutViews):
    """Rows copied out of a store (raw records of its layout), for an optimizer to bring current
    without touching the store: a store as far as ``catch_up`` is concerned.  ``home_slots``:
    where each row lives in the store (stochastic rounding draws as it would there)."""

    def __init__(self, store, home_slots: torch.Tensor) -> None:
        self.layout, self.seed = store.layout, store.seed
        self.rows = store.storage().index_select(0, home_slots)
        # a tiered store's slots are cache slots: its rows round as their logical slots would
        home = getattr(store, "home_slots", None)
        self.home_slots = home_slots if home is None else home.index_select(0, home_slots)

    def storage(self) -> torch.Tensor:
        return self.rows


class _MetaStore(LayoutViews):
    """Stand-in store of a collection built on the meta device (shape checks only)."""

    def __init__(self, name: str, layout: RowLayout) -> None:
        self.name, self.layout, self.dim, self.state_width = name, layout, layout.dim, layout.state_width
        self.width, self.dtype = layout.width, layout.dtype
        self.device = torch.device("meta")

    def __len__(self) -> int:
        return 0

    def memory_bytes(self) -> int:
        return 0

    def storage(self) -> torch.Tensor:
        return torch.empty(0, self.width, dtype=self.layout.storage_dtype, device="meta")

    def export(self):
        raise InputError(f"table {self.name!r} lives on the meta device: it has no rows to save")

    def to(self, device):
        raise InputError(f"table {self.name!r} was built on the meta device; build the collection on {device}")
