"""ctypes bindings of csrc/hash_store.cpp: the native CPU backend of HashStore.

The kernels take an ``HsTable`` struct of raw pointers into the store's tensors
(layout in csrc/store_table.h).  Every tensor is checked (CPU, dtype, contiguous,
length) when the struct is built, so a kernel never sees a buffer it could overrun.
"""

from __future__ import annotations

import ctypes

import torch

from .. import _native
from ..errors import StoreError

__all__ = ["NativeOps", "available", "BATCH_COLUMNS", "run_batch"]

_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Table(ctypes.Structure):
    # Field for field csrc/store_table.h::HsTable.
    _fields_ = [("buckets", _P), ("nbuckets", _I), ("r_cap", _I), ("free_rows", _P), ("st", _P)]


def available() -> bool:
    return _native.available()


def _table(s, buckets: torch.Tensor | None = None) -> _Table:
    ck = _native.check
    buckets = s._buckets if buckets is None else buckets
    nb = buckets.shape[0]
    ck(buckets, torch.int64, f"table '{s.name}' buckets", 3 * nb)
    ck(s._free, torch.int32, f"table '{s.name}' free rows")
    ck(s._st, torch.int64, f"table '{s.name}' scalars")
    if nb < 1 or nb > 2**32 or s._free.numel() < s._st_get("num_free") or s._st_get("row_hwm") > s._storage.shape[0]:
        raise StoreError(f"table '{s.name}': hash store arrays are inconsistent")
    return _Table(_native.ptr(buckets), nb, s._storage.shape[0], _native.ptr(s._free), _native.ptr(s._st))


# Columns of he_hs_find_or_insert_many's descriptor (csrc/hash_store.cpp::BatchCol).
BATCH_COLUMNS = ("buckets", "nbuckets", "r_cap", "free_rows", "free_len", "st", "keys", "counts", "n", "admit_k",
                 "row_limit", "max_entries", "out", "scratch", "set_scratch", "set_cap", "new_slots", "new_keys",
                 "init_kind", "p0", "p1", "p2", "p3", "p4", "p5", "seed", "storage", "stride", "dim", "state_row",
                 "state_width", "rc", "need0", "need1", "need2", "need3")
_RC = BATCH_COLUMNS.index("rc")


def run_batch(rows: list[list[int]], step: int) -> list[tuple[int, list[int]]]:
    """Runs he_hs_find_or_insert_many over descriptor rows (NativeOps.batch_row); (rc, need) per row."""
    if any(len(r) != len(BATCH_COLUMNS) for r in rows):  # the kernel reads exactly this many columns
        raise StoreError(f"find_or_insert_many: descriptor rows must have {len(BATCH_COLUMNS)} columns (internal error)")
    desc = torch.tensor(rows, dtype=torch.int64)
    _native.fn("he_hs_find_or_insert_many", _P, _I, _I, _I)(desc.data_ptr(), len(rows), step, _native.nthreads())
    return [(r[0], r[1:]) for r in desc[:, _RC:].tolist()]


def _fn(name, *args):
    return _native.fn(name, ctypes.POINTER(_Table), *args)


