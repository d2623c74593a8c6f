"""What an EmbeddingCollection does per table, at the edges of a step: its RowStore views, the
state_dict, eviction, rows read current for eval and export (global Adam), the disk tiers, devices.

Inside a step the collection calls groups (nn/_collection.py); here a table is addressed by name
or index and reached through its group.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..errors import InputError
from ..functional import PooledEmbeddings
from ..store import EXPORT_FIELDS, RowStore, StoreExport, TieredGroup, TieredStore
from ..store._layout import LayoutViews
from ._rare import SHARED_ROW_KEY

__all__ = ["TableEdges"]


class _RowsCopy(LayoutViews):
    """Rows copied out of a group (raw records of its layout), for an optimizer to bring current
    without touching the group: a store as far as ``catch_up`` is concerned."""

    def __init__(self, layout, rows: torch.Tensor) -> None:
        self.layout, self.rows = layout, rows

    def storage(self) -> torch.Tensor:
        return self.rows


class TableEdges:
    """Mixin of EmbeddingCollection (its groups, placement, views, rules and tables)."""

    # -- views ------------------------------------------------------------------------------

    def _stamp(self) -> int:
        return max(s.write_stamp for s in self._stores)

    @property
    def tables_version(self) -> int:
        """Times the rows (or the step) were replaced or changed other than by a training step:
        ``load_state_dict`` of tables or of the step, ``catch_up_rows``, and writes straight into a
        table (``store.import_`` / ``scatter`` / ``remove``, each leaving a new ``write_stamp``).

        A snapshot delta holds the rows whose ids were seen since its parent: it may only follow a
        parent taken at the same version (``hugeembed.checkpoint`` checks it).  Writes through a raw
        view (``store.storage()[...] = ...``) cannot be seen: write a full snapshot after them."""
        stamp = self._stamp()
        if stamp != self._write_stamp:  # stamps never repeat: any direct write since moves it
            self._write_stamp = stamp
            self._tables_version += 1
        return self._tables_version

    def store(self, table: str) -> RowStore:
        return self._stores[self._table_index(table)]

    def stores(self) -> Iterator[tuple]:
        return zip(self.tables, self._stores)

    def store_at(self, t: int) -> RowStore:
        """The RowStore of table `t` (its index in ``tables``)."""
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
        return list(dict.fromkeys(f for _, f, _ in self.outputs))

    def num_rows(self) -> dict[str, int]:
        return {t.name: len(s) for t, s in self.stores()}

    def memory_bytes(self) -> dict[str, int]:
        """Bytes per table: its share of its group's rows, index and counters (a group's shares add up
        to what the group holds)."""
        return {t.name: s.memory_bytes() for t, s in self.stores()}

    def extra_repr(self) -> str:
        parts = []
        for t, rule in zip(self.tables, self.rules):
            kind = f"{t.num_rows} rows" if t.num_rows is not None else "dynamic"
            opt = rule.name if rule is not None else "frozen"
            parts.append(f"{t.name}: dim {t.dim}, {kind}, {t.combiner.value}, {opt}")
        return "\n".join(parts)

    # -- shared rows and eviction -----------------------------------------------------------------

    def shared_slot(self, t: int) -> int | None:
        """The slot (into :meth:`rows_of`) of table `t`'s shared row (TableConfig.shared_row), None if
        it has none (yet)."""
        if not self.tables[t].shared_row or self.placement.where[t] is None:
            return None
        g, local = self.placement.where[t]
        one = torch.tensor([local], dtype=torch.int64, device=self.device)
        slot = int(self.groups[g].find(one, torch.full_like(one, SHARED_ROW_KEY))[0])
        return slot if slot >= 0 else None

    def _protected(self, span) -> torch.Tensor | None:
        """Slots eviction must spare beyond the pinned ones: the span's shared rows (norm or LFU would
        take them)."""
        slots = [s for s in (self.shared_slot(t) for t in span.tables) if s is not None]
        return torch.tensor(slots, dtype=torch.int64, device=self.device) if slots else None

    def _evict_expired(self, step: int) -> None:
        """Every group's ttl and weight-norm eviction due at `step`: one call per group."""
        for span in self.placement.spans:
            if not self._span_rules[span.group].expires:
                continue
            cfgs = [self.tables[t] for t in span.tables]
            due = [(c.ttl is not None or c.evict_norm_below is not None) and step % c.evict_interval == 0
                   for c in cfgs]
            if any(due):
                self.groups[span.group].expire(step, [c.ttl if d else None for c, d in zip(cfgs, due)],
                                               [c.evict_norm_below if d else None for c, d in zip(cfgs, due)],
                                               self._protected(span))

    def evict(self, ttl: int | None = None, max_rows: int | None = None, policy: str | None = None,
              tables=None, min_norm: float | None = None) -> dict[str, int]:
        """Evicts rows of dynamic tables now; returns rows removed per table.

        `policy` ("lfu" | "lru") picks the victims beyond `max_rows`; default each table's own
        eviction_policy.  Rows of batches whose backward has not run are never evicted."""
        out = {}
        for t, (cfg, store) in enumerate(self.stores()):
            if cfg.num_rows is None and (tables is None or cfg.name in tables):
                held = self.placement.where[t] is not None  # (a shard held elsewhere evicts nothing here)
                protect = self._protected(self.placement.span_of[self.group_index(t)]) if held else None
                out[cfg.name] = store.evict(self._step, ttl=ttl, max_rows=max_rows, policy=policy, min_norm=min_norm,
                                            protect=protect)
        return out

    # -- rows brought current (global Adam) ----------------------------------------------------------

    def current_rows(self, t: int, slots: torch.Tensor,
                     keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(lookup rows, slots) to read table `t`'s rows at `slots` (from :meth:`fetch_slots`) as they
        are now, for anything but a training step.  Global Adam's rows lag the dense update until
        touched: they are read from a caught-up copy (slots renumbered into it; `keys`: their keys,
        for stochastic rounding), so reading changes no row and a run's numbers never depend on when
        it evaluated.  Other rules: :meth:`rows_of` and `slots` as given."""
        rule, step = self.rules[t], self.applied_step()
        if rule is None or not rule.moves_untouched_rows or step < 1:
            return self.rows_of(t), slots
        group = self.groups[self.group_index(t)]
        known = slots >= 0
        copy = _RowsCopy(group.layout, group.storage().index_select(0, slots[known]))
        n = copy.rows.shape[0]
        rule.catch_up(copy, torch.arange(n, device=slots.device), step, lr=self._lr(t),
                      keys=None if keys is None else keys[known], seeds=self._settings[t].seed)
        out = torch.full_like(slots, -1)
        out[known] = torch.arange(n, device=slots.device)
        return copy.lookup_rows(), out

    def _current(self, prep, storages: list, slots: torch.Tensor) -> tuple[list, torch.Tensor]:
        """The batch's rows of global Adam tables from caught-up copies (one per group) for eval."""
        step = self.applied_step()
        if step < 1:
            return storages, slots
        slots = slots.clone()
        for span in self.placement.spans:
            moving = [i for i, t in enumerate(span.tables) if t in self._moving]
            lo, hi = self._span(prep, span)
            if not moving or hi <= lo:
                continue
            group = self.groups[span.group]
            s = slots[lo:hi]
            known = s >= 0
            col = self._span_column(prep, span, lo, hi)[known]
            copy = _RowsCopy(group.layout, group.storage().index_select(0, s[known]))
            keys = prep.unique_keys[lo:hi][known]
            seeds = torch.tensor([self._settings[t].seed for t in span.tables], device=s.device)[col]
            for i in moving:
                t = span.tables[i]
                mine = (col == i).nonzero().squeeze(1)
                self.rules[t].catch_up(copy, mine, step, lr=self._lr(t), keys=keys[mine], seeds=seeds[mine])
            renum = torch.full_like(s, -1)
            renum[known] = torch.arange(copy.rows.shape[0], device=s.device)
            slots[lo:hi] = renum
            rows = copy.lookup_rows()
            for p in range(span.first, span.last + 1):
                storages[p] = rows
        return storages, slots

    def catch_up_rows(self) -> None:
        """Brings every row of the tables current in place (global Adam replays the steps each row
        skipped): for an export of the rows.  A no-op for every other optimizer.

        Training never needs it (a row is caught up when next touched), nor do eval and snapshots:
        eval reads a caught-up copy (:meth:`current_rows`), and a snapshot keeps each row with its
        step counter, which is lossless and resumes bit-identically."""
        step = self.applied_step()
        for t in self._moving:
            store, rule = self._stores[t], self.rules[t]
            if step < 1:
                continue
            if isinstance(store, TieredStore):  # through the cache, a chunk of rows at a time
                store.update_all(lambda slots: rule.catch_up(store, slots, step, lr=self._lr(t)))
            else:
                ex = store.export_index()
                if not ex.slots.numel():
                    continue
                rule.catch_up(store, ex.slots, step, lr=self._lr(t), keys=ex.keys, seeds=store.seed)
            self._tables_version += 1  # rows moved without their ids being seen: no delta can follow

    # -- disk tiers ----------------------------------------------------------------------------

    @property
    def has_tiered_tables(self) -> bool:
        """True when some table's rows live on disk (TableConfig.storage_dir)."""
        return self._tiered

    def tier_stats(self) -> dict | None:
        """The disk tier's figures, or None without tiered tables: ``cache_hit_rate`` (id occurrences
        served from memory, all tiered tables), ``table_bytes_resident`` (rows in memory: every
        in-memory group's rows and the tiered tables' caches), ``table_bytes_stored`` (rows in the
        tiers' files) and ``tables`` (per tiered table: resident and stored rows, hit rate, rows
        read / written / prefetched)."""
        if not self._tiered:
            return None
        per, acc, hits, resident, stored = {}, 0, 0, 0, 0
        for group in self.groups:
            if isinstance(group, TieredGroup):
                st = group.store.cache_stats()
                per[group.store.name] = st
                acc, hits = acc + st["accesses"], hits + st["hits"]
                resident += group.store.memory_breakdown()["resident_rows"]
                stored += group.store.stored_bytes()
            else:
                resident += group.storage().numel() * group.storage().element_size()
        return {"cache_hit_rate": hits / acc if acc else 0.0, "table_bytes_resident": resident,
                "table_bytes_stored": stored, "tables": per}

    def prefetch(self, features) -> dict[str, int]:
        """Starts reading, in the background, the rows of a coming batch that its tiered tables hold
        on disk only (call it with batch t+1 before running step t).  Changes nothing a lookup could
        see: no count, no row, no step.  Returns rows being read per tiered table."""
        from ..features import SparseFeatures

        if not isinstance(features, SparseFeatures):
            raise InputError(f"prefetch takes a SparseFeatures batch, got {type(features).__name__}")
        out: dict[str, int] = {}
        for cfg, store in self.stores():
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

    # -- shapes and devices ------------------------------------------------------------------------

    def _meta_forward(self, features) -> PooledEmbeddings:
        """Shapes only: meta tensors with the output layout of a real lookup."""
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

    def _apply(self, fn, recurse: bool = True):
        # .to(device) / .cuda() / .cpu(): move the groups (only the device changes; a table keeps the
        # dtype of its config)
        target = fn(torch.empty(0, device=self.device)).device
        if target != self.device and self.device.type != "meta" and target.type != "meta":
            self.groups = [g.to(target) if not isinstance(g, TieredGroup) else TieredGroup(g.store.to(target))
                           for g in self.groups]
            self.device = target
            self._refresh_views()
            self.lookup.ready(target)
            self._anchor = torch.zeros(0, requires_grad=True, device=target)
        return super()._apply(fn, recurse)

    # -- state_dict ---------------------------------------------------------------------------------

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
        loads: dict[int, list] = {}
        for t, (cfg, store) in enumerate(self.stores()):
            keys = {f: f"{prefix}tables.{cfg.name}.{f}" for f in EXPORT_FIELDS}
            mine.update(keys.values())
            absent = [k for k in keys.values() if k not in state_dict]
            if absent:
                missing_keys.extend(absent)
                continue
            export = StoreExport(**{f: state_dict[k].to(self.device) for f, k in keys.items()})
            if export.width != store.width:
                error_msgs.append(
                    f"table {cfg.name!r}: saved rows have {export.width} columns, this table needs {store.width} "
                    f"(layout {store.layout.describe()}); dim, dtypes or optimizer differ")
                continue
            if self.placement.where[t] is not None:
                loads.setdefault(self.group_index(t), []).append((t, export))
        for g, items in loads.items():
            self.groups[g] = self._loaded_group(g, items)
            self._tables_version += 1
        if loads:
            self._refresh_views()
        # nn.Module marks every key that is not a registered tensor as unexpected: ours are expected;
        # keys of tables this collection does not have stay unexpected.
        unexpected_keys[:] = [k for k in unexpected_keys if k not in mine]

    def _loaded_group(self, g: int, items: list) -> object:
        """Group `g` with the tables of `items` loaded: a new group object (a backward in flight sees
        its tables replaced) over the same rows, each table's contents replaced in place (a second copy
        of every table in memory at once would double the peak of a load); every export checked first."""
        group = self.groups[g]
        local = {t: i for i, t in enumerate(self.placement.span_of[g].tables)}
        if isinstance(group, TieredGroup):
            (t, export), = items
            store = self._make_tiered(t, self._settings[t])
            store.import_(export)
            return TieredGroup(store)
        for t, export in items:
            group.check_import(local[t], export)
        fresh = group.renewed()
        for t, export in items:
            fresh.replace_table(local[t], export)
        return fresh
