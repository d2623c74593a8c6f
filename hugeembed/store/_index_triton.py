"""The triton backend of a dynamic group's key index: CUDA groups when triton imports (and CPU
tensors under triton's interpreter, for the tests).  The same calls as store/_index_torch.py's
TorchIndex, equal to it bucket for bucket (the kernels: hugeembed/_triton/hash_index.py, hash_need.py,
hash_claim.py, row_init.py).

A find-or-insert: probe (classify, count, the longest probe), the sort of the keys to insert or
promote by home (every call of two keys or more: the duplicate and crowd checks read it), then one
program makes the checks, the outcome, need[] and the group after the call
(hugeembed/_triton/hash_need.py), read once: the call's only read.  The commit and the claims are
gated on the device by that outcome; what the read says decides which claims launch: none when no
key is new; up to _ONE_PROGRAM new keys, one program that runs every round (claim_finish_kernel: one
launch, its crowd ranks by comparing the records pairwise); more, three rounds launched over the keys
(a sort each for the crowd ranks) and that program for what they left (crowds longer than a 128-bucket
window), which exits at once when nothing is left.  Erase and rehash (eviction, growth: a host read is
expected there) are the reference's rebuild.
"""

from __future__ import annotations

import torch

from .._device import host_to_device
from ..errors import InputError, StoreError
from ._index import G_ENTRIES, G_LEN, T_ADMIT_K, T_HASH_KEY, T_LEN, T_PENDING, T_ROW_LIMIT, T_ROWS, Need, Outcome, \
    need_length, pack
from ._index_torch import TorchIndex, _check, _homes
from ._init import _A, _B, _C, _D, _E, _F

__all__ = ["TritonIndex"]

# Claim rounds launched one by one: the reference's windows of 32, 64 and 128 buckets; then 128-bucket
# rounds in one program (claim_finish_kernel) for what they left.
_ROUND_WIDTHS = (32, 64, 128)
_LAST_WIDTH = 128
# New keys that one program places alone, every round (its crowd ranks cost O(keys^2) in that program: at
# 1024 keys ~1M compares a round, less than the launches of three rounds); more take launched rounds first.
_ONE_PROGRAM = 1024
# the find-or-insert's sort key (2B at most) is int32 below this (tests lower it to run the int64 key)
_SORT_KEY_32 = 2**31
# the report's extras after need[] (hugeembed/_triton/hash_need.py): outcome, a table column entry naming no
# table, the first count below 1 (its position, value, table), keys to insert or promote, records left to place,
# the records the call before left unplaced
_X_OUTCOME, _X_BAD_TID, _X_BAD_AT, _X_BAD_COUNT, _X_BAD_TABLE, _X_TODO, _X_LEFT, _X_STUCK = range(8)
assert T_PENDING == T_ROWS + 1  # need[]'s per-table state after the call is these two columns, side by side


