"""DictStore: the plain-dict oracle of the dynamic store (slow, obviously correct).

Same contract and the same deterministic choices as HashStore -- row slots handed
out in batch order, smallest free slot first; eviction order by (count, last step,
key) or (last step, count, key) -- written as per-key Python loops over dicts, so
tests can compare every slot, row and counter of the fast stores against it.
"""

from __future__ import annotations

import heapq
import sys

import torch

from .._device import canonical_device
from ..errors import CapacityError, ConfigError, InputError
from ._admit import DEFAULT_MAX_PENDING, admission_draw, check_admission, pending_victims
from ._common import (as_counts, as_keys, as_slots, check_step, check_table_config, direct_write, gather_rows,
                      make_layout, scatter_rows)
from ._evict import check_evict_args
from ._init import Initializer, default_initializer
from ._layout import LayoutViews, RowLayout, check_import_rows
from ._pins import Pinnable, PinnedRows
from ._protocol import ExportIndex, StoreExport

__all__ = ["DictStore"]


class DictStore(LayoutViews, Pinnable):
    """Dynamic key -> row store on Python dicts; constructor as HashStore (minus backend)."""

    def __init__(self, name: str, dim: int, state_width: int = 0, *, initializer: Initializer | None = None,
                 init_state=None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 capacity: int | None = None, on_full: str = "evict", eviction_policy: str = "lfu",
                 admit_min_count: int = 1, seed: int = 0, initial_rows: int = 0,
                 admit_probability: float | None = None, max_pending: int | None = None,
                 layout: RowLayout | None = None):
        if initializer is None and isinstance(dim, int) and dim > 0:
            initializer = default_initializer(dim)
        check_table_config(name, dim, state_width, dtype, initializer)
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ConfigError(f"table '{name}': capacity must be a positive int or None, got {capacity!r}")
        if on_full not in ("evict", "error") or eviction_policy not in ("lfu", "lru"):
            raise ConfigError(f"table '{name}': bad on_full {on_full!r} or eviction_policy {eviction_policy!r}")
        check_admission(name, admit_min_count, admit_probability, max_pending)
        self.layout = make_layout(name, dim, state_width, dtype, layout)
        self.name, self.dim, self.state_width, self.width = name, dim, state_width, self.layout.width
        self.dtype, self.device = dtype, canonical_device(device)
        self.initializer, self.init_state, self.seed = initializer, init_state, int(seed)
        self.capacity, self.on_full, self.eviction_policy = capacity, on_full, eviction_policy
        self.admit_min_count, self.admit_probability = admit_min_count, admit_probability
        self.max_pending = DEFAULT_MAX_PENDING if max_pending is None else max_pending
        self._pins = PinnedRows()
        self._slot: dict[int, int] = {}  # key -> slot
        self._key: dict[int, int] = {}  # slot -> key
        self._count: dict[int, int] = {}  # slot -> hits
        self._last: dict[int, int] = {}  # slot -> last step
        self._pending: dict[int, list[int]] = {}  # key -> [hits, last step]
        self._free: list[int] = []  # min-heap of free slots
        self._hwm = 0
        self._storage = torch.zeros(0, self.width, dtype=self.layout.storage_dtype, device=self.device)

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def storage(self) -> torch.Tensor:
        return self._storage

    def _alloc(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._hwm += 1
        return self._hwm - 1

    def _fill(self, slots: list[int], keys: list[int]) -> None:
        if not slots:
            return
        if self._hwm > self._storage.shape[0]:
            grown = torch.zeros(max(self._hwm, 2 * self._storage.shape[0]), self.width, dtype=self._storage.dtype,
                                device=self.device)
            grown[: self._storage.shape[0]] = self._storage
            self._storage = grown
        s = torch.tensor(slots, dtype=torch.int64, device=self.device)
        k = torch.tensor(keys, dtype=torch.int64, device=self.device)
        lay = self.layout
        lay.weights(self._storage)[s] = self.initializer.generate(k, self.dim, self.seed).to(self.dtype)
        state = torch.zeros(len(slots), self.state_width, dtype=lay.state_dtype, device=self.device)
        if self.state_width and self.init_state is not None:
            self.init_state(state)
        lay.state(self._storage)[s] = state

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        keys_t = as_keys(self.name, keys, self.device)
        step = check_step(self.name, step)
        counts_t = as_counts(self.name, counts, keys_t.numel(), self.device)
        ks = keys_t.tolist()
        cs = counts_t.tolist() if counts_t is not None else [1] * len(ks)
        if len(set(ks)) != len(ks):
            dup = next(k for i, k in enumerate(ks) if k in ks[:i])
            raise InputError(f"table '{self.name}': key {dup} is given twice to find_or_insert; keys must be unique")
        if self.admit_probability is not None and self.admit_probability < 1.0 and ks:
            drawn = admission_draw(keys_t, step, self.seed, self.admit_probability).tolist()
            take = [i for i, k in enumerate(ks) if k in self._slot or drawn[i]]
            out = torch.full((len(ks),), -1, dtype=torch.int64, device=self.device)
            if take:
                idx = torch.tensor(take, dtype=torch.int64, device=self.device)
                out[idx] = self._find_or_insert(step, [ks[i] for i in take], [cs[i] for i in take])
            return out
        out = self._find_or_insert(step, ks, cs)
        excess = pending_victims(len(self._pending), self.max_pending)
        if excess:  # forget the least seen pending keys: fewest hits, then oldest, then smallest key
            for key in sorted(self._pending, key=lambda k: (self._pending[k][0], self._pending[k][1], k))[:excess]:
                del self._pending[key]
        return out

    def _find_or_insert(self, step: int, ks: list[int], cs: list[int]) -> torch.Tensor:
        k_min = self.admit_min_count
        needed = 0
        for key, c in zip(ks, cs):
            if key in self._slot:
                continue
            have = self._pending[key][0] if key in self._pending else 0
            needed += have + c >= k_min
        cap = self.capacity
        if cap is not None and len(self) + needed > cap:
            msg = f"table '{self.name}': capacity {cap} rows reached; this batch needs {needed} new rows"
            if self.on_full == "error" or needed > cap:
                raise CapacityError(msg)
            protect = [self._slot[k] for k in ks if k in self._slot]
            self.evict(step, max_rows=max(0, cap - needed - cap // 64),
                       protect=torch.tensor(protect, dtype=torch.int64, device=self.device))
            if len(self) + needed > cap:
                raise CapacityError(msg)
        out, new_slots, new_keys = [], [], []
        for key, c in zip(ks, cs):
            if key in self._slot:
                s = self._slot[key]
                self._count[s] += c
                self._last[s] = step
                out.append(s)
                continue
            hits = self._pending.pop(key, [0, 0])[0] + c
            if hits >= k_min:
                s = self._alloc()
                self._slot[key], self._key[s], self._count[s], self._last[s] = s, key, hits, step
                new_slots.append(s)
                new_keys.append(key)
                out.append(s)
            else:
                self._pending[key] = [hits, step]
                out.append(-1)
        self._fill(new_slots, new_keys)
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        ks = as_keys(self.name, keys, self.device).tolist()
        return torch.tensor([self._slot.get(k, -1) for k in ks], dtype=torch.int64, device=self.device)

    def hit_counts(self, keys: torch.Tensor) -> torch.Tensor:
        """Hits of `keys` so far (admitted or pending; 0 for an unknown key); changes nothing."""
        ks = as_keys(self.name, keys, self.device).tolist()
        out = [self._count[self._slot[k]] if k in self._slot else self._pending.get(k, [0])[0] for k in ks]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self._storage, as_slots(self.name, slots, self._storage.shape[0], self.device))

    @direct_write
    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        scatter_rows(self.name, self._storage, as_slots(self.name, slots, self._storage.shape[0], self.device), rows)

    def _drop_row(self, s: int) -> None:
        del self._slot[self._key.pop(s)]
        del self._count[s], self._last[s]
        heapq.heappush(self._free, s)

    def evict(self, step: int, ttl: int | None = None, max_rows: int | None = None, policy: str | None = None,
              protect: torch.Tensor | None = None, min_norm: float | None = None) -> int:
        policy = self.eviction_policy if policy is None else policy
        step = check_evict_args(self.name, step, ttl, max_rows, policy, min_norm)
        protect = self._pins.protect(protect)
        prot = set(as_keys(self.name, protect, self.device, "protect").tolist()) if protect is not None else set()
        gone = set()
        if ttl is not None:
            gone = {s for s in self._key if step - self._last[s] > ttl and s not in prot}
            for key in [k for k, (_, last) in self._pending.items() if step - last > ttl]:
                del self._pending[key]
        if min_norm is not None:
            for s in self._key:
                norm = float(torch.linalg.vector_norm(self.weights()[s].double()))
                if norm < min_norm and s not in prot:
                    gone.add(s)
        if max_rows is not None:
            alive = [s for s in self._key if s not in gone]
            excess = len(alive) - max_rows
            if excess > 0:
                if policy == "lfu":
                    order = lambda s: (self._count[s], self._last[s], self._key[s])  # noqa: E731
                else:
                    order = lambda s: (self._last[s], self._count[s], self._key[s])  # noqa: E731
                gone |= set(sorted((s for s in alive if s not in prot), key=order)[:excess])
        for s in gone:
            self._drop_row(s)
        if gone:
            self._pins.epoch += 1
        return len(gone)

    @direct_write
    def remove(self, keys: torch.Tensor) -> int:
        """HashStore.remove: drops admitted and pending `keys` (all present, each once); returns rows freed."""
        ks = as_keys(self.name, keys, self.device).tolist()
        self._refuse_if_pinned("remove keys")
        seen = set()
        for k in ks:
            if k in seen:
                raise InputError(f"table '{self.name}': key {k} is given twice to remove")
            seen.add(k)
        absent = [k for k in ks if k not in self._slot and k not in self._pending]
        if absent:
            raise InputError(f"table '{self.name}': cannot remove key {absent[0]}: it is neither admitted nor "
                             f"pending ({len(absent)} of the {len(ks)} keys are absent)")
        freed = 0
        for k in ks:
            if k in self._slot:
                self._drop_row(self._slot[k])
                freed += 1
            else:
                del self._pending[k]
        if freed:
            self._pins.epoch += 1
        return freed

    def export(self) -> StoreExport:
        return self.export_index().gather(self._storage)

    def export_index(self) -> ExportIndex:
        keys = sorted(self._slot)
        pk = sorted(self._pending)
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        return ExportIndex(t(keys), t([self._slot[k] for k in keys]), t([self._count[self._slot[k]] for k in keys]),
                           t([self._last[self._slot[k]] for k in keys]), t(pk),
                           t([self._pending[k][0] for k in pk]), t([self._pending[k][1] for k in pk]))

    @direct_write
    def import_(self, export: StoreExport) -> None:
        exp = export.to(self.device)
        check_import_rows(self.name, self.layout, exp.rows)
        self._refuse_if_pinned("import")
        keys, pkeys = exp.keys.tolist(), exp.pending_keys.tolist()
        if len(set(keys + pkeys)) != len(keys) + len(pkeys):
            raise InputError(f"table '{self.name}': import holds a key twice")
        after = len(self) - sum(k in self._slot for k in keys + pkeys) + len(keys)
        if self.capacity is not None and after > self.capacity:
            raise CapacityError(f"table '{self.name}': import needs {after} rows, capacity is {self.capacity}")
        for k in keys + pkeys:
            if k in self._slot:
                self._drop_row(self._slot[k])
                self._pins.epoch += 1
            self._pending.pop(k, None)
        slots = [self._alloc() for _ in keys]
        counts, lasts = exp.counts.tolist(), exp.last_step.tolist()
        for k, s, c, last in zip(keys, slots, counts, lasts):
            self._slot[k], self._key[s], self._count[s], self._last[s] = s, k, c, last
        self._fill(slots, keys)
        if slots:
            self._storage[torch.tensor(slots, device=self.device)] = exp.rows.to(self._storage.dtype)
        for k, c, last in zip(pkeys, exp.pending_counts.tolist(), exp.pending_last_step.tolist()):
            self._pending[k] = [c, last]

    def memory_bytes(self) -> int:
        dicts = (self._slot, self._key, self._count, self._last, self._pending)
        return self._storage.numel() * self._storage.element_size() + sum(sys.getsizeof(d) for d in dicts)

    def index_overhead_bytes(self) -> int:
        return self.memory_bytes() - len(self) * self.width * self._storage.element_size()

    def to(self, device: torch.device | str) -> "DictStore":
        out = DictStore.__new__(DictStore)
        out.__dict__.update({k: (v.copy() if isinstance(v, (dict, list)) else v) for k, v in self.__dict__.items()})
        out._pending = {k: list(v) for k, v in self._pending.items()}
        out.device = canonical_device(device)
        out._pins = PinnedRows()
        out._storage = self._storage.to(out.device, copy=True)
        return out
