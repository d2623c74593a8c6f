"""StaticGroup: the static tables of one row layout and device -- one rows tensor, rows by key.

The classic ``nn.Embedding`` layout (TorchRec's / FBGEMM's table-batched embedding: one buffer,
tables at offsets), with the same group interface as the dynamic tables'.  Table t's key k lives
at row ``first[t] + k // num_shards[t]`` (a table's share of a row-wise sharded table holds the keys
k with ``k mod num_shards == shard``; one process holds them all)::

    tables  a: 3 rows, b: 2 rows       rows  | a0 | a1 | a2 | b0 | b1 |      first = [0, 3]
    (table, key) (1, 1) -> row 4

Beside each row: its hit count and last step (``meta [R, 2]``).  Rows start as the table's
initializer makes them at each key (a dynamic table trained on ids [0, n) holds exactly these rows).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from .. import _native, _triton
from .._device import canonical_device
from ..errors import ConfigError, InputError, ShardingError
from . import _alloc
from ._init import init_rows_native
from ._group import GroupBase
from ._layout import check_import_rows
from ._pins import PinnedRows
from ._protocol import ExportIndex, StoreExport
from ._settings import TableSettings

__all__ = ["StaticGroup"]

_INIT_CHUNK = 1 << 20


class StaticGroup(GroupBase):
    """Static tables of one row layout on one device (see the module docstring).

    Args:
        tables: their settings (``num_rows`` set; one layout for all).
        device: where the rows live ("meta": shapes only, nothing initialised).
        rows: False makes the group a key index without rows (a tiered table's): the range checks
            and the per-row counts, no rows.
    """

    kind = "static"

    def __init__(self, tables: Sequence[TableSettings], *, device: torch.device | str = "cpu", rows: bool = True):
        tables = tuple(tables)
        if not tables or not all(t.static for t in tables):
            raise ConfigError(f"a static group takes static tables, got {[t.name for t in tables]}")
        lay = tables[0].layout
        for t in tables[1:]:
            if t.layout != lay:
                raise ConfigError(f"tables {tables[0].name!r} and {t.name!r} have different row layouts "
                                  f"({lay.describe()} vs {t.layout.describe()}): they cannot share a group")
        self.settings, self.layout, self.device, self.has_rows = tables, lay, canonical_device(device), bool(rows)
        sizes = [t.local_rows for t in tables]
        self.first = [0, *itertools.accumulate(sizes)][:-1]
        self.sizes = sizes
        R = sum(sizes)
        self.rows = _alloc.empty((R, lay.width if rows else 0), lay.storage_dtype, self.device)
        # (one row more: the sink the torch path's masked writes go to, so they need no read of the mask)
        self.meta = torch.zeros(R + 1, 2, dtype=torch.int64, device=self.device)
        # per table (first row, num_rows, shard, num_shards): the kernel's and the reference's
        self.info = torch.tensor([[f, t.num_rows, t.shard, t.num_shards] for f, t in zip(self.first, tables)],
                                 dtype=torch.int64)
        self._info_here = self.info.to(self.device)
        # the keys' ranges, when a prepare's proof covers every check of the fetch (no table is a row-wise shard)
        self.key_bounds = tuple(t.num_rows for t in tables) if all(t.num_shards == 1 for t in tables) else None
        self.pins = PinnedRows()  # static rows never move: pins are kept for the common interface
        if self.device.type != "meta" and rows:
            for t in range(len(tables)):
                self._init_table(t)

    def _init_table(self, t: int) -> None:
        s, lay = self.settings[t], self.layout
        n, first = self.sizes[t], self.first[t]
        for start in range(0, n, _INIT_CHUNK):
            end = min(n, start + _INIT_CHUNK)
            keys = torch.arange(start, end, device=self.device) * s.num_shards + s.shard
            block = self.rows[first + start : first + end]
            # the native initializer writes float32 weights: only into a plain layout's columns
            if lay.packed or not init_rows_native(s.initializer, keys, lay.dim, s.seed, block, None):
                lay.weights(block).copy_(s.initializer.generate(keys, lay.dim, s.seed))
            if lay.state_width:  # in place: no temporary as large as the block
                state = lay.state(block)
                state.zero_()
                if s.init_state is not None:
                    s.init_state(state)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def table_rows(self, t: int) -> int:
        return self.sizes[t]

    def table_view(self, t: int) -> torch.Tensor:
        """Table t's rows ``[local_rows, W]``: a view of the group's rows (row k // num_shards: key k)."""
        return self.rows[self.first[t] : self.first[t] + self.sizes[t]]

    def table_meta(self, t: int) -> torch.Tensor:
        return self.meta[self.first[t] : self.first[t] + self.sizes[t]]

    # ---------------------------------------------------------------- fetch
    def touch(self, tids: torch.Tensor, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None,
              out: torch.Tensor | None = None, unique: bool = True) -> torch.Tensor:
        """The training fetch: rows of (table, key) pairs (tids -1: skipped, row -1), each key's hit
        count grown by `counts` (1 each) and its last step set; every key checked first (a bad one
        raises naming the table and changes nothing).  `unique`: no key comes twice per table."""
        return self._rows_of(tids, keys, step, counts, out, True, unique)

    def fetch(self, tids: torch.Tensor, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None,
              out: torch.Tensor | None = None, hits: torch.Tensor | None = None,
              within: tuple[int | None, ...] | None = None) -> torch.Tensor:
        """The group interface's training fetch (:meth:`touch`); `hits`: each key's count after it.

        `within`: what the prepare that made the keys proved (functional Prepared.id_bounds, the group's
        tables' part): each table's keys in [0, within[t]), counts >= 1.  Where that is every table's own
        range (:attr:`key_bounds`), the keys are not checked again: on the GPU, no read of the device."""
        checked = within is not None and within == self.key_bounds
        out = self._rows_of(tids, keys, step, counts, out, True, True, checked)
        if hits is not None:
            hits.copy_(torch.where(out >= 0, self.meta[out.clamp(min=0), 0], 0))
        return out

    def find(self, tids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Rows of (table, key) pairs (checked), -1 for skipped entries; changes nothing."""
        return self._rows_of(tids, keys, 0, None, None, False, True)

    def expire(self, step: int, ttl: list, min_norm: list, protect=None) -> list[int]:
        """Static rows are never evicted."""
        return [0] * len(self.settings)

    def _rows_of(self, tids, keys, step, counts, out, count: bool, unique: bool, checked: bool = False) -> torch.Tensor:
        out = torch.empty_like(keys) if out is None else out
        if keys.numel() == 0:
            return out
        if self._on_triton():
            return self._rows_triton(tids, keys, step, counts, out, count, checked)
        if self.device.type == "cpu" and _native.available():
            try:
                _native.call("he_static_touch", [self.meta, self.info, keys, tids, counts, out],
                             [int(step), int(count), int(unique)])
                return out
            except _native.KernelError as e:
                if e.status != _native.Status.BAD_VALUE:
                    raise
                pos = e.detail[0]
                self._raise_bad(int(tids[pos]), int(keys[pos]), None if counts is None else int(counts[pos]))
        return self._rows_torch(tids, keys, step, counts, out, count, checked)

    def _on_triton(self) -> bool:
        """Whether the fetch runs on the triton kernels: CUDA rows when triton imports."""
        return self.device.type == "cuda" and _triton.available()

    def _rows_triton(self, tids, keys, step, counts, out, count: bool, checked: bool = False) -> torch.Tensor:
        """The GPU's: _rows_torch's contract in two kernels and the one read of the check (_triton/static_rows.py);
        `checked` (a prepare's proof covers the check): no check, no read."""
        from .._triton.static_rows import static_count, static_rows

        tids, keys = (x.to(torch.int64).contiguous() for x in (tids, keys))
        counts = None if counts is None else counts.to(torch.int64).contiguous()
        rows = out if out.is_contiguous() and out.dtype == torch.int64 else torch.empty_like(keys)
        bad = static_rows(tids, keys, counts, self._info_here, rows, check=not checked)
        if bad is not None:
            self._raise_bad(int(tids[bad]), int(keys[bad]), None if counts is None else int(counts[bad]))
        if count:
            static_count(rows, counts, self.meta, step)
        if rows is not out:
            out.copy_(rows)
        return out

    def _rows_torch(self, tids, keys, step, counts, out, count: bool, checked: bool = False) -> torch.Tensor:
        """The reference: the kernel's contract in torch ops (any device); `checked` as _rows_triton's."""
        sel = tids >= 0
        info = self._info_here[tids.clamp(min=0)]
        first, nrows, shard, shards = info.unbind(1)
        if not checked:
            bad = sel & ((keys < 0) | (keys >= nrows) | (keys % shards != shard))
            if counts is not None:
                bad |= sel & (counts < 1)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                self._raise_bad(int(tids[i]), int(keys[i]), None if counts is None else int(counts[i]))
        rows = torch.where(sel, first + torch.div(keys, shards, rounding_mode="floor"), -1)
        out.copy_(rows)
        if count:  # (the ids without a table count on the sink row: no read of how many there are)
            at = torch.where(sel, rows, self.meta.size(0) - 1)
            self.meta[:, 0].index_add_(0, at, counts if counts is not None else torch.ones_like(at))
            self.meta[:, 1].index_fill_(0, at, step)
        return out

    def _raise_bad(self, t: int, key: int, count: int | None):
        s = self.settings[t]
        if not 0 <= key < s.num_rows:
            raise InputError(f"table '{s.name}': key {key} is outside [0, {s.num_rows}) (num_rows={s.num_rows} of "
                             "this static table)")
        if key % s.num_shards != s.shard:
            raise ShardingError(f"table '{s.name}': key {key} does not belong to shard {s.shard} of {s.num_shards} "
                                f"(keys k with k mod {s.num_shards} == {s.shard}, k < {s.num_rows})")
        raise InputError(f"table '{s.name}': counts must be >= 1 (occurrences in the batch), got {count}")

    def hit_counts(self, tids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        rows = self.find(tids, keys)
        return torch.where(rows >= 0, self.meta[rows.clamp(min=0), 0], 0)

    # ---------------------------------------------------------------- edges
    def keys_of(self, t: int) -> torch.Tensor:
        """Table t's keys, ascending (row order)."""
        s = self.settings[t]
        return torch.arange(self.sizes[t], device=self.device) * s.num_shards + s.shard

    def export_index(self, t: int) -> ExportIndex:
        """Table t's export, its slots rows of ``table_view(t)``."""
        e = torch.empty(0, dtype=torch.int64, device=self.device)
        meta = self.table_meta(t)
        return ExportIndex(self.keys_of(t), torch.arange(self.sizes[t], device=self.device), meta[:, 0].clone(),
                           meta[:, 1].clone(), e, e.clone(), e.clone())

    def import_(self, t: int, export: StoreExport) -> None:
        """Writes the rows, counts and last steps of `export` (keys of table t) in place."""
        s = self.settings[t]
        exp = export.to(self.device)
        if self.has_rows:  # a key index takes rows of zero width
            check_import_rows(s.name, self.layout, exp.rows)
        if exp.pending_keys.numel():
            raise InputError(f"table '{s.name}': a static table admits every key; the import has "
                             f"{exp.pending_keys.numel()} pending keys")
        rows = self.find(torch.full_like(exp.keys, t), exp.keys) - self.first[t]
        if self.has_rows:  # a key index's tier writes the rows
            self.table_view(t)[rows] = exp.rows.to(self.layout.storage_dtype)
        meta = self.table_meta(t)
        meta[rows, 0] = exp.counts
        meta[rows, 1] = exp.last_step

    def check_import(self, t: int, export: StoreExport) -> None:
        """Raises what :meth:`import_` would raise for `export`, changing nothing."""
        s = self.settings[t]
        if self.has_rows:
            check_import_rows(s.name, self.layout, export.rows)
        if export.pending_keys.numel():
            raise InputError(f"table '{s.name}': a static table admits every key; the import has "
                             f"{export.pending_keys.numel()} pending keys")
        self.find(torch.full_like(export.keys, t), export.keys.to(self.device))

    def replace_table(self, t: int, export: StoreExport) -> None:
        """Table t's contents become `export`'s: its rows and counts, rows it lacks as new (initial
        rows, no hits)."""
        if export.keys.numel() != self.sizes[t]:  # rows the export lacks start afresh
            self.table_meta(t).zero_()
            if self.has_rows and self.device.type != "meta":
                self._init_table(t)
        self.import_(t, export)

    def renewed(self) -> "StaticGroup":
        """This group as a new object over the same rows (a load replaces its tables' contents in place:
        batches in flight see the group replaced)."""
        out = StaticGroup.__new__(StaticGroup)
        out.__dict__.update(self.__dict__)
        out.pins, out.__dict__["_views"] = PinnedRows(), {}
        return out

    def memory_breakdown(self) -> dict[str, int]:
        return {"rows": self.rows.numel() * self.rows.element_size(), "row_metadata": self.meta.numel() * 8}

    def memory_bytes(self) -> int:
        return sum(self.memory_breakdown().values())

    def table_memory_bytes(self, t: int) -> int:
        row = self.rows.shape[1] * self.rows.element_size() + 16
        return self.sizes[t] * row

    def to(self, device: torch.device | str) -> "StaticGroup":
        """A copy on `device`."""
        out = StaticGroup.__new__(StaticGroup)
        out.__dict__.update(self.__dict__)
        out.device = canonical_device(device)
        out.rows = _alloc.empty(tuple(self.rows.shape), self.rows.dtype, out.device)
        out.rows.copy_(self.rows)
        out.meta = self.meta.to(out.device, copy=True)
        out._info_here = self.info.to(out.device)
        out.pins, out.__dict__["_views"] = PinnedRows(), {}
        return out

    @property
    def _view_class(self):
        from ._views import StaticTable
        return StaticTable

    def __repr__(self) -> str:
        return f"StaticGroup(tables={self.names()}, rows={len(self)}, layout={self.layout.describe()}, device={self.device})"
