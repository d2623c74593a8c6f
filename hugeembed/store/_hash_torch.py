"""The plain-PyTorch twin of csrc/hash_store.cpp: same layout, vectorised probing.

Runs on any device (it is the CUDA path) and is the CPU parity twin of the native
kernels.  Bucket records are int64 [B, 3] = (key, code | count << 32, last step);
see csrc/store_table.h.  Home buckets use a multiply-shift of the hash, so B need not be a power of two.
Probing advances every unresolved key at once over a
window of buckets that doubles each round (1, 2, 4, ... 32), so a batch finishes
in a handful of rounds even when a few keys sit far from home.  Concurrent inserts
that pick the same empty bucket are resolved with ``scatter_reduce(amin)`` over
their batch index: the lowest index wins, the others move on to the next bucket.
"""

from __future__ import annotations

import torch

from .._hashing import logical_shift_right, mix64

__all__ = ["TorchOps", "EMPTY", "PENDING", "new_buckets", "entries", "pack", "code_of", "count_of"]

EMPTY = -(2**63)
PENDING = -2
_COUNT_MAX = 2**31 - 1
_MAX_WINDOW = 32


def pack(code: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Word 1 of a record: int32 code in the low half, saturating int32 count in the high half."""
    return (count.clamp(0, _COUNT_MAX) << 32) | (code & 0xFFFFFFFF)


def code_of(w1: torch.Tensor) -> torch.Tensor:
    return (w1 << 32) >> 32  # arithmetic shift: sign-extends the low half


def count_of(w1: torch.Tensor) -> torch.Tensor:
    return w1 >> 32


def new_buckets(nbuckets: int, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Empty bucket records (key EMPTY, code -1, count 0, step 0); fills `out` when given."""
    b = torch.empty(nbuckets, 3, dtype=torch.int64, device=device) if out is None else out
    b[:, 0] = EMPTY
    b[:, 1] = 0xFFFFFFFF  # pack(-1, 0)
    b[:, 2] = 0
    return b


def _home(keys: torch.Tensor, nbuckets: int) -> torch.Tensor:
    """((mix64(key) >> 32) * B) >> 32 with logical shifts: a bucket in [0, B) for B <= 2**32."""
    return logical_shift_right(logical_shift_right(mix64(keys), 32) * nbuckets, 32)


def probe(buckets: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int64 [n] (row >= 0, pending -2, absent -1) and pos int64 [n] (bucket of the
    key, or first empty bucket on its probe path).  Keys equal to EMPTY are left at -1."""
    n, nb = keys.numel(), buckets.shape[0]
    dev = keys.device
    codes = torch.full((n,), -1, dtype=torch.int64, device=dev)
    pos = torch.full((n,), -1, dtype=torch.int64, device=dev)
    idx = (keys != EMPTY).nonzero().squeeze(1)
    k = keys[idx]
    p = _home(k, nb)
    width = 1
    ar = torch.arange(_MAX_WINDOW, device=dev)
    bkeys = buckets[:, 0]
    while idx.numel():
        win = (p[:, None] + ar[:width]) % nb
        bk = bkeys[win]
        stop = (bk == k[:, None]) | (bk == EMPTY)
        done = stop.any(1)
        first = stop.to(torch.uint8).argmax(1)
        q = win.gather(1, first[:, None]).squeeze(1)
        hit = bk.gather(1, first[:, None]).squeeze(1) == k
        di, dq, dh = idx[done], q[done], hit[done]
        codes[di] = torch.where(dh, code_of(buckets[dq, 1]), -1)
        pos[di] = dq
        keep = ~done
        idx, p, k = idx[keep], (p[keep] + width) % nb, k[keep]
        width = min(2 * width, _MAX_WINDOW)
    return codes, pos


def claim(buckets: torch.Tensor, records: torch.Tensor, start: torch.Tensor | None = None) -> None:
    """Puts records int64 [n, 3] of unique keys known to be absent (none EMPTY) into the buckets.

    `start` is where each key's search for an empty bucket may begin (its home, or
    the first empty bucket a probe met): every bucket before it is occupied.
    """
    n, nb = records.shape[0], buckets.shape[0]
    if n == 0:
        return
    dev = records.device
    idx = torch.arange(n, device=dev)
    p = _home(records[:, 0], nb) if start is None else start.clone()
    ar = torch.arange(_MAX_WINDOW, device=dev)
    bkeys = buckets[:, 0]
    width = 1
    while idx.numel():
        win = (p[:, None] + ar[:width]) % nb
        empty = bkeys[win] == EMPTY
        has = empty.any(1)
        q = win.gather(1, empty.to(torch.uint8).argmax(1)[:, None]).squeeze(1)
        ci, cq = idx[has], q[has]
        # Several keys may want the same empty bucket: the lowest batch index wins.
        uq, inv = torch.unique(cq, return_inverse=True)
        winner = torch.full((uq.numel(),), n, dtype=torch.int64, device=dev)
        winner.scatter_reduce_(0, inv, ci, "amin")
        won = winner[inv] == ci
        buckets[cq[won]] = records[ci[won]]
        # Losers retry right after the bucket they lost; keys with no empty in
        # their window skip the whole window (all of it was occupied).
        nxt = torch.where(has, q + 1, p + width) % nb
        keep = torch.ones(idx.numel(), dtype=torch.bool, device=dev)
        keep[has.nonzero().squeeze(1)[won]] = False
        idx, p = idx[keep], nxt[keep]
        width = min(2 * width, _MAX_WINDOW)


def entries(buckets: torch.Tensor) -> torch.Tensor:
    """The records int64 [m, 3] of all occupied buckets."""
    return buckets[buckets[:, 0] != EMPTY]


def _records(keys: torch.Tensor, codes: torch.Tensor, counts: torch.Tensor, lasts: torch.Tensor) -> torch.Tensor:
    return torch.stack([keys, pack(codes, counts), lasts], dim=1)


class TorchOps:
    """Backend of HashStore built on torch ops (any device)."""

    name = "torch"

    def find(self, s, keys: torch.Tensor, rows_only: bool = False) -> torch.Tensor:
        codes, _ = probe(s._buckets, keys)
        codes = s._side_fix(keys, codes)
        return codes.clamp_(min=-1) if rows_only else codes

    def find_or_insert(self, s, keys, counts, step, row_limit):
        """Mirror of he_hs_find_or_insert; returns (status, out, new_slots, new_keys, need)."""
        n, dev = keys.numel(), keys.device
        codes, pos = probe(s._buckets, keys)
        codes = s._side_fix(keys, codes)
        c = counts if counts is not None else torch.ones(n, dtype=torch.int64, device=dev)
        side = keys == EMPTY
        found = codes != -1
        w1 = torch.zeros(n, dtype=torch.int64, device=dev)
        w1[found & ~side] = s._buckets[pos[found & ~side], 1]
        if bool(side.any()) and s._st_get("side_used"):
            w1[side] = s._st_get("side_word1")
        new_count = torch.where(found, count_of(w1), 0) + c
        todo = codes < 0
        ti = todo.nonzero().squeeze(1)
        tk = keys[ti]
        if ti.numel() > 1:
            sk = tk.sort().values
            dup = sk[1:] == sk[:-1]
            if bool(dup.any()):
                return 3, codes, None, None, [int(sk[1:][dup][0]), 0, 0, 0]
        k = s.admit_min_count
        is_a = codes[ti] == -1
        need_row = torch.where(is_a, c[ti] >= k, new_count[ti] >= k)
        new_rows = int(need_row.sum())
        new_pend = int((is_a & ~need_row).sum())
        need = [int((is_a & (tk != EMPTY)).sum()), new_rows, new_pend, 0]
        if s._st_get("rows") + new_rows > row_limit:
            return 2, codes, None, None, need
        if (s._st_get("entries") + need[0] > s._max_entries()
                or s._st_get("row_hwm") + max(0, new_rows - s._st_get("num_free")) > s._storage.shape[0]):
            return 1, codes, None, None, need

        # Keys found (rows and pending): add counts, set last step.
        slots = s._take_rows(new_rows)  # handed out in batch order
        code_now = codes.clone()
        code_now[ti[need_row]] = slots
        code_now[ti[is_a & ~need_row]] = PENDING
        upd = found & ~side
        s._buckets[pos[upd], 1] = pack(code_now[upd], new_count[upd])
        s._buckets[pos[upd], 2] = step
        # New keys: a record with a row when admitted, pending otherwise.
        new = ti[is_a]
        rec = _records(keys[new], code_now[new], c[new], torch.full_like(new, step))
        ns = keys[new] == EMPTY
        claim(s._buckets, rec[~ns], pos[new][~ns])
        sidx = side.nonzero().squeeze(1)
        if sidx.numel():
            i = int(sidx[0])
            s._st_set("side_used", 1)
            s._st_set("side_word1", int(pack(code_now[i : i + 1], new_count[i : i + 1])[0]))
            s._st_set("side_last", step)
        promoted = int((need_row & ~is_a).sum())
        s._st_add("entries", int((~ns).sum()))
        s._st_add("rows", new_rows)
        s._st_add("pending", new_pend - promoted)
        out = torch.where(code_now >= 0, code_now, -1)
        need[3] = new_rows
        return 0, out, slots, tk[need_row], need

    def insert(self, s, keys, codes, counts, lasts) -> None:
        """Inserts unique keys known to be absent with their code, count and last step."""
        side = keys == EMPTY
        if bool(side.any()):
            i = int(side.nonzero()[0])
            s._st_set("side_used", 1)
            s._st_set("side_word1", int(pack(codes[i : i + 1], counts[i : i + 1])[0]))
            s._st_set("side_last", int(lasts[i]))
        claim(s._buckets, _records(keys, codes, counts, lasts)[~side])
        s._st_add("entries", int((~side).sum()))

    def erase(self, s, keys: torch.Tensor) -> None:
        """Removes keys (all present) by rebuilding the buckets without them."""
        side = keys == EMPTY
        if bool(side.any()):
            s._st_set("side_used", 0)
        rec = entries(s._buckets)
        keep = ~torch.isin(rec[:, 0], keys[~side])
        new_buckets(s._buckets.shape[0], s.device, out=s._buckets)
        claim(s._buckets, rec[keep])
        s._st_set("entries", int(keep.sum()))

    def rehash(self, s, new: torch.Tensor) -> None:
        rec = entries(s._buckets)
        new_buckets(new.shape[0], s.device, out=new)
        claim(new, rec)
