"""The plain-PyTorch twin of csrc/hash_store.cpp: same layout, vectorised probing.

Runs on any device (it is the CUDA path) and is the CPU parity twin of the native
kernels.  Probing advances every unresolved key at once over a window of buckets
that doubles each round (1, 2, 4, ... 32), so a batch finishes in a handful of
rounds even when a few keys sit far from home.  Concurrent inserts that pick the
same empty bucket are resolved with ``scatter_reduce(amin)`` over their batch
index: the lowest index wins, the others move on to the next bucket.
"""

from __future__ import annotations

import torch

from .._hashing import mix64

__all__ = ["TorchOps", "EMPTY"]

EMPTY = -(2**63)
_MAX_WINDOW = 32


# --- the packed bucket records: int32 [B, 3] = key low word, key high word, code
def new_buckets(nbuckets: int, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """Empty bucket records (key EMPTY, code -1); fills `out` when given."""
    b = torch.empty(nbuckets, 3, dtype=torch.int32, device=device) if out is None else out
    b[:, :2] = torch.tensor([EMPTY], dtype=torch.int64).view(torch.int32).to(device)
    b[:, 2] = -1
    return b


def split_keys(keys: torch.Tensor) -> torch.Tensor:
    """int64 [m] -> int32 [m, 2] (low word, high word) as the records hold them."""
    return keys.contiguous().view(torch.int32).view(-1, 2)


def keys_at(buckets: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Keys of the buckets at `idx` (any shape) as int64 of that shape."""
    rec = buckets[:, :2][idx.reshape(-1)]
    return rec.contiguous().view(torch.int64).view(idx.shape)


def all_keys(buckets: torch.Tensor) -> torch.Tensor:
    return buckets[:, :2].contiguous().view(torch.int64).view(-1)


def write(buckets: torch.Tensor, idx: torch.Tensor, keys: torch.Tensor, codes: torch.Tensor) -> None:
    buckets[idx, :2] = split_keys(keys)
    buckets[idx, 2] = codes.to(torch.int32)


def _home(keys: torch.Tensor, nbuckets: int) -> torch.Tensor:
    return mix64(keys) & (nbuckets - 1)


def probe(buckets: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int64 [n] (row >= 0, pending <= -2, absent -1) and pos int64 [n] (bucket of
    the key, or first empty bucket on its probe path).  Keys equal to EMPTY are left at -1."""
    n, nb = keys.numel(), buckets.shape[0]
    dev = keys.device
    codes = torch.full((n,), -1, dtype=torch.int64, device=dev)
    pos = torch.full((n,), -1, dtype=torch.int64, device=dev)
    idx = (keys != EMPTY).nonzero().squeeze(1)
    k = keys[idx]
    p = _home(k, nb)
    width = 1
    ar = torch.arange(_MAX_WINDOW, device=dev)
    while idx.numel():
        win = (p[:, None] + ar[:width]) & (nb - 1)
        bk = keys_at(buckets, win)
        stop = (bk == k[:, None]) | (bk == EMPTY)
        done = stop.any(1)
        first = stop.to(torch.uint8).argmax(1)
        q = win.gather(1, first[:, None]).squeeze(1)
        hit = bk.gather(1, first[:, None]).squeeze(1) == k
        di, dq, dh = idx[done], q[done], hit[done]
        codes[di] = torch.where(dh, buckets[dq, 2].to(torch.int64), -1)
        pos[di] = dq
        keep = ~done
        idx, p, k = idx[keep], (p[keep] + width) & (nb - 1), k[keep]
        width = min(2 * width, _MAX_WINDOW)
    return codes, pos


def claim(buckets: torch.Tensor, keys: torch.Tensor, codes: torch.Tensor, start: torch.Tensor | None = None) -> None:
    """Puts unique keys known to be absent (none equal to EMPTY) into the buckets.

    `start` is where each key's search for an empty bucket may begin (its home, or
    the first empty bucket a probe met): every bucket before it is occupied.
    """
    n, nb = keys.numel(), buckets.shape[0]
    if n == 0:
        return
    dev = keys.device
    idx = torch.arange(n, device=dev)
    p = _home(keys, nb) if start is None else start.clone()
    ar = torch.arange(_MAX_WINDOW, device=dev)
    width = 1
    while idx.numel():
        win = (p[:, None] + ar[:width]) & (nb - 1)
        empty = keys_at(buckets, win) == EMPTY
        has = empty.any(1)
        q = win.gather(1, empty.to(torch.uint8).argmax(1)[:, None]).squeeze(1)
        ci, cq = idx[has], q[has]
        # Several keys may want the same empty bucket: the lowest batch index wins.
        uq, inv = torch.unique(cq, return_inverse=True)
        winner = torch.full((uq.numel(),), n, dtype=torch.int64, device=dev)
        winner.scatter_reduce_(0, inv, ci, "amin")
        won = winner[inv] == ci
        wi, wq = ci[won], cq[won]
        write(buckets, wq, keys[wi], codes[wi])
        # Losers retry right after the bucket they lost; keys with no empty in
        # their window skip the whole window (all of it was occupied).
        nxt = torch.where(has, q + 1, p + width) & (nb - 1)
        keep = torch.ones(idx.numel(), dtype=torch.bool, device=dev)
        keep[has.nonzero().squeeze(1)[won]] = False
        idx, p = idx[keep], nxt[keep]
        width = min(2 * width, _MAX_WINDOW)


def entries(buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and int64 codes of all occupied buckets."""
    keys = all_keys(buckets)
    occ = (keys != EMPTY).nonzero().squeeze(1)
    return keys[occ], buckets[occ, 2].to(torch.int64)


class TorchOps:
    """Backend of HashStore built on torch ops (any device)."""

    name = "torch"

    def find(self, s, keys: torch.Tensor) -> torch.Tensor:
        codes, _ = probe(s._buckets, keys)
        return s._side_fix(keys, codes)

    def find_or_insert(self, s, keys, counts, step, row_limit):
        """Mirror of he_hs_find_or_insert; returns (status, out, new_slots, new_keys, need)."""
        n, dev = keys.numel(), keys.device
        codes, pos = probe(s._buckets, keys)
        codes = s._side_fix(keys, codes)
        c = counts if counts is not None else torch.ones(n, dtype=torch.int64, device=dev)
        ti = (codes < 0).nonzero().squeeze(1)
        tk, tcodes, tc = keys[ti], codes[ti], c[ti]
        if ti.numel() > 1:
            sk = tk.sort().values
            dup = sk[1:] == sk[:-1]
            if bool(dup.any()):
                return 3, codes, None, None, [int(sk[1:][dup][0]), 0, 0, 0]
        k = s.admit_min_count
        is_p = tcodes <= -2
        pid = -2 - tcodes[is_p]
        pcount = s._pmeta[pid, 0] + tc[is_p]
        promote = pcount >= k
        is_a = tcodes == -1
        admit = tc[is_a] >= k
        new_rows = int(promote.sum()) + int(admit.sum())
        new_pend = int(is_a.sum()) - int(admit.sum())
        need = [int((tk[is_a] != EMPTY).sum()), new_rows, new_pend, 0]
        if s._st_get("rows") + new_rows > row_limit:
            return 2, codes, None, None, need
        if (s._st_get("entries") + need[0] > s._max_entries()
                or s._st_get("row_hwm") + max(0, new_rows - s._st_get("num_free")) > s._meta.shape[0]
                or s._st_get("pend_hwm") + max(0, new_pend - s._st_get("num_pfree")) > s._pmeta.shape[0]):
            return 1, codes, None, None, need

        # Hits: add counts, set last step.
        hit = codes >= 0
        hs = codes[hit]
        s._meta[:, 0].index_add_(0, hs, c[hit])
        s._meta[hs, 1] = step
        s._pmeta[pid, 0] = pcount
        s._pmeta[pid, 1] = step

        # Rows for promoted and newly admitted keys, handed out in batch order.
        need_row = torch.zeros(ti.numel(), dtype=torch.bool, device=dev)
        need_row[is_p.nonzero().squeeze(1)[promote]] = True
        need_row[is_a.nonzero().squeeze(1)[admit]] = True
        slots = s._take_rows(new_rows)
        slot_of = torch.full((ti.numel(),), -1, dtype=torch.int64, device=dev)
        slot_of[need_row] = slots

        # Promotions: pending meta moves to the row, the bucket now names the row.
        pr = is_p & need_row
        pr_slots, pr_pid = slot_of[pr], pid[promote]
        s._meta[pr_slots] = s._pmeta[pr_pid]
        pr_keys, pr_pos = tk[pr], pos[ti[pr]]
        side = pr_keys == EMPTY
        s._buckets[pr_pos[~side], 2] = pr_slots[~side].to(torch.int32)
        if bool(side.any()):
            s._st_set("side_code", int(pr_slots[side][0]))

        # New keys: a row when admitted, else a pending entry.
        a_rows = is_a & need_row
        s._meta[slot_of[a_rows], 0] = tc[a_rows]
        s._meta[slot_of[a_rows], 1] = step
        a_pend = is_a & ~need_row
        pids = s._take_pending(new_pend)
        s._pmeta[pids, 0] = tc[a_pend]
        s._pmeta[pids, 1] = step
        new_code = torch.empty(ti.numel(), dtype=torch.int64, device=dev)
        new_code[a_rows] = slot_of[a_rows]
        new_code[a_pend] = -2 - pids
        ins = is_a.nonzero().squeeze(1)
        ins_keys, ins_code, ins_pos = tk[ins], new_code[ins], pos[ti[ins]]
        side = ins_keys == EMPTY
        if bool(side.any()):
            s._st_set("side_used", 1)
            s._st_set("side_code", int(ins_code[side][0]))
        claim(s._buckets, ins_keys[~side], ins_code[~side], ins_pos[~side])
        s._st_add("entries", int((~side).sum()))
        s._st_add("rows", new_rows)
        s._st_add("pending", new_pend - int(promote.sum()))
        s._push_pending(pr_pid)

        out = codes.clone()
        out[ti] = slot_of
        need[3] = new_rows
        return 0, out, slots, tk[need_row], need

    def insert(self, s, keys: torch.Tensor, codes: torch.Tensor) -> None:
        """Inserts unique keys known to be absent with the given codes."""
        side = keys == EMPTY
        if bool(side.any()):
            s._st_set("side_used", 1)
            s._st_set("side_code", int(codes[side][0]))
            keys, codes = keys[~side], codes[~side]
        claim(s._buckets, keys, codes)
        s._st_add("entries", keys.numel())

    def erase(self, s, keys: torch.Tensor) -> None:
        """Removes keys (all present) by rebuilding the buckets without them."""
        side = keys == EMPTY
        if bool(side.any()):
            s._st_set("side_used", 0)
        ek, ec = entries(s._buckets)
        keep = ~torch.isin(ek, keys[~side])
        new_buckets(s._buckets.shape[0], s.device, out=s._buckets)
        claim(s._buckets, ek[keep], ec[keep])
        s._st_set("entries", int(keep.sum()))

    def rehash(self, s, new: torch.Tensor) -> None:
        ek, ec = entries(s._buckets)
        new_buckets(new.shape[0], s.device, out=new)
        claim(new, ek, ec)
