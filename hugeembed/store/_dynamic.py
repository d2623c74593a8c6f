"""DynamicGroup: the dynamic tables of one row layout and device -- one rows tensor, one key index.

DeepRec's EmbeddingVariable, TensorNet's SparseTable and OneEmbedding's key-value store, for
several tables at once: a row is created on first sight of a key (or after ``admit_min_count``
hits), lives in the group's ``rows [R, W]`` (slots shared by the tables, handed out in batch
order, smallest free slot first), and is found through one hash index keyed by (table, key)
(store/_index.py).  Every operation is one call for all the group's tables: a find-or-insert
takes a table column beside the keys::

    keys   [17,  3, 17, 99]        tables [0, 0, 1, 1]   (-1: an entry to skip)
    -> slots [ 0,  1,  2,  3]      (table 1's key 17 is another row than table 0's)

Per table stay its settings (capacity, admission, eviction, initializer, salt) and counts.  The
index runs on the native kernels (CPU), the triton kernels (CUDA) or the torch reference (any device).  A call that
fails (a duplicate key, a capacity error) leaves the group as it was, except that on_full="evict"
may have evicted rows before finding that nothing more could go.  Growth is explicit and amortized:
the index to under MAX_LOAD (x1.5 at least), the rows x1.5; each is one copy (old and new held at
once: the peak is 2.5x the rows, docs/store.md).  Growth, rekeying, row slots and every edit but the
fetch live in store/_dynamic_edit.py.
"""

from __future__ import annotations

import dataclasses
import struct
from itertools import compress
from typing import Sequence

import torch

from .. import _native, _triton
from .._device import canonical_device, host_to_device
from .._hashing import mix64, seed_mix
from .._tensors import joined, repeat_each
from ..errors import ConfigError, InputError, StoreError
from . import _alloc
from ._admit import admission_draw
from ._dynamic_edit import AUTO_EVICT_SLACK, MAX_LOAD, DynamicEdits
from ._group import GroupBase
from ._index import G_LEN, PENDING, T_ADMIT_K, T_PENDING, T_ROWS, Outcome, hash_key, new_buckets
from ._index_native import NativeIndex
from ._index_torch import TorchIndex
from ._index_triton import TritonIndex
from ._init import Constant, Normal, TruncatedNormal, Uniform, _signed, init_rows_native
from ._pins import PinnedRows
from ._settings import TableSettings, draw_salt

__all__ = ["DynamicGroup", "MAX_LOAD", "AUTO_EVICT_SLACK", "pick_backend"]

_MIN_BUCKETS = 64


# Initializers whose values are a function of each key's stream alone: many tables' rows in one call.
_STREAM_KINDS = (Constant, Uniform, Normal, TruncatedNormal)


def _init_key(init) -> tuple:
    """Initializers equal by value, bit for bit (Constant(0.0) == Constant(-0.0) as dataclasses)."""
    return type(init), tuple(struct.pack("<d", float(getattr(init, f.name))) for f in dataclasses.fields(init))


def pick_backend(backend: str | None, device: torch.device) -> str:
    """"native" (C++, CPU), "triton" (CUDA; CPU tensors under TRITON_INTERPRET=1, for the tests) or
    "torch" (the reference, any device); None picks native on CPU, triton on CUDA, where they run."""
    if backend is None:
        if device.type == "cpu" and _native.available():
            return "native"
        return "triton" if device.type == "cuda" and _triton.available() else "torch"
    if backend not in ("native", "triton", "torch"):
        raise ConfigError(f"backend must be 'native', 'triton', 'torch' or None, got {backend!r}")
    if backend == "triton" and not _triton.available():
        raise ConfigError("the triton backend needs triton (pip install -e '.[triton]')")
    if backend == "triton" and device.type != "cuda" and not _triton.interpreting():
        raise ConfigError(f"the triton backend runs on CUDA (or on CPU under TRITON_INTERPRET=1); the tables are "
                          f"on {device}")
    if backend == "native" and device.type != "cpu":
        raise ConfigError(f"the native backend runs on CPU only; the tables are on {device}")
    if backend == "native" and not _native.available():
        raise ConfigError("the native backend is not available (kernels not built or HUGEEMBED_DISABLE_NATIVE=1)")
    return backend


