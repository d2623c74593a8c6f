"""The triton backend of a dynamic group's key index: CUDA groups when triton imports (and CPU
tensors under triton's interpreter, for the tests).  The same calls as store/_index_torch.py's
TorchIndex, equal to it bucket for bucket (the kernels: hugeembed/_triton/hash_index.py).

A find-or-insert reads the host once: probe, classify and count in a kernel; the checks the
reference makes on the host (duplicate keys and the longest probe as device ops; row limits, room,
bad counts, the outcome and need[] in one program, hugeembed/_triton/hash_need.py); the commit
and three rounds of claims run gated by that flag; then the call's need[] comes back in one read.  Only a claim left unfinished after three rounds
(crowds longer than a 128-bucket window) reads again, once per further round.  Erase and rehash
(eviction, growth: a host read is expected there) are the reference's rebuild.
"""

from __future__ import annotations

import torch

from ..errors import InputError, StoreError
from ._index import (G_ENTRIES, G_NUM_FREE, G_ROW_HWM, NEED_HEAD, T_ADMIT_K, T_HASH_KEY, T_PENDING,
                     T_ROW_LIMIT, T_ROWS, Need, Outcome, pack)
from ._index_torch import TorchIndex, _check, _homes

__all__ = ["TritonIndex"]

# Claim rounds run before the call's one read: the reference's windows of 32, 64 and 128 buckets.
_BLIND_WIDTHS = (32, 64, 128)
_LAST_WIDTH = 128
_INT64_MAX = 2**63 - 1
# need[] of the device beyond the reference's head and per-table pairs: outcome, a table column entry
# naming no table, the first count below 1 (its position, value, table), claims left, promoted keys per table
_X_OUTCOME, _X_BAD_TID, _X_BAD_AT, _X_BAD_COUNT, _X_BAD_TABLE, _X_LEFT, _X_LEN = range(7)


