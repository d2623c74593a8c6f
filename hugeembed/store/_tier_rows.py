"""A tiered table's rows as a whole: read by logical slot, exported and imported in chunks.

The half of TieredStore that snapshots, deltas and global Adam's catch-up use (store/_tiered.py
holds the fetch path): rows are read from the cache where resident, else from the file, else
as a never-trained static row starts, and nothing of that reading changes residency or counts.
"""

from __future__ import annotations

import torch

from ..errors import InputError, StoreError
from ._common import direct_write, init_rows
from ._layout import check_import_rows
from ._protocol import ExportIndex, StoreExport

__all__ = ["TierTransfer", "TierRows"]

_CHUNK_ROWS = 1 << 16  # rows per chunk when streaming a table in or out


class TierTransfer:
    """Mixin of TieredStore: its whole-table reads and writes."""

    def read_logical(self, logical: torch.Tensor) -> torch.Tensor:
        """The current rows of logical slots (cache, else disk, else as a new row starts), copied;
        changes nothing (no residency, no count)."""
        self._fit_map()
        out = self.layout.empty(logical.numel())
        if logical.numel() == 0:
            return out
        cs = self._where[logical].to(torch.int64)
        res = cs >= 0
        if bool(res.any()):
            out[res] = self._rows.index_select(0, cs[res])
        disk = ~res & self._space.on_disk(logical)
        if bool(disk.any()):
            rec = self._space.records_of(logical[disk])
            order = rec.argsort()
            buf = self.layout.empty(rec.numel())
            self.file.read(rec[order], buf)
            part = torch.empty_like(buf)
            part[order] = buf
            out[disk] = part
        fresh = ~res & ~disk
        if bool(fresh.any()):  # a static table's row never trained: its initial value
            idx = fresh.nonzero().squeeze(1)
            init_rows(out, idx, self._keys_of_logical(logical[fresh]), self.layout, self.initializer,
                      self.init_state, self.seed)
        return out

    def _keys_of_logical(self, logical: torch.Tensor) -> torch.Tensor:
        if not self.index.settings.static:  # a dynamic table's rows are in the cache or on disk
            raise StoreError(f"table '{self.name}': logical slots {logical[:4].tolist()} hold no row (internal error)")
        return self.index.keys_of(logical)

    def _logical_norms(self, logical: torch.Tensor) -> torch.Tensor:
        out = torch.empty(logical.numel(), dtype=torch.float32)
        for a in range(0, logical.numel(), _CHUNK_ROWS):
            rows = self.read_logical(logical[a : a + _CHUNK_ROWS])
            out[a : a + _CHUNK_ROWS] = self.layout.weights(rows).float().norm(dim=1)
        return out

    def row_source(self) -> "TierRows":
        """What ``export_index().slots`` index: every row, read from the cache or the tier in chunks."""
        return TierRows(self)

    def export_index(self) -> ExportIndex:
        """The index's export: slots are logical (read them with ``row_source()``)."""
        return self.index.export_index()

    def export(self) -> StoreExport:
        return self.export_index().gather(self.row_source())

    @direct_write
    def import_(self, export: StoreExport) -> None:
        """Loads `export` into the tier (streamed in chunks; nothing is made resident but rows already in
        the cache, which are overwritten there)."""
        check_import_rows(self.name, self.layout, export.rows)
        self._refuse_if_pinned("import")
        self._join_staged()
        self.index.import_(_without_rows(export))
        self._fit_map()
        keys = export.keys.to(self.device)
        for a in range(0, keys.numel(), _CHUNK_ROWS):
            k = keys[a : a + _CHUNK_ROWS]
            logical = self.index.find(k)
            if bool((logical < 0).any()):
                raise StoreError(f"table '{self.name}': imported key {int(k[logical < 0][0])} has no row (internal error)")
            rows = export.rows[a : a + _CHUNK_ROWS].to(self.layout.storage_dtype).contiguous()
            cs = self._where[logical].to(torch.int64)
            res = cs >= 0
            if bool(res.any()):
                self._rows[cs[res]] = rows[res]
                self._set_dirty(cs[res])
            disk = ~res
            if bool(disk.any()):
                self._append(logical[disk], rows[disk].contiguous())
        self._cache_epoch += 1

    def update_all(self, fn) -> None:
        """Calls ``fn(cache_slots)`` over every row of the table, a chunk at a time made resident (and
        marked dirty): an in-place pass over a table larger than memory (global Adam's catch-up)."""
        keys = self.export_index().keys
        chunk = max(1, (self.capacity_rows - (len(self._pins.slots() or ()) if len(self._pins) else 0)) // 2)
        for a in range(0, keys.numel(), chunk):
            slots = self.find(keys[a : a + chunk])
            self._set_dirty(slots)
            fn(slots)


def _without_rows(export: StoreExport) -> StoreExport:
    """The export as a key index takes it (rows of zero width: the tier writes them)."""
    return StoreExport(export.keys, export.rows[:, :0], export.counts, export.last_step, export.pending_keys,
                       export.pending_counts, export.pending_last_step)


class TierRows:
    """``index_select(0, logical)`` over a TieredStore's rows: what a snapshot streams from."""

    def __init__(self, store) -> None:
        self.store = store
        self.dtype = store.layout.storage_dtype
        self.shape = torch.Size([store._logical_rows(), store.width])

    def dim(self) -> int:
        return 2

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise InputError("TierRows: rows are selected along dim 0")
        return self.store.read_logical(index)

