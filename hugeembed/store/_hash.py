"""HashStore: the dynamic key -> row store (DeepRec's EmbeddingVariable, TensorNet's
SparseTable, OneEmbedding's key-value store).

Rows are created on first sight of a key (or after ``admit_min_count`` hits), live
in one growable ``[R, W]`` storage tensor, and can be evicted by age (ttl) or by
frequency / recency when the table is over a row budget.  The key -> row index is
an open-addressing table with linear probing (layout: csrc/store_table.h), driven
by C++ kernels on CPU and by vectorised torch ops elsewhere (see _hash_torch.py).
Each bucket holds a 24-byte record (key, row slot + hit count, last step)::

    keys [17, -3, 99]  --home(mix64(key))-->  buckets [5, 1, 5]
    bucket     0    1          2   3   4   5          6          7 ...
    key        .    -3         .   .   .   17         99         .   (99 probed on from 5 to 6)
    slot|hits  .    2|1        .   .   .   0|4        1|1        .   -> storage rows 2, 0, 1
    last step  .    7          .   .   .   9          9          .

Example::

    >>> store = HashStore("user_id", dim=8, state_width=1)
    >>> slots = store.find_or_insert(torch.tensor([17, -3, 99]), step=0)
    >>> rows = store.gather(slots)                         # [3, 9] weights + state
"""

from __future__ import annotations

import math

import torch

from .. import _native
from .._device import canonical_device
from ..errors import CapacityError, ConfigError, InputError, StoreError
from ..functional import joined, joined_view, repeat_each
from . import _alloc, _ops
from ._common import (as_counts, as_keys, as_slots, check_step, check_table_config, direct_write, gather_rows,
                      init_rows, make_layout, scatter_rows)
from ._array import ArrayStore, touch_many
from ._admit import DEFAULT_MAX_PENDING, admission_draw, check_admission, pending_victims
from ._evict import select_victims
from ._hash_group import DynamicRows, find_group, find_or_insert_group, write_into
from ._hash_torch import _MAX_SLOTS, _ST, EMPTY, PENDING, Outcome, TorchOps, code_of, count_of, entries, new_buckets, probe
from ._init import Initializer, _signed, default_initializer
from ._layout import LayoutViews, RowLayout, check_import_rows
from ._native_store import NativeOps, run_batch
from ._pins import Pinnable, PinnedRows
from ._protocol import ExportIndex, StoreExport

__all__ = ["HashStore", "find_or_insert_many", "find_many", "MAX_LOAD", "AUTO_EVICT_SLACK"]

# The buckets grow (x1.5, or to what a batch needs) when they would be fuller
# than this.  Measured (docs/store.md): find at load 0.49 / 0.59 / 0.69 / 0.78 runs
# at 38 / 33 / 28 / 23 M keys per CPU-second; the index costs 12 B / load per key.
MAX_LOAD = 0.6
# on_full="evict" frees this fraction of the capacity beyond what the batch
# needs, so that a full table scans for victims once per capacity/64 new rows
# rather than on every batch.
AUTO_EVICT_SLACK = 64
_BUCKET_GROWTH = 1.5
_MAX_BUCKETS = 2**32
_ROW_GROWTH = 1.5
_MIN_BUCKETS = 64
_MIN_ROWS = 64


def _pick_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        native_ok = device.type == "cpu" and _native.available()
        return "native" if native_ok else "torch"
    if backend not in ("native", "torch"):
        raise ConfigError(f"backend must be 'native', 'torch' or None, got {backend!r}")
    if backend == "native" and device.type != "cpu":
        raise ConfigError(f"the native backend runs on CPU only; the table is on {device}")
    if backend == "native" and not _native.available():
        raise ConfigError("the native backend is not available (kernels not built or HUGEEMBED_DISABLE_NATIVE=1)")
    return backend