class DynamicGroup(DynamicEdits, GroupBase):
    """Dynamic tables of one row layout on one device (see the module docstring).

    Args:
        tables: their settings (one layout: ``tables[i].layout`` equal for all).
        device: where the rows and the index live.
        backend: "native", "triton", "torch" or None (native on CPU, triton on CUDA, where they run).
        rows: False makes the group a key index without rows (a tiered table's, store/_tiered.py):
            slots are row numbers only; the slots it frees go to ``on_free``, weight norms come
            from ``row_norms``.
    """

    kind = "dynamic"

    def __init__(self, tables: Sequence[TableSettings], *, device: torch.device | str = "cpu",
                 backend: str | None = None, rows: bool = True) -> None:
        tables = tuple(tables)
        if not tables or any(t.static for t in tables):
            raise ConfigError(f"a dynamic group takes dynamic tables, got {[t.name for t in tables]}")
        lay = tables[0].layout
        for t in tables[1:]:
            if t.layout != lay:
                raise ConfigError(f"tables {tables[0].name!r} and {t.name!r} have different row layouts "
                                  f"({lay.describe()} vs {t.layout.describe()}): they cannot share a group")
        self.settings, self.layout, self.device = tables, lay, canonical_device(device)
        self.has_rows = bool(rows)
        self.pins = PinnedRows()
        self.on_free = None  # a tiered table's hooks (store/_tiered.py)
        self.row_norms = None
        self.salts = [draw_salt() if t.salt is None else t.salt for t in tables]
        self.scalars = torch.zeros(G_LEN, dtype=torch.int64)
        self.tables = torch.tensor([[0, 0, t.row_limit, t.admit_min_count, hash_key(s, i)]
                                    for i, (t, s) in enumerate(zip(tables, self.salts))], dtype=torch.int64)
        self.buckets = new_buckets(_MIN_BUCKETS, self.device)
        self.free_rows = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.rows = torch.empty(0, lay.width if rows else 0, dtype=lay.storage_dtype, device=self.device)
        self._known: tuple[int, int, int] | None = (0, 0, 0)  # the scalars as last read (None: read again)
        # a new row's optimizer state, per table (None: its init_state is not a constant row)
        self._templates = [t.state_template(lay.state_dtype) for t in tables]
        # per-table rules a step reads, decided here (a step then loops over none of the tables)
        self._sampled = tuple(i for i, t in enumerate(tables) if t.samples_admission)
        self._may_fail = frozenset(i for i, t in enumerate(tables) if t.initializer_may_fail)
        self._counted = tuple(i for i, t in enumerate(tables) if t.admit_min_count != 1)
        self._set_backend(pick_backend(backend, self.device))
        reserve = sum(min(t.initial_rows, t.capacity or t.initial_rows) for t in tables)
        if reserve:
            self._grow_for(reserve, reserve)

    # ---------------------------------------------------------------- basics
    @property
    def _view_class(self):
        from ._views import DynamicTable
        return DynamicTable

    def __len__(self) -> int:
        """Live rows of all the group's tables."""
        return int(self.tables[:, T_ROWS].sum())

    def table_rows(self, t: int) -> int:
        return int(self.tables[t, T_ROWS])

    def table_pending(self, t: int) -> int:
        return int(self.tables[t, T_PENDING])

    @property
    def backend(self) -> str:
        return self._index.name

    def use_backend(self, backend: str) -> None:
        """Switches between the kernels and the reference; the layout is shared, nothing is copied."""
        self._set_backend(pick_backend(backend, self.device))

    def _set_backend(self, backend: str) -> None:
        self._index = {"native": NativeIndex, "triton": TritonIndex, "torch": TorchIndex}[backend]()
        self._kernel_init = self._kernel_init_args() if backend in ("native", "triton") else None

    def rows_capacity(self) -> int:
        return self.rows.shape[0]

    def max_entries(self) -> int:
        return int(self.buckets.shape[0] * MAX_LOAD)

    @property
    def num_buckets(self) -> int:
        return self.buckets.shape[0]

    # ---------------------------------------------------------------- new rows
    def _kernel_init_args(self):
        """What the find-or-insert kernel needs to initialise new rows itself, or None (the group
        initialises them: a packed or non-float32 layout, no rows).  Tables whose initializer or
        state the kernel cannot make get kind -1 (initialised here)."""
        lay = self.layout
        if not self.has_rows or lay.packed or lay.storage_dtype != torch.float32:
            return None
        kinds = torch.full((len(self.settings), 2), -1, dtype=torch.int64)
        params = torch.zeros(len(self.settings), 6, dtype=torch.float64)
        state = torch.zeros(len(self.settings), lay.state_width, dtype=torch.float32)
        for i, t in enumerate(self.settings):
            spec, row = t.initializer._native_spec(), t.state_template(torch.float32)
            if spec is None or row is None or t.initializer_may_fail:
                continue
            kinds[i] = torch.tensor([spec[0], _signed(t.seed)])
            params[i, : len(spec[1])] = torch.tensor(spec[1], dtype=torch.float64)
            state[i] = row[0]
        self._init_here = [i for i in range(len(self.settings)) if int(kinds[i, 0]) < 0]
        return kinds, params, state if lay.state_width else None

    def _init_call(self) -> tuple | None:
        """The kernel's row-initialisation arguments for this call (the rows may have moved)."""
        if self._kernel_init is None:
            return None
        lay = self.layout
        return (self.rows, *self._kernel_init, lay.width, lay.dim, lay.state_width)

    def _tables_initialised_here(self) -> list[int]:
        if self._kernel_init is None:
            return list(range(len(self.settings))) if self.has_rows else []
        return self._init_here

    def _values_before(self, tids, keys, counts, admit) -> dict[int, tuple]:
        """The initial weights of the rows a find-or-insert is about to make for tables whose
        initializer may raise: made first, so that one that raises changes nothing."""
        if not self._may_fail:
            return {}
        risky = [t for t in self._tables_initialised_here() if t in self._may_fail]
        if not risky:
            return {}
        codes, hits = self._index.find(self, keys, tids, rows_only=False, hits=True)
        c = counts if counts is not None else torch.ones_like(keys)
        k = self.tables[:, T_ADMIT_K].to(keys.device)[tids.clamp(min=0)]
        drawn = torch.ones_like(keys, dtype=torch.bool) if admit is None else admit.bool()
        new = (tids >= 0) & (((codes == -1) & drawn & (c >= k)) | ((codes == PENDING) & (hits + c >= k)))
        out = {}
        for t in risky:
            kt = keys[new & (tids == t)]
            s = self.settings[t]
            out[t] = (kt, s.initializer.generate(kt, self.layout.dim, s.seed))
        return out

    def _init_new_rows(self, made: tuple, before: dict[int, tuple], need) -> None:
        """Initial weights and state of the new rows the kernel left to the group: per table the
        native initializer where it runs, else the built-in initializers of many tables in one call
        (each row's stream seeded by its own table's seed: the same values as table by table)."""
        mine = self._tables_initialised_here()
        here = list(compress(mine, map(need.new_rows.__getitem__, mine)))  # those with new rows (C-level)
        if not here:
            return
        slots, keys, tids = made
        order = torch.argsort(tids, stable=True)  # by table (the shared rows' keys come last), batch order within
        slots, keys, tids = slots[order], keys[order], tids[order]
        by_slot, by_key = slots.split(need.new_rows), keys.split(need.new_rows)
        lay = self.layout
        weights = lay.weights(self.rows)
        native = self.rows.device.type == "cpu" and _native.available() and not lay.packed and \
            self.rows.dtype == torch.float32
        streams: dict[tuple, list[int]] = {}
        for t in here:
            s = self.settings[t]
            if t in before:
                if not torch.equal(before[t][0], by_key[t]):
                    raise StoreError(f"table '{s.name}': the rows made differ from the rows foreseen (internal error)")
                weights[by_slot[t]] = before[t][1].to(lay.dtype)
            elif native and init_rows_native(s.initializer, by_key[t], lay.dim, s.seed, self.rows, by_slot[t]):
                pass  # no torch op; cannot fail on its input
            elif type(s.initializer) in _STREAM_KINDS:
                streams.setdefault(_init_key(s.initializer), []).append(t)
            else:
                weights[by_slot[t]] = s.initializer.generate(by_key[t], lay.dim, s.seed).to(lay.dtype)
        for ts in streams.values():
            k, sl = joined([by_key[t] for t in ts]), joined([by_slot[t] for t in ts])
            mixes = repeat_each([seed_mix(self.settings[t].seed) for t in ts], [need.new_rows[t] for t in ts], k.device)
            weights[sl] = self.settings[ts[0]].initializer.rows_from_bases(mix64(k ^ mixes), lay.dim).to(lay.dtype)
        if lay.state_width:
            self._init_state(here, by_slot, tids, slots, need)

    def _init_state(self, here: list[int], by_slot, tids, slots, need) -> None:
        """The optimizer state of new rows: row-independent states copied from each table's one-row
        template (one op for all), the others by their init_state."""
        lay = self.layout
        state = lay.state(self.rows)
        alike = [t for t in here if self._templates[t] is not None]
        if alike:
            # (host-made: copied from page-locked memory, never waited for)
            table = host_to_device(torch.cat([x if x is not None else torch.zeros(1, lay.state_width,
                                                                                   dtype=lay.state_dtype)
                                              for x in self._templates]), lay.state_dtype, slots.device)
            mine = None if len(alike) == len(self.settings) else \
                torch.isin(tids, host_to_device(alike, tids.dtype, tids.device))
            sl, tt = (slots, tids) if mine is None else (slots[mine], tids[mine])
            state[sl] = table[tt]
        for t in here:
            s = self.settings[t]
            if self._templates[t] is None:
                block = torch.zeros(need.new_rows[t], lay.state_width, dtype=lay.state_dtype, device=slots.device)
                s.init_state(block)
                state[by_slot[t]] = block

    # ---------------------------------------------------------------- find-or-insert
    def find_or_insert(self, tids: torch.Tensor, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, hits: torch.Tensor | None = None) -> torch.Tensor:
        """Row slots of (table, key) pairs (tids -1: skipped, slot -1), creating rows for new keys
        with admission (-1 for a key not admitted yet); every key counted `counts` times (1 each).

        Keys must be unique per table.  `out` (int64 [n]) receives the slots; `hits` (int64 [n],
        optional) each key's hit count after the call."""
        out = torch.empty_like(keys) if out is None else out
        admit = self._admission(tids, keys, step)
        over_done: set[int] = set()
        grown = rekeyed = False
        self._room_for(keys.numel())
        while True:
            before = self._values_before(tids, keys, counts, admit)
            rc, need, made = self._index.find_or_insert(self, keys, tids, counts, admit, step, out, hits,
                                                        self._init_call())
            self._known = need.state  # the call's one read: the group as it is now
            if rc == Outcome.DONE:
                self._init_new_rows(made, before, need)
                self._forget_pending(step, need.table_pending)
                return out
            if rc == Outcome.DUPLICATE_KEY:
                raise InputError(f"table '{self.settings[need.dup_table].name}': key {need.dup_key} is given twice "
                                 "to find_or_insert; keys must be unique (deduplicate the batch first)")
            if rc == Outcome.MUST_GROW and not grown:
                self._grow_for(need.entries, need.rows)
                grown = True
            elif rc == Outcome.OVER_LIMIT:
                for t, s in enumerate(self.settings):
                    if need.table_rows[t] + need.new_rows[t] > s.row_limit:
                        self._make_room(t, step, need.new_rows[t], out[out >= 0], t in over_done)
                        over_done.add(t)
                grown = False
            elif rc == Outcome.LONG_PROBE:
                if rekeyed:  # a second long chain right after a new salt: the index is too full
                    self._rehash(int(self.buckets.shape[0] * 2))
                else:
                    self.rekey(need.long_table)
                rekeyed = True
            else:
                raise StoreError(f"tables {self.names()}: find_or_insert failed with outcome {rc} (internal error)")

    def _admission(self, tids: torch.Tensor, keys: torch.Tensor, step: int) -> torch.Tensor | None:
        """Per key, whether a key without a row may get one now: the probability filter's draw
        (DeepRec's); None when no table of the group samples."""
        if not self._sampled:
            return None
        admit = torch.ones(keys.numel(), dtype=torch.uint8, device=keys.device)
        for i in self._sampled:
            sel = tids == i
            s = self.settings[i]
            admit[sel] = admission_draw(keys[sel], step, s.seed, s.admit_probability).to(torch.uint8)
        return admit

    def fetch(self, tids: torch.Tensor, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None,
              out: torch.Tensor | None = None, hits: torch.Tensor | None = None, within=None) -> torch.Tensor:
        """The group interface's training fetch (:meth:`find_or_insert`; `within`: any key is in range)."""
        return self.find_or_insert(tids, keys, step, counts, out, hits)

    # ---------------------------------------------------------------- reads
    def find(self, tids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Slots of (table, key) pairs, -1 where absent, pending or skipped; changes nothing."""
        return self._index.find(self, keys, tids, rows_only=True)[0]

    def codes(self, tids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Slots, PENDING (-2) for keys seen but not admitted, -1 where absent; changes nothing."""
        return self._index.find(self, keys, tids, rows_only=False)[0]

    def hit_counts(self, tids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Hits of the pairs so far (admitted or pending; 0 for an unknown key); changes nothing."""
        return self._index.find(self, keys, tids, rows_only=False, hits=True)[1]

    # ---------------------------------------------------------------- memory
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held: `rows` (incl. those allocated ahead of use), `index` (32 B per bucket: key,
        table, code + count, last step), `free_rows`, `tables` (per-table counters)."""
        return {"rows": self.rows.numel() * self.rows.element_size(), "index": 32 * self.buckets.shape[0],
                "free_rows": self.free_rows.numel() * 4, "tables": (self.tables.numel() + G_LEN) * 8}

    def memory_bytes(self) -> int:
        return sum(self.memory_breakdown().values())

    def table_memory_bytes(self, t: int) -> int:
        """Table `t`'s share of the group's bytes: its rows' and keys' shares (the shares of all the
        tables add up to memory_bytes())."""
        b = self.memory_breakdown()
        rows, keys = self.tables[:, T_ROWS], self.tables[:, T_ROWS] + self.tables[:, T_PENDING]
        T = len(self.settings)
        share = lambda part, used: part * int(used[t]) // max(1, int(used.sum())) if int(used.sum()) else part // T
        return share(b["rows"] + b["free_rows"], rows) + share(b["index"] + b["tables"], keys)

    def to(self, device: torch.device | str) -> "DynamicGroup":
        """A copy on `device` (native backend on CPU when available); pins are not copied."""
        out = DynamicGroup.__new__(DynamicGroup)
        out.__dict__.update(self.__dict__)
        out.device = canonical_device(device)
        out.pins = PinnedRows()
        out.__dict__["_views"] = {}
        out.salts = list(self.salts)
        out.scalars, out.tables = self.scalars.clone(), self.tables.clone()
        for name in ("buckets", "free_rows", "rows"):
            v = getattr(self, name)
            t = _alloc.empty(tuple(v.shape), v.dtype, out.device)
            t.copy_(v)
            setattr(out, name, t)
        out._set_backend(pick_backend(None, out.device))
        return out

    def __repr__(self) -> str:
        return (f"DynamicGroup(tables={self.names()}, rows={len(self)}, buckets={self.buckets.shape[0]}, "
                f"layout={self.layout.describe()}, backend={self.backend!r}, device={self.device})")