def _at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 0-d index tensor without a host read (x[i] reads i to the host)."""
    return x.index_select(0, i.reshape(1)).reshape(())


class TritonIndex(TorchIndex):
    """Args:
        block: keys per program of the probe and commit kernels.
        claim_block: keys per program of a claim round (each looks at a window of up to 128 buckets).
        shuffle: a generator: every kernel runs as grids of one program in a random order (the tests'
            check that no result depends on the order programs run in); None: one grid per kernel.
    """

    name = "triton"

    def __init__(self, block: int = 128, claim_block: int = 32, shuffle: torch.Generator | None = None) -> None:
        from .._triton import hash_index, hash_need  # triton is optional: imported when this backend is chosen

        self._kernels, self._kernels_need = hash_index, hash_need
        self._block, self._claim_block, self._shuffle = block, claim_block, shuffle
        self._claims: torch.Tensor | None = None  # per bucket: the stamp of the last round that wanted it
        self._epoch = 0

    # ------------------------------------------------------------------ launching
    def _launch(self, kernel, n: int, block: int, *args, **constexprs) -> None:
        programs = -(-n // block)
        if self._shuffle is None:
            kernel[(programs,)](*args, pid0=0, BLOCK=block, **constexprs)
            return
        for pid0 in torch.randperm(programs, generator=self._shuffle).tolist():
            kernel[(1,)](*args, pid0=pid0, BLOCK=block, **constexprs)

    def _device_tables(self, g, dev: torch.device) -> torch.Tensor:
        """The group's table fields as contiguous rows [T_LEN, T] on the keys' device (one small copy)."""
        return g.tables.t().contiguous().to(dev, non_blocking=True)

    # ------------------------------------------------------------------ find
    def find(self, g, keys: torch.Tensor, tids: torch.Tensor, rows_only: bool,
             hits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check(g, tids, None)
        keys, tids = keys.contiguous(), tids.contiguous()
        n = keys.numel()
        codes = torch.full_like(keys, -1)
        counts = torch.zeros_like(keys) if hits else None
        if n:
            tab = self._device_tables(g, keys.device)
            self._launch(self._kernels.probe_kernel, n, self._block, g.buckets, g.buckets.shape[0], keys, tids, n,
                         tab.shape[1], tab[T_HASH_KEY], tab[T_ADMIT_K], keys, keys, codes, codes, codes, codes, codes,
                         codes, codes if counts is None else counts, codes, INSERT=False, ROWS_ONLY=rows_only,
                         HAS_COUNTS=False, HAS_ADMIT=False, HAS_HITS=hits)
        return codes, counts

    # ------------------------------------------------------------------ find-or-insert
    def find_or_insert(self, g, keys, tids, counts, admit, step: int, out, hits, init) -> tuple[Outcome, Need, tuple]:
        """store/_index_torch.py::TorchIndex.find_or_insert's contract, one host read."""
        n = keys.numel()
        if n == 0:
            return super().find_or_insert(g, keys, tids, counts, admit, step, out, hits, init)
        k = self._kernels
        T, dev, B = g.tables.shape[0], keys.device, g.buckets.shape[0]
        keys, tids = keys.contiguous(), tids.contiguous()
        o = out if out.is_contiguous() else torch.empty_like(keys)
        h = hits if hits is None or hits.is_contiguous() else torch.empty_like(keys)
        entries, hwm, nfree = (int(x) for x in g.scalars.tolist())  # a CPU tensor: no device read
        tab = self._device_tables(g, dev)
        i64 = dict(dtype=torch.int64, device=dev)
        codes, pos, probes, homes, n_after = (torch.empty(n, **i64) for _ in range(5))
        flags = torch.empty(n, dtype=torch.int32, device=dev)
        per_table = torch.zeros(T, 3, **i64)  # new rows, new pending keys, promoted keys
        c = counts.contiguous() if counts is not None else keys
        a = admit.contiguous() if admit is not None else keys
        self._launch(k.probe_kernel, n, self._block, g.buckets, B, keys, tids, n, T, tab[T_HASH_KEY], tab[T_ADMIT_K],
                     c, a, codes, pos, probes, homes, n_after, flags, codes if h is None else h, per_table,
                     INSERT=True, ROWS_ONLY=False, HAS_COUNTS=counts is not None, HAS_ADMIT=admit is not None,
                     HAS_HITS=h is not None)
        new, promote = (flags & k.NEW) != 0, (flags & k.PROMOTE) != 0
        at = torch.arange(n, **i64)
        longest, long_table = self._longest(tids, probes, homes, new, at)
        dup, dup_key, dup_table = self._duplicate(keys, tids, new | promote, T, at)
        # the checks, the outcome (the reference's order), each row's rank, the keys to place and need[]: one
        # program (hugeembed/_triton/hash_need.py)
        rank, active = torch.empty(n, **i64), torch.empty(n, dtype=torch.int32, device=dev)
        ok_flag = torch.empty(1, dtype=torch.int32, device=dev)
        values = torch.empty(NEED_HEAD + 3 * T + _X_LEN, **i64)
        self._kernels_need.need_kernel[(1,)](
            flags, tids, c, per_table, tab[T_ROWS], tab[T_ROW_LIMIT], n, T, entries, hwm, nfree, g.max_entries(),
            g.rows_capacity(), longest.reshape(1), long_table.reshape(1), dup.reshape(1), dup_key.reshape(1),
            dup_table.reshape(1), rank, active, ok_flag, values, pid0=0, HAS_COUNTS=counts is not None, BLOCK=1024)
        # commit (nothing when not ok): slots in batch order, the found keys' words, the new records
        word2, made_slots, made_keys, made_tids = (torch.empty(n, **i64) for _ in range(4))
        self._launch(k.commit_kernel, n, self._block, g.buckets, tids, n, codes, pos, n_after, flags, rank,
                     g.free_rows, nfree, hwm, step, ok_flag, o, word2, made_slots, made_keys,
                     keys, made_tids)
        last = torch.full((n,), step, **i64)
        self._claim(g, keys, tids, word2, last, active, pos, _BLIND_WIDTHS)
        torch.sum(active, 0, dtype=torch.int64, out=values[NEED_HEAD + 2 * T + _X_LEFT])  # the claims left
        values = values.tolist()  # the one read
        cut = NEED_HEAD + 2 * T
        need, x, promoted = values[:cut], values[cut : cut + _X_LEN], values[cut + _X_LEN :]
        if x[_X_BAD_TID]:
            raise StoreError("group index: a table column entry names no table of the group (internal error)")
        if x[_X_BAD_AT] < n:
            raise InputError(f"table '{g.settings[x[_X_BAD_TABLE]].name}': counts must be >= 1 (occurrences in the "
                             f"batch), got {x[_X_BAD_COUNT]}")
        rc = Outcome(x[_X_OUTCOME])
        made: tuple = ()
        if rc == Outcome.DONE:
            self._finish(g, keys, tids, word2, last, active, pos, x[_X_LEFT])
            m = need[3]
            take = min(m, nfree)
            g.scalars[G_ENTRIES] = entries + need[0]
            g.scalars[G_NUM_FREE], g.scalars[G_ROW_HWM] = nfree - take, hwm + m - take
            g.tables[:, T_ROWS] += torch.tensor(need[NEED_HEAD::2], dtype=torch.int64)
            g.tables[:, T_PENDING] += torch.tensor(need[NEED_HEAD + 1 :: 2], dtype=torch.int64) - \
                torch.tensor(promoted, dtype=torch.int64)
            made = (made_slots[:m], made_keys[:m], made_tids[:m])
        if o is not out:
            out.copy_(o)
        if h is not hits:
            hits.copy_(h)
        after = g.scalars.tolist() + g.tables[:, [T_ROWS, T_PENDING]].reshape(-1).tolist()
        return rc, Need(need + after, T), made

    @staticmethod
    def _longest(tids, probes, homes, new, at) -> tuple[torch.Tensor, torch.Tensor]:
        """(need[7], need[6]) as the reference computes them, on the device: the longest probe and
        its table (the first in batch order), unless the new keys placed alone into an empty index
        (sorted by home, batch order within) would probe longer: ids chosen to collide."""
        longest, i = probes.max(0)
        table = torch.where(longest > 0, _at(tids, i), -1)
        m = new.sum()
        order = torch.argsort(torch.where(new, homes, _INT64_MAX), stable=True)  # the new keys first
        hs = homes[order]
        crowd = torch.cummax(hs - at, 0).values + at - hs + 1
        crowd, j = torch.where((at < m) & (m >= 2), crowd, 0).max(0)
        longer = crowd > longest
        return torch.where(longer, crowd, longest), torch.where(longer, _at(tids, _at(order, j)), table)

    @staticmethod
    def _duplicate(keys, tids, todo, T: int, at) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(any, key, table) of the smallest (table, key) given twice among the keys to insert or
        promote (the reference's torch.unique order), on the device."""
        tp = torch.where(todo, tids, T + at)  # the others: a table of their own each
        by_key = torch.argsort(keys, stable=True)
        order = by_key[torch.argsort(tp[by_key], stable=True)]
        ks, ts = keys[order], tp[order]
        twin = torch.zeros_like(todo)
        twin[1:] = (ks[1:] == ks[:-1]) & (ts[1:] == ts[:-1])
        first = torch.where(twin, at, keys.numel()).min()
        dup = first < keys.numel()
        j = first.clamp(max=keys.numel() - 1)
        return dup, torch.where(dup, _at(ks, j), 0), torch.where(dup, _at(ts, j), 0)

    # ------------------------------------------------------------------ claims
    def _claim(self, g, keys, tids, word2, last, active, start, widths) -> None:
        """Rounds of the reference's claim (store/_index_torch.py::claim) over the records whose
        `active` is set, from `start` on (both updated in place)."""
        k, n, B = self._kernels, keys.numel(), g.buckets.shape[0]
        if self._claims is None or self._claims.shape[0] != B or self._claims.device != g.buckets.device or \
                self._epoch + len(widths) >= 2 ** (63 - k.STAMP_BITS):
            self._claims = torch.zeros(B, dtype=torch.int64, device=g.buckets.device)
            self._epoch = 0
        first, rank, want = (torch.empty_like(start) for _ in range(3))
        for width in widths:
            self._epoch += 1
            self._launch(k.claim_scan_kernel, n, self._claim_block, g.buckets, B, n, active, start, first, W=width)
            order = torch.argsort(first, stable=True)
            self._launch(k.claim_rank_kernel, n, self._block, first, order, rank, n)
            self._launch(k.claim_want_kernel, n, self._claim_block, g.buckets, B, n, active, start, rank, want,
                         self._claims, self._epoch, W=width)
            self._launch(k.claim_place_kernel, n, self._claim_block, g.buckets, B, n, active, start, want,
                         self._claims, self._epoch, keys, tids, word2, last, W=width)

    def _finish(self, g, keys, tids, word2, last, active, start, left: int) -> None:
        """Further rounds (128-bucket windows), a read each, until the `left` records still active are
        placed: crowds longer than the windows so far, as the reference goes on."""
        # a round places a record, or moves every one a window on when none sees an empty bucket
        for _ in range(left * (g.buckets.shape[0] // _LAST_WIDTH + 2)):
            if not left:
                return
            self._claim(g, keys, tids, word2, last, active, start, (_LAST_WIDTH,))
            left = int(active.sum())
        if left:
            raise StoreError(f"tables {g.names()}: {left} new keys found no empty bucket (internal error)")

    def insert(self, g, keys, tids, codes, counts, lasts) -> None:
        n = keys.numel()
        if n == 0:
            return
        keys, tids = keys.contiguous(), tids.contiguous()
        word2 = pack(codes.to(torch.int64), counts).contiguous()
        active = torch.ones(n, dtype=torch.int32, device=keys.device)
        start = _homes(g, keys, tids)
        lasts = lasts.contiguous()
        self._claim(g, keys, tids, word2, lasts, active, start, _BLIND_WIDTHS)
        self._finish(g, keys, tids, word2, lasts, active, start, int(active.sum()))  # an import, not a step
        g.scalars[G_ENTRIES] += n