class NativeOps:
    """Backend of HashStore running the C++ kernels (CPU tensors only)."""

    name = "native"

    def __init__(self):
        self._scratch = torch.empty(0, dtype=torch.int64)
        self._set = torch.empty(0, dtype=torch.int64)

    def _buf(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Scratch reused across calls (fresh pages cost a fault each, see docs/architecture.md):
        # [6 * n] for the kernel, then [2, n] new slots / keys; and the duplicate
        # check's set of 2 * cap int64, cap a power of two >= 2n.
        if self._scratch.numel() < 8 * n:
            self._scratch = torch.empty(8 * max(n, 1024), dtype=torch.int64)
        cap = 1 << max(4, (2 * n - 1).bit_length())
        if self._set.numel() < 2 * cap:
            self._set = torch.empty(2 * cap, dtype=torch.int64)
        return self._scratch, self._set

    def find(self, s, keys: torch.Tensor, rows_only: bool = False) -> torch.Tensor:
        t = _table(s)
        out = torch.empty_like(keys)
        f = _fn("he_hs_find", _P, _I, _P, _I, _I)
        f(ctypes.byref(t), _native.ptr(keys), keys.numel(), _native.ptr(out), int(rows_only), _native.nthreads())
        return out

    def find_or_insert(self, s, keys, counts, step, row_limit):
        n = keys.numel()
        t = _table(s)
        out = torch.empty_like(keys)
        buf, dup_set = self._buf(n)
        new = buf[6 * n : 8 * n].view(2, n)
        need = (ctypes.c_int64 * 4)()
        if counts is not None:
            _native.check(counts, torch.int64, f"table '{s.name}' counts", n)
        f = _fn("he_hs_find_or_insert", _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _I, _P, _P, _P, _I)
        rc = f(ctypes.byref(t), _native.ptr(keys), _native.ptr(counts), n, step, s.admit_min_count, row_limit,
               s._max_entries(), _native.ptr(out), buf.data_ptr(), dup_set.data_ptr(), dup_set.numel() // 2,
               new[0].data_ptr(), new[1].data_ptr(), need, _native.nthreads())
        made = need[3]
        return rc, out, new[0, :made], new[1, :made], list(need)

    def batch_row(self, s, keys, counts, row_limit, init_bits, seed, state_row,
                  out: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
        """One table's row of a multi-table find-or-insert descriptor, and the tensor its codes land in.

        `keys` / `counts` are contiguous int64 CPU tensors (as_keys / as_counts), `out` one like
        `keys` or None (a new one); the kernel checks the store's arrays and the counts itself
        (rc 4 / 5).  The tensors the row points into stay alive with the caller (keys, counts,
        out) and the store.
        """
        n = keys.numel()
        buf, dup_set = self._buf(n)  # this store's own scratch: tables run in parallel, stores never share
        out = torch.empty_like(keys) if out is None else _native.check(out, torch.int64, f"table '{s.name}' slots", n)
        storage, buckets = s._storage, s._buckets
        row = [buckets.data_ptr(), buckets.shape[0], storage.shape[0], s._free.data_ptr(), s._free.numel(),
               s._st.data_ptr(), keys.data_ptr(), 0 if counts is None else counts.data_ptr(), n, s.admit_min_count,
               row_limit, s._max_entries(), out.data_ptr(), buf.data_ptr(), dup_set.data_ptr(), dup_set.numel() // 2,
               buf.data_ptr() + 6 * n * 8, buf.data_ptr() + 7 * n * 8, *init_bits, seed, storage.data_ptr(),
               storage.shape[1], s.dim, 0 if state_row is None else state_row.data_ptr(),
               0 if state_row is None else s.state_width, 0, 0, 0, 0, 0]
        return row, out

    def insert(self, s, keys, codes, counts, lasts) -> None:
        t = _table(s)
        n = keys.numel()
        codes = codes.to(torch.int32).contiguous()
        counts, lasts = counts.contiguous(), lasts.contiguous()
        for name, x in (("codes", codes), ("counts", counts), ("last steps", lasts)):
            _native.check(x, torch.int32 if name == "codes" else torch.int64, f"table '{s.name}' {name}", n)
        f = _fn("he_hs_insert", _P, _P, _P, _P, _I, _I)
        f(ctypes.byref(t), _native.ptr(keys), _native.ptr(codes), _native.ptr(counts), _native.ptr(lasts), n,
          _native.nthreads())

    def erase(self, s, keys: torch.Tensor) -> None:
        t = _table(s)
        f = _fn("he_hs_erase", _P, _I)
        missing = f(ctypes.byref(t), _native.ptr(keys), keys.numel())
        if missing:
            raise StoreError(f"table '{s.name}': {missing} keys to erase were not present (internal error)")

    def rehash(self, s, new: torch.Tensor) -> None:
        t = _table(s, new)
        f = _native.fn("he_hs_rehash", _P, _I, ctypes.POINTER(_Table), _I)
        expected = s._st_get("entries")
        moved = f(_native.ptr(s._buckets), s.num_buckets, ctypes.byref(t), _native.nthreads())
        if moved != expected:
            raise StoreError(f"table '{s.name}': rehash moved {moved} keys, expected {expected}")