class HashStore(LayoutViews, Pinnable):
    """Dynamic key -> row store; any int64 is a valid key.

    Args:
        name: table name (in every error message).
        dim: D, embedding width.
        state_width: S, optimizer-state columns stored after the weights of each row.
        initializer: initial weights per (seed, key, column); default TruncatedNormal(0, 1/sqrt(D)).
        init_state: callable filling a fresh [n, S] state tensor in place (zeros if None).
        dtype, device: of the weights and of the row storage.
        layout: the RowLayout of a row (default: state in the weight dtype, beside the weights).
        capacity: at most this many rows (None: unbounded); allocates nothing up front.
        on_full: "evict" (run eviction_policy, sparing the keys of the current call) or "error"
            (CapacityError) when an insert would exceed capacity.
        eviction_policy: "lfu" or "lru", for on_full="evict".
        admit_min_count: a key gets a trainable row once it was seen this many times
            (DeepRec's counter filter); before that find_or_insert returns -1 for it.
        admit_probability: instead, each sighting of a key without a row admits it with this
            probability (DeepRec's probability filter; reproducible per seed, key, step).
        max_pending: keys waiting for admission kept at most (the least seen are forgotten
            past it); None: DEFAULT_MAX_PENDING.
        seed: initializer seed.
        initial_rows: reserve room for this many rows (a hint; saves rehashes).
        backend: "native" (C++, CPU), "torch" (any device) or None (native when possible).
        rows: False makes this store the key index of a tiered table (store/_tiered.py): it keeps
            keys, slots, counts, admission and eviction, but no rows; the slots it frees are
            reported to ``on_free`` and weight norms read through ``row_norms``.

    A store is not thread-safe: one thread at a time calls it (its kernels use
    their own threads inside a call).  Calls that fail (CapacityError, InputError)
    leave the store unchanged, except that on_full="evict" may have evicted rows
    before finding that nothing more could go.

    Rows pinned with :meth:`pin` (the rows of batches whose backward has not run) are
    never evicted: a gradient computed for a row must land on that row.
    """

    def __init__(self, name: str, dim: int, state_width: int = 0, *, initializer: Initializer | None = None,
                 init_state=None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 capacity: int | None = None, on_full: str = "evict", eviction_policy: str = "lfu",
                 admit_min_count: int = 1, seed: int = 0, initial_rows: int = 0, backend: str | None = None,
                 admit_probability: float | None = None, max_pending: int | None = None,
                 layout: RowLayout | None = None, rows: bool = True):
        initializer = default_initializer(dim) if initializer is None and isinstance(dim, int) and dim > 0 \
            else initializer
        check_table_config(name, dim, state_width, dtype, initializer)
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1 or capacity > _MAX_SLOTS):
            raise ConfigError(f"table '{name}': capacity must be an int in [1, {_MAX_SLOTS}] or None, got {capacity!r}")
        if on_full not in ("evict", "error"):
            raise ConfigError(f"table '{name}': on_full must be 'evict' or 'error', got {on_full!r}")
        if eviction_policy not in ("lfu", "lru"):
            raise ConfigError(f"table '{name}': eviction_policy must be 'lfu' or 'lru', got {eviction_policy!r}")
        check_admission(name, admit_min_count, admit_probability, max_pending)
        if not isinstance(initial_rows, int) or initial_rows < 0:
            raise ConfigError(f"table '{name}': initial_rows must be an int >= 0, got {initial_rows!r}")
        if init_state is not None and not callable(init_state):
            raise ConfigError(f"table '{name}': init_state must be callable or None")
        self.layout = make_layout(name, dim, state_width, dtype, layout)
        self.name, self.dim, self.state_width, self.width = name, dim, state_width, self.layout.width
        self.dtype, self.device = dtype, canonical_device(device)
        self._op_handle, self._op_version = _ops.register(self)  # its ops under torch.compile (store/_ops.py)
        self.initializer, self.init_state, self.seed = initializer, init_state, int(seed)
        self.capacity, self.on_full, self.eviction_policy = capacity, on_full, eviction_policy
        self.admit_min_count, self.admit_probability = admit_min_count, admit_probability
        self.max_pending = DEFAULT_MAX_PENDING if max_pending is None else max_pending
        self._pins = PinnedRows()
        self.has_rows = bool(rows)
        # a tiered table's hooks: told of every slot freed; reads weight norms of slots
        self.on_free = None
        self.row_norms = None
        self._set_backend(_pick_backend(backend, self.device))
        dev = self.device
        self._st = torch.zeros(len(_ST), dtype=torch.int64)
        self._buckets = new_buckets(_MIN_BUCKETS, dev)
        self._storage = torch.empty(0, self._row_width, dtype=self.layout.storage_dtype, device=dev)
        self._free = torch.zeros(0, dtype=torch.int32, device=dev)
        if initial_rows:
            self._reserve(min(initial_rows, capacity or initial_rows))

    # ----------------------------------------------------------------- scalars
    def _st_get(self, key: str) -> int:
        return int(self._st[_ST[key]])

    def _st_set(self, key: str, value: int) -> None:
        self._st[_ST[key]] = value

    def _st_add(self, key: str, delta: int) -> None:
        self._st[_ST[key]] += delta

    @property
    def _row_limit(self) -> int:
        """At most this many rows: the capacity, else the slots there are."""
        return self.capacity if self.capacity is not None else _MAX_SLOTS

    def _max_entries(self) -> int:
        return int(self.num_buckets * MAX_LOAD)

    def _side_fix(self, keys: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Codes of keys equal to the empty-bucket sentinel come from the side record."""
        side = keys == EMPTY
        if bool(side.any()):
            codes[side] = self._side_code() if self._st_get("side_used") else -1
        return codes

    def _side_code(self) -> int:
        return int(code_of(self._st[_ST["side_word1"]]))

    # ------------------------------------------------------------------ growth
    def _reserve(self, n: int) -> None:
        """Makes room for `n` more keys in the worst case (all new, all admitted)."""
        self._grow_for(n, n)

    def _buckets_for(self, entries: int, new_entries: int) -> int | None:
        """The bucket count the index grows to for `new_entries` more keys than `entries` (to under
        MAX_LOAD, at least x1.5), or None when it need not grow."""
        need = entries + new_entries
        nb = self.num_buckets
        if need <= int(nb * MAX_LOAD):
            return None
        nb = max(math.ceil(need / MAX_LOAD), int(nb * _BUCKET_GROWTH))
        nb = -(-nb // 64) * 64
        if nb > _MAX_BUCKETS:
            raise CapacityError(f"table '{self.name}': {need} keys exceed the index limit of one store "
                                f"({int(_MAX_BUCKETS * MAX_LOAD)})")
        return nb

    def _grow_for(self, new_entries: int, new_rows: int) -> None:
        """Grows the buckets (to under MAX_LOAD, at least x1.5) and the rows (x1.5) to fit this many more."""
        nb = self._buckets_for(self._st_get("entries"), new_entries)
        if nb is not None:
            self._rehash(nb)
        hwm = self._st_get("row_hwm") + max(0, new_rows - self._st_get("num_free"))
        if self.capacity is not None:
            hwm = min(hwm, self.capacity)
        if hwm > _MAX_SLOTS:
            raise CapacityError(f"table '{self.name}': {hwm} rows exceed the {_MAX_SLOTS} row slots of one store")
        if hwm > self._storage.shape[0]:
            new = max(hwm, int(self._storage.shape[0] * _ROW_GROWTH), _MIN_ROWS)
            self._grow_rows(min(new, self.capacity or new))

    def _rehash(self, nbuckets: int) -> None:
        new = _alloc.empty((nbuckets, 3), torch.int64, self.device)
        if self.device.type == "meta":  # shapes only (memory planning): no records to move
            self._buckets = new
            return
        self._ops.rehash(self, new)
        self._buckets = new

    @property
    def _row_width(self) -> int:
        """Columns of the storage: the layout's, or none for a key index (its slots are row numbers only)."""
        return self.width if self.has_rows else 0

    def _grow_rows(self, rows: int) -> None:
        used = self._st_get("row_hwm")
        storage = _alloc.empty((rows, self._row_width), self.layout.storage_dtype, self.device)
        if self.device.type == "meta":
            self._storage = storage
            return
        storage[:used] = self._storage[:used]
        # Touch the spare rows now: first-touch page faults cost more than the
        # writes themselves (docs/architecture.md), better paid at growth than per batch.
        storage[used:] = 0
        self._storage = storage
        self.__dict__.pop("_row_block", None)  # out of its DynamicRows block: do not keep that alive

    # ------------------------------------------------------- slot bookkeeping
    def _take_rows(self, m: int) -> torch.Tensor:
        """`m` row slots: free ones smallest first, then fresh ones (rows reserved)."""
        nf, hwm = self._st_get("num_free"), self._st_get("row_hwm")
        take = min(m, nf)
        slots = torch.cat([self._free[nf - take : nf].flip(0).to(torch.int64),
                           torch.arange(hwm, hwm + m - take, device=self.device)])
        self._st_set("num_free", nf - take)
        self._st_set("row_hwm", hwm + m - take)
        return slots

    def _free_rows(self, slots: torch.Tensor) -> None:
        if self.on_free is not None and slots.numel():
            self.on_free(slots.to(torch.int64))
        nf = self._st_get("num_free")
        free = torch.cat([self._free[:nf], slots.to(torch.int32)]).sort(descending=True).values
        self._free = free
        self._st_set("num_free", free.numel())

    # -------------------------------------------------------------- protocol
    def __len__(self) -> int:
        return self._st_get("rows")

    @property
    def num_buckets(self) -> int:
        """Buckets of the key index."""
        return self._buckets.shape[0]

    @property
    def num_pending(self) -> int:
        """Keys seen but not admitted yet."""
        return self._st_get("pending")

    @property
    def backend(self) -> str:
        return self._ops.name

    def use_backend(self, backend: str) -> "HashStore":
        """Switches between the native and torch code paths; the layout is shared, nothing is copied."""
        self._set_backend(_pick_backend(backend, self.device))
        return self

    def _set_backend(self, backend: str) -> None:
        self._ops = NativeOps() if backend == "native" else TorchOps()
        self._state_row = None  # (init_state, its one-row template) for find_or_insert_many

    def storage(self) -> torch.Tensor:
        return self._storage

    def block_rows(self):
        """``(block, first_row)`` while this store's rows are a view of a
        :class:`~hugeembed.store._hash_group.DynamicRows` block (an EmbeddingCollection joins a
        GPU's dynamic tables so), else None."""
        return DynamicRows.rows_of(self)

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one custom op in the graph (store/_ops.py), this method inside
            return _ops.find_or_insert_op(self, keys, step, counts)
        keys = as_keys(self.name, keys, self.device)
        step = check_step(self.name, step)
        counts = as_counts(self.name, counts, keys.numel(), self.device)
        if keys.numel() == 0:
            return keys.clone()
        if self.admit_probability is not None and self.admit_probability < 1.0:
            return self._find_or_insert_sampled(keys, step, counts)
        out = self._find_or_insert(keys, step, counts)
        self.forget_pending(step)
        return out

    def _find_or_insert_sampled(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None) -> torch.Tensor:
        """find_or_insert under the probability filter: only keys with a row or drawn this time go in."""
        ordered = keys.sort().values
        dup = ordered[1:][ordered.diff() == 0]
        if dup.numel():  # refused as the kernel refuses it, before anything changes
            raise InputError(f"table '{self.name}': key {int(dup[0])} is given twice to find_or_insert; "
                             "keys must be unique (deduplicate the batch first)")
        take = (self._ops.find(self, keys, rows_only=True) >= 0) | admission_draw(
            keys, step, self.seed, self.admit_probability)
        out = torch.full_like(keys, -1)
        if bool(take.any()):
            sub = keys[take] if not bool(take.all()) else keys
            out[take] = self._find_or_insert(sub, step, None if counts is None else counts[take])
        return out

    def _find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None) -> torch.Tensor:
        limit = self._row_limit
        evicted = grown = False
        while True:
            rc, out, new_slots, new_keys, need = self._ops.find_or_insert(self, keys, counts, step, limit)
            if rc == Outcome.DONE:
                if self.has_rows:  # a key index's rows are made by its tier
                    init_rows(self._storage, new_slots, new_keys, self.layout, self.initializer, self.init_state,
                              self.seed)
                return out
            if rc == Outcome.DUPLICATE_KEY:
                raise InputError(f"table '{self.name}': key {need[0]} is given twice to find_or_insert; "
                                 "keys must be unique (deduplicate the batch first)")
            if rc == Outcome.MUST_GROW and not grown:  # grow exactly as needed, then probe again
                self._grow_for(need[0], need[1])
                grown = True
            elif rc == Outcome.OVER_LIMIT:
                self._make_room(step, need[1], out, evicted)
                evicted, grown = True, False
            else:
                raise StoreError(f"table '{self.name}': find_or_insert kernel failed with code {rc} (internal error)")

    # Tables with more keys than this in one call take their own find_or_insert, whose
    # probe and row initialisation split over the threads (find_or_insert_many runs each
    # table on one thread: right for a collection's many small per-table batches).
    _BATCH_MAX_KEYS = 1 << 16

    def _batch_row(self, keys: torch.Tensor, counts: torch.Tensor | None, out: torch.Tensor | None = None):
        """This store's part of a find_or_insert_many call and its output tensor (`out` if
        given: contiguous int64 of the keys' length), or None
        when it takes the single-table path (torch backend, an initializer without a kernel,
        an init_state not marked row_independent, a large batch)."""
        if self._ops.name != "native" or not self.has_rows or not 0 < keys.numel() <= self._BATCH_MAX_KEYS or \
                (self.admit_probability is not None and self.admit_probability < 1.0):
            return None
        spec = self.initializer._native_spec()
        if (spec is None or self.layout.packed or self._storage.dtype != torch.float32
                or not self._storage.is_contiguous()):  # the kernel writes float32 weights then state
            return None
        state_row = None
        if self.state_width:
            state_row = self._state_template()
            if state_row is None:
                return None
        kind, params = spec
        return self._ops.batch_row(self, keys, counts, self._row_limit, kind, params, _signed(self.seed), state_row,
                                   out)

    def _state_template(self) -> torch.Tensor | None:
        """One row of the optimizer state a new row starts with, or None when init_state is not
        marked row_independent.  Cached per init_state (the attribute may be reassigned)."""
        if self._state_row is None or self._state_row[0] is not self.init_state:
            if not getattr(self.init_state, "row_independent", self.init_state is None):
                return None
            row = torch.zeros(1, self.state_width, dtype=torch.float32)
            if self.init_state is not None:
                self.init_state(row)
            self._state_row = (self.init_state, row)
        return self._state_row[1]

    def _make_room(self, step: int, needed: int, codes: torch.Tensor, retried: bool) -> None:
        cap, live = self.capacity, len(self)
        msg = f"table '{self.name}': capacity {cap} rows reached ({live} live); this batch needs {needed} new rows"
        if self.on_full == "error" or needed > cap or retried:
            raise CapacityError(msg + (" and on_full='error'" if self.on_full == "error" else ""))
        target = max(0, cap - needed - cap // AUTO_EVICT_SLACK)
        self.evict(step, max_rows=target, protect=codes[codes >= 0])
        if len(self) + needed > cap:
            raise CapacityError(msg + f"; only {cap - len(self)} could be freed without evicting rows of this batch"
                                + (f" or of the {len(self._pins)} batches whose backward has not run (pinned)"
                                   if len(self._pins) else ""))

    def forget_pending(self, step: int) -> int:
        """Forgets the least seen pending keys while more than `max_pending` wait; returns how many."""
        if self.admit_min_count == 1:  # no counter filter, no new pending keys (and no tensor read per call)
            return 0
        n = pending_victims(self.num_pending, self.max_pending)
        if n:
            self._evict(step, None, None, self.eviction_policy, None, None, n)
        return n

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _ops.find_op(self, keys)
        keys = as_keys(self.name, keys, self.device)
        if keys.numel() == 0:
            return keys.clone()
        return self._ops.find(self, keys, rows_only=True)

    def hit_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """Hits of `keys` so far (admitted or pending; 0 for an unknown key), int64; changes nothing.

        One probe of the shared bucket array with torch ops, whatever the backend: the
        per-row learning-rate scaling reads it once per table and step (TableConfig.lr_count_scale).
        """
        keys = as_keys(self.name, keys, self.device)
        codes, pos = probe(self._buckets, keys)
        out = torch.where(codes != -1, count_of(self._buckets[pos.clamp(min=0), 1]), 0)
        side = keys == EMPTY
        if bool(side.any()):
            out[side] = int(count_of(self._st[_ST["side_word1"]])) if self._st_get("side_used") else 0
        return out

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self._storage, as_slots(self.name, slots, self._storage.shape[0], self.device))

    @direct_write
    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        scatter_rows(self.name, self._storage, as_slots(self.name, slots, self._storage.shape[0], self.device), rows)

    # ------------------------------------------------------------- eviction
    def _entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, codes, counts, last steps) of every stored key, the side record included."""
        rec = entries(self._buckets)
        if self._st_get("side_used"):
            side = torch.tensor([[EMPTY, self._st_get("side_word1"), self._st_get("side_last")]], device=self.device)
            rec = torch.cat([rec, side])
        return rec[:, 0], code_of(rec[:, 1]), count_of(rec[:, 1]), rec[:, 2]

    def evict(self, step: int, ttl: int | None = None, max_rows: int | None = None, policy: str | None = None,
              protect: torch.Tensor | None = None, min_norm: float | None = None) -> int:
        """Removes rows unseen for more than `ttl` steps, rows whose weight L2 norm is below
        `min_norm`, then the least valuable ones down to `max_rows` (policy "lfu" or "lru";
        default the table's eviction_policy), never the slots in `protect` nor pinned ones.
        Returns rows removed.

        Pending (not admitted) keys unseen for more than `ttl` steps are dropped too.
        Freed slots are reused by later inserts, smallest first.
        """
        policy = self.eviction_policy if policy is None else policy
        return self._evict(step, ttl, max_rows, policy, protect, min_norm, 0)

    def _evict(self, step, ttl, max_rows, policy, protect, min_norm, pending_excess) -> int:
        keys, codes, counts, lasts = self._entries()
        rows = codes >= 0
        row_slots_all = codes[rows]
        norms = None
        if min_norm is not None:
            norms = self.row_norms(row_slots_all) if self.row_norms is not None else \
                self.weights()[row_slots_all].float().norm(dim=1)  # typed: 16-bit weights are packed
        gone_rows, gone_pend = select_victims(self.name, step, ttl, max_rows, policy, self._pins.protect(protect),
                                              self._storage.shape[0], keys[rows], row_slots_all, counts[rows],
                                              lasts[rows], keys[~rows], counts[~rows], lasts[~rows],
                                              row_norms=norms, min_norm=min_norm, pending_excess=pending_excess)
        row_keys, row_slots = keys[rows][gone_rows], row_slots_all[gone_rows]
        pend_keys = keys[~rows][gone_pend]
        gone = torch.cat([row_keys, pend_keys])
        if gone.numel():
            self._ops.erase(self, gone)
            self._free_rows(row_slots)
            self._st_add("rows", -row_slots.numel())
            self._st_add("pending", -pend_keys.numel())
        if row_slots.numel():
            self._pins.epoch += 1
        return row_slots.numel()

    @direct_write
    def remove(self, keys: torch.Tensor) -> int:
        """Removes `keys` (admitted or pending) and frees their rows; returns rows freed.

        What applying a snapshot delta needs: the keys an eviction removed in the saved run.
        Every key must be present and given once (InputError naming the first that is not);
        refused while batches in flight hold rows (their slots would move).  Checked before
        anything changes.  Freed slots are reused by later inserts, smallest first.

        Example::

            >>> store.remove(torch.tensor([17, 99]))    # 17 had a row, 99 was pending
            1
        """
        keys = as_keys(self.name, keys, self.device)
        self._refuse_if_pinned("remove keys")
        if keys.numel() == 0:
            return 0
        ordered = keys.sort().values
        dup = ordered[1:][ordered.diff() == 0]
        if dup.numel():
            raise InputError(f"table '{self.name}': key {int(dup[0])} is given twice to remove")
        codes = self._ops.find(self, keys)  # slot >= 0, PENDING, or -1 when absent
        absent = keys[codes == -1]
        if absent.numel():
            raise InputError(f"table '{self.name}': cannot remove key {int(absent[0])}: it is neither admitted nor "
                             f"pending ({absent.numel()} of the {keys.numel()} keys are absent)")
        slots = codes[codes >= 0]
        self._ops.erase(self, keys)
        self._free_rows(slots)
        self._st_add("rows", -slots.numel())
        self._st_add("pending", -(keys.numel() - slots.numel()))
        if slots.numel():  # as evict: a slot released before now may hold another key later
            self._pins.epoch += 1
        return slots.numel()

    # ------------------------------------------------------- export / import
    def export(self) -> StoreExport:
        return self.export_index().gather(self._storage)

    def export_index(self) -> ExportIndex:
        keys, codes, counts, lasts = self._entries()
        order = keys.argsort()
        keys, codes, counts, lasts = keys[order], codes[order], counts[order], lasts[order]
        r = codes >= 0
        return ExportIndex(keys[r], codes[r], counts[r], lasts[r], keys[~r], counts[~r], lasts[~r])

    @direct_write
    def import_(self, export: StoreExport) -> None:
        """Loads `export` (existing keys are overwritten, others kept); rows are taken in export order."""
        exp = export.to(self.device)
        if self.has_rows:  # a key index takes rows of zero width
            check_import_rows(self.name, self.layout, exp.rows)
        self._refuse_if_pinned("import")
        allk = torch.cat([exp.keys, exp.pending_keys])
        if allk.numel() > 1 and bool((allk.sort().values.diff() == 0).any()):
            raise InputError(f"table '{self.name}': import holds a key twice")
        if allk.numel() == 0:
            return
        present = self._ops.find(self, allk)
        n = exp.keys.numel()
        after = len(self) - int((present >= 0).sum()) + n
        if self.capacity is not None and after > self.capacity:
            raise CapacityError(f"table '{self.name}': import needs {after} rows, capacity is {self.capacity}")
        old = present != -1
        if bool(old.any()):
            oc = present[old]
            self._ops.erase(self, allk[old])
            self._free_rows(oc[oc >= 0])
            self._pins.epoch += 1  # existing keys get new slots: a released batch's slots are stale
            self._st_add("rows", -int((oc >= 0).sum()))
            self._st_add("pending", -int((oc < 0).sum()))
        self._reserve(allk.numel())
        slots = self._take_rows(n)
        codes = torch.cat([slots, torch.full_like(exp.pending_keys, PENDING)])
        self._ops.insert(self, allk, codes, torch.cat([exp.counts, exp.pending_counts]),
                         torch.cat([exp.last_step, exp.pending_last_step]))
        if self.has_rows:  # a key index's tier writes the rows
            self._storage[slots] = exp.rows.to(self.layout.storage_dtype)
        self._st_add("rows", n)
        self._st_add("pending", exp.pending_keys.numel())

    # --------------------------------------------------------------- memory
    def _arrays(self) -> dict[str, torch.Tensor]:
        return {"_storage": self._storage, "_buckets": self._buckets, "_free": self._free, "_st": self._st}

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held, by purpose.  `index`: key + code of each bucket (12 B); `row_metadata`:
        hit count + last step (12 B per bucket, kept in the bucket record beside the key);
        `storage`: rows incl. those allocated ahead of use."""
        nb = self.num_buckets
        return {"storage": self._storage.numel() * self._storage.element_size(), "index": 12 * nb,
                "row_metadata": 12 * nb, "free_rows": self._free.numel() * 4, "scalars": self._st.numel() * 8}

    def memory_bytes(self) -> int:
        return sum(self.memory_breakdown().values())

    def index_overhead_bytes(self) -> int:
        """Bytes beyond the weights + state of the live rows (index, metadata, spare rows)."""
        return self.memory_bytes() - len(self) * self.width * self._storage.element_size()

    def __setstate__(self, state: dict) -> None:
        # a copy (copy.copy, deepcopy, pickle) is a store of its own for the compiled ops too:
        # with the original's handle, a compiled find_or_insert on the copy would insert into it
        self.__dict__.update(state)
        self._op_handle, self._op_version = _ops.register(self)

    def to(self, device: torch.device | str) -> "HashStore":
        """A copy of this store on `device` (native backend on CPU when available)."""
        device = canonical_device(device)
        out = HashStore.__new__(HashStore)
        out.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_")})
        out.device = device
        out._op_handle, out._op_version = _ops.register(out)
        out._pins = PinnedRows()  # pins name slots of this store's batches, not of the copy's
        for attr, v in self._arrays().items():
            if attr == "_st":
                setattr(out, attr, v.clone())
            else:
                t = _alloc.empty(tuple(v.shape), v.dtype, device)
                t.copy_(v)
                setattr(out, attr, t)
        out._set_backend(_pick_backend(None, device))
        return out

    def __repr__(self) -> str:
        return (f"HashStore(name={self.name!r}, dim={self.dim}, state_width={self.state_width}, rows={len(self)}, "
                f"pending={self.num_pending}, buckets={self.num_buckets}, backend={self.backend!r}, "
                f"device={self.device})")



def find_or_insert_many(stores, keys, step: int, counts=None, out=None, keys_checked: bool = False) -> list[torch.Tensor]:
    """``[store.find_or_insert(k, step, counts=c) for ...]`` over many distinct stores at once.

    Native HashStores run in one kernel call, the tables spread over the threads (a
    collection's per-table batches are each too small to split): new rows initialised
    there too; native static ArrayStores in one more (slot = key, hits counted).  Every
    other store, and any table that must grow, evict or raise first, takes its own
    find_or_insert; results and errors are those of the loop above.

    `out`: optional int64 tensors (one per store, each of its keys' length, or None) the
    slots are written into; the result holds them (no copy on the native paths).
    `keys_checked`: the caller vouches that static tables' keys are in range and counts >= 1
    (a collection's, from its prepare): the static tables without kernels (a GPU's) then skip
    their range check, a read of the device.
    """
    stores, keys = list(stores), list(keys)
    counts = [None] * len(stores) if counts is None else list(counts)
    outs = [None] * len(stores) if out is None else list(out)
    if not len(stores) == len(keys) == len(counts) == len(outs):
        raise InputError(f"find_or_insert_many: {len(stores)} stores, {len(keys)} key tensors, {len(counts)} counts, "
                         f"{len(outs)} outputs")
    for s in stores:
        if not hasattr(s, "find_or_insert"):
            raise InputError(f"find_or_insert_many: {type(s).__name__} is not a row store")
    # by store and by scratch buffers (a copy.copy of a store shares its backend's)
    if len({id(s) for s in stores}) != len(stores) or \
            len({id(s._ops) for s in stores if isinstance(s, HashStore)}) != sum(isinstance(s, HashStore) for s in stores):
        raise InputError("find_or_insert_many: a store is given twice (itself or a shallow copy); merge its keys first")
    try:
        step = int(step) if not isinstance(step, bool) else None
    except (TypeError, ValueError):
        step = None
    if step is None:
        raise InputError("find_or_insert_many: step must be an int")
    got: list[torch.Tensor | None] = [None] * len(stores)
    batch, rows, touched, touch_rows = [], [], [], []
    for i, s in enumerate(stores):
        o = outs[i]
        if o is not None and not (o.dtype == torch.int64 and o.is_contiguous() and o.shape == (keys[i].numel(),)
                                  and o.device == s.device):
            o = None  # a buffer the kernels cannot write: the result is copied into it below
        if isinstance(s, HashStore):
            k = as_keys(s.name, keys[i], s.device)
            c = counts[i]
            if c is not None:  # shape / dtype / device here; the kernel checks the values (BAD_COUNT)
                c = as_counts(s.name, c, k.numel(), s.device, check_values=False)
            keys[i], counts[i] = k, c
            row = s._batch_row(k, c, o)
            if row is not None:
                batch.append((i, row[1]))
                rows.append(row[0])
        elif isinstance(s, ArrayStore) and keys[i].device.type == "cpu":
            k = as_keys(s.name, keys[i], s.device)
            c = counts[i]
            if c is not None:
                c = as_counts(s.name, c, k.numel(), s.device, check_values=False)
            o = o if o is not None else torch.empty_like(k)
            row = s._touch_row(k, c, o)
            if row is not None:
                touched.append((i, o))
                touch_rows.append(row)
    if len(batch) > 1:
        for (i, codes), rc in zip(batch, run_batch(rows, step)):
            if rc == Outcome.DONE:
                got[i] = codes
                stores[i].forget_pending(step)
    if touch_rows:
        bad = touch_many(touch_rows, step)
        if bad is not None:  # nothing written to any static table: the bad one raises with the details
            i = touched[bad][0]
            stores[i].find_or_insert(keys[i], step, counts=counts[i])
            raise StoreError(f"table '{stores[i].name}': he_array_touch_many refused keys find_or_insert takes "
                             "(internal error)")
        for i, o in touched:
            got[i] = o
    _touch_static_on_device(stores, keys, counts, outs, step, got, keys_checked)
    _find_or_insert_torch_tables(stores, keys, counts, outs, step, got)
    for i, s in enumerate(stores):
        if got[i] is None:
            got[i] = s.find_or_insert(keys[i], step, counts=counts[i])
        if outs[i] is not None and got[i] is not outs[i]:
            outs[i].copy_(got[i])
            got[i] = outs[i]
    return got


def find_many(stores, keys) -> list[torch.Tensor]:
    """``[store.find(k) for ...]`` over many distinct stores: torch-backend hash tables (a GPU's
    dynamic tables) probe in one loop (store/_hash_group.py), every other store alone."""
    stores, keys = list(stores), list(keys)
    if len(stores) != len(keys):
        raise InputError(f"find_many: {len(stores)} stores, {len(keys)} key tensors")
    for s in stores:
        if not hasattr(s, "find"):
            raise InputError(f"find_many: {type(s).__name__} is not a row store")
    together = [i for i, s in enumerate(stores) if type(s) is HashStore and s._ops.name == "torch"]
    if len(together) < 2 or len({stores[i].device for i in together}) != 1 or \
            len({id(stores[i]._ops) for i in together}) != len(together):
        together = []
    got: list[torch.Tensor | None] = [None] * len(stores)
    if together:
        ks = [as_keys(stores[i].name, keys[i], stores[i].device) for i in together]
        for i, g in zip(together, find_group([stores[i] for i in together], ks)):
            got[i] = g
    return [g if g is not None else s.find(k) for s, k, g in zip(stores, keys, got)]


def _find_or_insert_torch_tables(stores, keys, counts, outs, step: int, got: list) -> None:
    """find_or_insert of the torch-backend hash tables (a GPU's dynamic tables) in one pass
    (store/_hash_group.py), into `got`; a table that must grow, evict or raise is left to
    its own call (its `got` stays None)."""
    todo = [i for i, s in enumerate(stores) if got[i] is None and type(s) is HashStore and s._ops.name == "torch"
            and s.has_rows and (s.admit_probability is None or s.admit_probability >= 1.0)]
    if len(todo) < 2 or len({stores[i].device for i in todo}) != 1:
        return
    step = check_step(stores[todo[0]].name, step)
    ks = [as_keys(stores[i].name, keys[i], stores[i].device) for i in todo]
    cs = [None if counts[i] is None else as_counts(stores[i].name, counts[i], k.numel(), stores[i].device,
                                                   check_values=False) for i, k in zip(todo, ks)]
    for i, g in zip(todo, find_or_insert_group([stores[i] for i in todo], ks, cs, step)):
        got[i] = g
    write_into(outs, got, todo)


def _touch_static_on_device(stores, keys, counts, outs, step: int, got: list, checked: bool = False) -> None:
    """find_or_insert of the static tables the kernels did not take (on a GPU), into `got`.

    Their range and count checks read the device once for all of them, not once per table;
    when one fails, that table's own find_or_insert raises (naming the key) before any table
    has changed.  Tables whose rows share a RowBlock are checked and counted together, with
    one op each for all of them.
    """
    todo = [i for i, s in enumerate(stores) if got[i] is None and isinstance(s, ArrayStore)]
    if len(todo) < 2 or len({stores[i].device for i in todo}) != 1:
        return
    ks = {i: as_keys(stores[i].name, keys[i], stores[i].device) for i in todo}
    cs = {i: None if counts[i] is None else as_counts(stores[i].name, counts[i], ks[i].numel(), stores[i].device,
                                                      check_values=False) for i in todo}
    step = check_step(stores[todo[0]].name, step)
    by_block: dict[int, list[int]] = {}
    alone = []
    for i in todo:
        b = stores[i].block_rows() if type(stores[i]) is ArrayStore else None  # a shard is no block's
        (alone if b is None else by_block.setdefault(id(b[0]), [])).append(i)
    groups = [g for g in by_block.values() if len(g) > 1]
    alone += [i for g in by_block.values() if len(g) == 1 for i in g]
    joined = [_joined_touch(stores, g, ks, cs, checked) for g in groups]
    if not checked and bool(torch.stack([j[-1] for j in joined] + [stores[i]._invalid(ks[i], cs[i])
                                         for i in alone]).any()):  # the one host sync
        bad = torch.stack([stores[i]._invalid(ks[i], cs[i]) for i in todo])
        i = todo[int(bad.to(torch.uint8).argmax())]
        stores[i].find_or_insert(keys[i], step, counts=counts[i])
        raise StoreError(f"table '{stores[i].name}': its keys failed the batched check but not its own (internal "
                         "error)")
    for g, (block, keys_all, slots, hits, _) in zip(groups, joined):
        block.meta[:, 0].index_add_(0, slots, hits)
        block.meta[slots, 1] = step
        # a static table's slot is its key: into the caller's buffers when they lie end to end
        # (a collection's do: one copy), else into one new tensor
        region = joined_view([outs[i] if outs[i] is not None and outs[i].dtype == torch.int64 and
                              outs[i].shape == ks[i].shape and outs[i].device == ks[i].device else None for i in g])
        if region is not None:
            region.copy_(keys_all)
            for i in g:
                got[i] = outs[i]
        else:
            for i, own in zip(g, keys_all.clone().split([ks[i].numel() for i in g])):
                got[i] = own
    for i in alone:
        got[i] = stores[i]._touch(ks[i], step, cs[i])


def _joined_touch(stores, members: list[int], ks: dict, cs: dict, checked: bool = False):
    """For static tables of one RowBlock: (block, their keys joined, the keys' rows in the block,
    their counts joined, a 0-d bool: some key out of range or count < 1; None when `checked`)."""
    block = stores[members[0]].block_rows()[0]
    dev = block.meta.device
    sizes = [ks[i].numel() for i in members]
    keys_all = joined([ks[i] for i in members])  # a collection's keys and counts are parts of one tensor
    hits = joined([cs[i] if cs[i] is not None else torch.ones_like(ks[i]) for i in members])
    bad = None
    if not checked:
        limit = repeat_each([stores[i].num_rows for i in members], sizes, dev)
        bad = ((keys_all < 0) | (keys_all >= limit)).any() | (hits < 1).any()
    slots = keys_all + repeat_each([stores[i].block_rows()[1] for i in members], sizes, dev)
    return block, keys_all, slots, hits, bad