class TritonIndex(TorchIndex):
    """Args:
        block: keys per program of the probe and commit kernels.
        claim_block: keys per program of a claim round (each looks at a window of up to 128 buckets).
        shuffle: a generator: every kernel runs as grids of one program in a random order (the tests'
            check that no result depends on the order programs run in); None: one grid per kernel.
    """

    name = "triton"

    def __init__(self, block: int = 128, claim_block: int = 32, shuffle: torch.Generator | None = None) -> None:
        from .._triton import hash_claim, hash_index, hash_need  # triton is optional: imported when chosen

        assert hash_need.EXTRAS == _X_STUCK + 1
        self._kernels, self._kernels_need, self._kernels_claim = hash_index, hash_need, hash_claim
        self._block, self._claim_block, self._shuffle = block, claim_block, shuffle
        self._claims: torch.Tensor | None = None  # per bucket: the stamp of the last round that wanted it
        self._epoch = 0
        self._stuck: torch.Tensor | None = None  # the last call's records left unplaced (read by the next call)
        self._init_args: tuple | None = None  # the row initialisation's per-table arrays, on the device
        self._per_table: torch.Tensor | None = None  # a find-or-insert's counts per table: zeros between calls

    # ------------------------------------------------------------------ launching
    def _launch(self, kernel, n: int, block: int, *args, **constexprs) -> None:
        programs = -(-n // block)
        if self._shuffle is None:
            kernel[(programs,)](*args, pid0=0, BLOCK=block, **constexprs)
            return
        for pid0 in torch.randperm(programs, generator=self._shuffle).tolist():
            kernel[(1,)](*args, pid0=pid0, BLOCK=block, **constexprs)

    @staticmethod
    def _device_state(g, dev: torch.device) -> torch.Tensor:
        """The group's table fields (table t's field f at t * T_LEN + f) and then its scalars, on the
        keys' device: one small copy from page-locked memory, never waited for."""
        return host_to_device(torch.cat([g.tables.reshape(-1), g.scalars]), torch.int64, dev)

    # ------------------------------------------------------------------ find
    def find(self, g, keys: torch.Tensor, tids: torch.Tensor, rows_only: bool,
             hits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check(g, tids, None)
        keys, tids = keys.contiguous(), tids.contiguous()
        n = keys.numel()
        codes = torch.full_like(keys, -1)
        counts = torch.zeros_like(keys) if hits else None
        if n:
            tab = self._device_state(g, keys.device)
            self._launch(self._kernels.probe_kernel, n, self._block, g.buckets, g.buckets.shape[0], keys, tids, n,
                         g.tables.shape[0], tab[T_HASH_KEY:], tab[T_ADMIT_K:], T_LEN, keys, keys, codes, codes,
                         codes, codes, codes if counts is None else counts, codes, codes, INSERT=False,
                         ROWS_ONLY=rows_only, HAS_COUNTS=False, HAS_ADMIT=False, HAS_HITS=hits)
        return codes, counts

    # ------------------------------------------------------------------ find-or-insert
    def find_or_insert(self, g, keys, tids, counts, admit, step: int, out, hits, init) -> tuple[Outcome, Need, tuple]:
        """store/_index_torch.py::TorchIndex.find_or_insert's contract in one host read, new keys or not."""
        n = keys.numel()
        if n == 0:
            return super().find_or_insert(g, keys, tids, counts, admit, step, out, hits, init)
        k = self._kernels
        T, dev, B = g.tables.shape[0], keys.device, g.buckets.shape[0]
        keys, tids = keys.contiguous(), tids.contiguous()
        o = out if out.is_contiguous() else torch.empty_like(keys)
        h = hits if hits is None or hits.is_contiguous() else torch.empty_like(keys)
        tab = self._device_state(g, dev)
        i64 = dict(dtype=torch.int64, device=dev)
        codes, pos, n_after = (torch.empty(n, **i64) for _ in range(3))
        # (home, B + home or 2B: int32 below 2^30 buckets, a sort of half the bits)
        sortkey = torch.empty(n, dtype=torch.int32 if 2 * B < _SORT_KEY_32 else torch.int64, device=dev)
        flags = torch.empty(n, dtype=torch.int32, device=dev)
        # per table: new rows, new pending, promoted; then the checks: zeros, kept by need_kernel for the next call
        # (taken while in use: a call that fails between the kernels leaves no buffer behind)
        per_table, self._per_table = self._per_table, None
        if per_table is None or per_table.numel() != 3 * T + 3 or per_table.device != dev:
            per_table = torch.zeros(3 * T + 3, **i64)
        c = counts.contiguous() if counts is not None else keys
        a = admit.contiguous() if admit is not None else keys
        self._launch(k.probe_kernel, n, self._block, g.buckets, B, keys, tids, n, T, tab[T_HASH_KEY:],
                     tab[T_ADMIT_K:], T_LEN, c, a, codes, pos, n_after, flags, codes if h is None else h, per_table,
                     sortkey, INSERT=True, ROWS_ONLY=False, HAS_COUNTS=counts is not None,
                     HAS_ADMIT=admit is not None, HAS_HITS=h is not None)
        rank, first, new_list = torch.empty(n, **i64), torch.empty(n, **i64), torch.empty(n, **i64)
        active = torch.empty(n, dtype=torch.int32, device=dev)
        ok_flag = torch.empty(1, dtype=torch.int32, device=dev)
        cut = need_length(T)
        values = torch.empty(cut + _X_STUCK + 1, **i64)
        if self._stuck is None or self._stuck.device != dev:
            self._stuck = torch.zeros(1, **i64)
        ordered = n >= 2  # (the duplicate and crowd checks need two keys)
        sorted_keys, order = torch.sort(sortkey, stable=True) if ordered else (sortkey, codes)
        self._kernels_need.need_kernel[(1,)](
            flags, tids, keys, c, pos, per_table, tab[T_ROWS:], tab[T_PENDING:], tab[T_ROW_LIMIT:], T_LEN,
            tab[T * T_LEN :], n, T, g.max_entries(), g.rows_capacity(), sorted_keys, order, rank, active, first,
            new_list, ok_flag, values, self._stuck, pid0=0, HAS_COUNTS=counts is not None, SORTED=ordered, BLOCK=1024)
        self._per_table = per_table  # (zeroed by need_kernel)
        # commit (nothing but `out` when not DONE): slots in batch order, the found keys' words, the new records
        word2, last, made_slots, made_keys, made_tids = (torch.empty(n, **i64) for _ in range(5))
        self._launch(k.commit_kernel, n, self._block, g.buckets, tids, n, codes, pos, n_after, flags, rank,
                     g.free_rows, tab[T * T_LEN :], step, ok_flag, o, word2, last, made_slots, made_keys, keys,
                     made_tids)
        got = values.tolist()  # the call's one read: the checks, the outcome, the group after the call
        x = got[cut:]
        if x[_X_STUCK]:
            raise StoreError(f"tables {g.names()}: {x[_X_STUCK]} new keys of the call before found no empty bucket "
                             "(internal error)")
        if x[_X_BAD_TID]:
            raise StoreError("group index: a table column entry names no table of the group (internal error)")
        if x[_X_BAD_AT] < n:
            raise InputError(f"table '{g.settings[x[_X_BAD_TABLE]].name}': counts must be >= 1 (occurrences in the "
                             f"batch), got {x[_X_BAD_COUNT]}")
        rc = Outcome(x[_X_OUTCOME])
        made: tuple = ()
        if rc == Outcome.DONE:
            if got[0]:  # new keys to place; the records a round leaves are counted down in `values` on the device
                left = values[cut + _X_LEFT : cut + _X_LEFT + 1]
                width = _ROUND_WIDTHS[0]
                if got[0] > _ONE_PROGRAM:
                    self._claim(g, keys, tids, word2, last, active, pos, first, left, _ROUND_WIDTHS)
                    width = _LAST_WIDTH
                # the new keys, listed by need_kernel: values[0] of them
                self._finish(g, keys, tids, word2, last, active, pos, values[:1], new_list, left, width)
                self._stuck = left  # (the next call's report holds it)
            after = got[cut - 3 - 2 * T : cut]
            g.scalars.copy_(torch.tensor(after[:G_LEN]))
            g.tables[:, T_ROWS : T_PENDING + 1].copy_(torch.tensor(after[G_LEN:]).view(T, 2))
            m = got[3]
            made = (made_slots[:m], made_keys[:m], made_tids[:m])
            if m and init is not None:
                self._init_rows(init, made, dev)
        if o is not out:
            out.copy_(o)
        if h is not hits:
            hits.copy_(h)
        return rc, Need(got[:cut], T), made

    # ------------------------------------------------------------------ new rows
    def _init_rows(self, init: tuple, made: tuple, dev: torch.device) -> None:
        """The made rows' weights and state by their tables' kinds (hugeembed/_triton/row_init.py; kind -1:
        the group makes them): `init` is DynamicGroup._init_call's (rows, kinds, params, state templates,
        width, dim, state width); its per-table arrays are the group's, copied to the device once."""
        import triton

        from .._triton import row_init

        rows, kinds, params, state, width, dim, sw = init
        if self._init_args is None or self._init_args[0] is not kinds or self._init_args[1] != dev:
            self._init_args = (kinds, dev, bool((kinds[:, 0] >= 0).any()), host_to_device(kinds, torch.int64, dev),
                               host_to_device(params, torch.float64, dev),
                               host_to_device(state if state is not None else torch.zeros(1), torch.float32, dev),
                               host_to_device(row_init.coefficients((_A, _B, _C, _D, _E, _F)), torch.float64, dev))
        mine, kinds_d, params_d, state_d, coefs = self._init_args[2:]
        if not mine:  # (every table's rows made by the group)
            return
        slots, keys, tids = made
        m, block = slots.numel(), 16
        grid = [0] if self._shuffle is None else torch.randperm(-(-m // block), generator=self._shuffle).tolist()
        for pid0 in grid:
            row_init.init_rows_kernel[(-(-m // block) if self._shuffle is None else 1,)](
                pid0, rows, rows.stride(0), m, slots, keys, tids, kinds_d, params_d, state_d, coefs, dim, width - sw,
                sw, HAS_STATE=sw > 0, BLOCK_R=block, BLOCK_D=triton.next_power_of_2(dim),
                BLOCK_S=triton.next_power_of_2(max(sw, 1)), enable_fp_fusion=False)

    # ------------------------------------------------------------------ claims
    def _claim(self, g, keys, tids, word2, last, active, start, first, left, widths, first_known: bool = True) -> None:
        """Rounds of the reference's claim (store/_index_torch.py::claim) over the records whose
        `active` is set, from `start` on (both updated in place; `left` counts down the records placed).
        `first_known`: `first` holds each record's first empty bucket for the first round (a probe's)."""
        k, n, B = self._kernels_claim, keys.numel(), g.buckets.shape[0]
        claims = self._claims_for(g, len(widths))
        want = torch.empty_like(start)
        for r, width in enumerate(widths):
            self._epoch += 1
            if r or not first_known:
                self._launch(k.claim_scan_kernel, n, self._claim_block, g.buckets, B, n, active, start, first,
                             W=width)
            sorted_first, order = torch.sort(first, stable=True)
            self._launch(k.claim_want_kernel, n, self._claim_block, g.buckets, B, n, start, sorted_first, order,
                         want, claims, self._epoch, W=width)
            self._launch(k.claim_place_kernel, n, self._claim_block, g.buckets, B, n, active, start, want,
                         claims, self._epoch, keys, tids, word2, last, left, W=width)

    def _claims_for(self, g, rounds: int) -> torch.Tensor:
        """Per bucket the stamp of the last round that wanted it (zeros when made), room for `rounds` more epochs."""
        B = g.buckets.shape[0]
        if self._claims is None or self._claims.shape[0] != B or self._claims.device != g.buckets.device or \
                self._epoch + rounds >= self._kernels_claim.FINISH_EPOCH:  # (the finish kernel's epoch stays above)
            self._claims = torch.zeros(B, dtype=torch.int64, device=g.buckets.device)
            self._epoch = 0
        return self._claims

    def _finish(self, g, keys, tids, word2, last, active, start, listed, todo, left, width: int) -> None:
        """Rounds in one program, on the device, until the `left` records still active among todo[:listed[0]]
        are placed: windows of `width` buckets, then twice as wide up to 128 (as the reference goes on);
        it exits at once when none is left.  A round places a record, or moves every one a window on when
        none sees an empty bucket: the bound on rounds is never reached while the index has an empty bucket."""
        n, B = keys.numel(), g.buckets.shape[0]
        claims = self._claims_for(g, 0)
        scratch = torch.empty(3, n, dtype=torch.int64, device=keys.device)
        self._kernels_claim.claim_finish_kernel[(1,)](g.buckets, B, listed, todo, active, start, claims, keys, tids,
                                                      word2, last, left, scratch[0], scratch[1], scratch[2], width,
                                                      n * (B // _LAST_WIDTH + 4), pid0=0, W=_LAST_WIDTH, BLOCK=32)

    def insert(self, g, keys, tids, codes, counts, lasts) -> None:
        n = keys.numel()
        if n == 0:
            return
        keys, tids = keys.contiguous(), tids.contiguous()
        word2 = pack(codes.to(torch.int64), counts).contiguous()
        active = torch.ones(n, dtype=torch.int32, device=keys.device)
        start = _homes(g, keys, tids)
        lasts = lasts.contiguous()
        first = torch.empty_like(start)
        left = torch.full((1,), n, dtype=torch.int64, device=keys.device)
        listed = left.clone()
        width = _ROUND_WIDTHS[0]
        if n > _ONE_PROGRAM:
            self._claim(g, keys, tids, word2, lasts, active, start, first, left, _ROUND_WIDTHS, False)
            width = _LAST_WIDTH
        self._finish(g, keys, tids, word2, lasts, active, start, listed, torch.arange(n, device=keys.device),
                     left, width)
        if int(left[0]):  # (an import, not a step: a read)
            raise StoreError(f"tables {g.names()}: {int(left[0])} imported keys found no empty bucket (internal error)")
        g.scalars[G_ENTRIES] += n
