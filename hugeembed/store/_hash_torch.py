"""The plain-PyTorch twin of csrc/hash_store.cpp: same layout, vectorised probing.

Runs on any device (it is the CUDA path) and is the CPU parity twin of the native
kernels.  Bucket records are int64 [B, 3] = (key, code | count << 32, last step);
see csrc/store_table.h.  Home buckets use a multiply-shift of the hash, so B need not be a power of two.
Probing advances every unresolved key at once over a
window of buckets that doubles each round (1, 2, 4, ... 32), so a batch finishes
in a handful of rounds even when a few keys sit far from home.  Concurrent inserts
that pick the same empty bucket are resolved by a stable sort over the bucket wanted:
the lowest batch index wins, the others move on to the next bucket.  A group of tables
(_hash_group.py) probes a fixed window first (:func:`probe_window`) and claims its first
rounds masked (``claim(sink=...)``), reading the device once for each instead of per round.
"""

from __future__ import annotations

import enum

import torch

from .._hashing import logical_shift_right, mix64
from ..functional import kept_positions

__all__ = ["TorchOps", "EMPTY", "PENDING", "new_buckets", "entries", "pack", "code_of", "count_of", "probe",
           "probe_window"]

EMPTY = -(2**63)
_MAX_SLOTS = 2**31 - 2  # slots are int32 in the buckets
# A store's scalars (HashStore._st): must match csrc/store_table.h::StoreScalar.
_ST = {"entries": 0, "row_hwm": 1, "num_free": 2, "side_used": 3, "side_word1": 4, "side_last": 5, "rows": 6,
       "pending": 7}
PENDING = -2


class Outcome(enum.IntEnum):
    """What a find-or-insert did, on both backends (csrc/hash_store.cpp::Outcome): all but DONE
    leave the store exactly as before, for the caller to grow it, make room or raise."""

    DONE = 0
    MUST_GROW = 1  # need[0..2]: new bucket entries, rows, pending keys
    OVER_LIMIT = 2  # need[1]: the rows wanted beyond the row limit
    DUPLICATE_KEY = 3  # need[0]: the key given twice
    BAD_COUNT = 4  # (find_or_insert_many) a count below 1: the table's own call raises with the details
_COUNT_MAX = 2**31 - 1
_MAX_WINDOW = 32
_WINDOW_ELEMENTS = 1 << 24  # probe_window's bound on keys x window
_MASKED_ROUNDS = 4  # claim's rounds before its read (windows 1, 2, 4, 8 buckets)


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


def probe(buckets: torch.Tensor, keys: torch.Tensor, base: torch.Tensor | None = None,
          size: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int64 [n] (row >= 0, pending -2, absent -1) and pos int64 [n] (bucket of the
    key, or first empty bucket on its probe path).  Keys equal to EMPTY are left at -1.

    `base`, `size` (int64 [n], optional): each key's table is ``buckets[base:base + size]``, so
    the keys of several tables whose buckets are parts of one array probe in one loop (positions
    are of `buckets`); default: one table, all of `buckets`."""
    n = keys.numel()
    dev = keys.device
    codes = torch.full((n,), -1, dtype=torch.int64, device=dev)
    pos = torch.full((n,), -1, dtype=torch.int64, device=dev)
    idx = (keys != EMPTY).nonzero().squeeze(1)
    k = keys[idx]
    at = _Tables(buckets.shape[0], base, size, idx)
    p = _home(k, at.size)
    width = 1
    ar = torch.arange(_MAX_WINDOW, device=dev)
    bkeys = buckets[:, 0]
    while idx.numel():
        q, done, hit = _probe_round(bkeys, at, k, p, ar[:width])
        d, kept = _split(done)  # one read of the device per round
        di, dq = idx[d], q[d]
        codes[di] = torch.where(hit[d], code_of(buckets[dq, 1]), -1)
        pos[di] = dq
        idx, k = idx[kept], k[kept]
        p = at.keep(kept, p + width)
        width = min(2 * width, _MAX_WINDOW)
    return codes, pos


def probe_window(buckets: torch.Tensor, keys: torch.Tensor, base: torch.Tensor | None, size: torch.Tensor | None,
                 width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`probe` over the first `width` buckets of each key's path only, with no read of the
    device: (codes, pos, unresolved), `unresolved` marking the keys that met neither their own
    record nor an empty bucket there (their codes and pos are then -1: the caller probes them
    again with :func:`probe`).  Keys equal to EMPTY are left at -1 and resolved.

    The window shrinks for big batches, to at most _WINDOW_ELEMENTS buckets in all (each a few
    int64 temporaries: 2**24 is 128 MB apiece; one bucket a key past that many keys); more keys
    are then left to :func:`probe`."""
    width = max(1, min(width, _WINDOW_ELEMENTS // max(keys.numel(), 1)))
    at = _Tables(buckets.shape[0], base, size)
    ar = torch.arange(width, device=keys.device)
    q, done, hit = _probe_round(buckets[:, 0], at, keys, _home(keys, at.size), ar)
    real = keys != EMPTY
    done &= real
    codes = torch.where(done & hit, code_of(buckets[q, 1]), -1)
    return codes, torch.where(done, q, -1), real & ~done


def _probe_round(bkeys: torch.Tensor, at: "_Tables", keys: torch.Tensor, p: torch.Tensor,
                 ar: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round of :func:`probe`: over the buckets `ar` from each key's local position `p`, (the
    first bucket holding the key or empty, whether there is one, whether it holds the key)."""
    win = at.window(p, ar)
    bk = bkeys[win]
    stop = (bk == keys[:, None]) | (bk == EMPTY)
    first = stop.to(torch.uint8).argmax(1)[:, None]
    return win.gather(1, first).squeeze(1), stop.any(1), bk.gather(1, first).squeeze(1) == keys


def _split(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions where `mask` holds and where it does not, with one read of the device (the
    count) instead of one per boolean index."""
    n_true = int(mask.sum())
    return kept_positions(mask, n_true), kept_positions(~mask, mask.numel() - n_true)


class _Tables:
    """Where each probing key's table lies in the bucket array: all of it (scalar size, base 0),
    or per key ``[base, base + size)`` (tensors, filtered along with the keys)."""

    def __init__(self, nbuckets: int, base: torch.Tensor | None, size: torch.Tensor | None,
                 idx: torch.Tensor | None = None):
        if (base is None) != (size is None):
            raise ValueError("probe: base and size go together")
        self.base = 0 if base is None else (base if idx is None else base[idx])
        self.size = nbuckets if size is None else (size if idx is None else size[idx])

    def window(self, p: torch.Tensor, ar: torch.Tensor) -> torch.Tensor:
        """Bucket positions of the `ar` buckets from each key's local position `p` on (wrapping in its table)."""
        if isinstance(self.size, int):
            return (p[:, None] + ar) % self.size
        return (p[:, None] + ar) % self.size[:, None] + self.base[:, None]

    def local(self, q: torch.Tensor) -> torch.Tensor:
        return q - self.base

    def wrap(self, p: torch.Tensor) -> torch.Tensor:
        """Local positions `p` wrapped in their tables."""
        return p % self.size

    def keep(self, keep: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Filters the per-key tables by `keep`, and returns p[keep] wrapped in them."""
        if isinstance(self.size, int):
            return p[keep] % self.size
        self.base, self.size = self.base[keep], self.size[keep]
        return p[keep] % self.size


def claim(buckets: torch.Tensor, records: torch.Tensor, start: torch.Tensor | None = None,
          base: torch.Tensor | None = None, size: torch.Tensor | None = None, sink: int | None = None) -> None:
    """Puts records int64 [n, 3] of unique keys known to be absent (none EMPTY) into the buckets.

    `start` is where each key's search for an empty bucket may begin (its home, or
    the first empty bucket a probe met): every bucket before it is occupied.  `base`, `size`:
    each record's table within `buckets`, as for :func:`probe` (`start` is then a position
    in `buckets`, inside the record's table).  `sink`: a bucket of no table (a BucketGroup's
    last), where masked writes may land: the first _MASKED_ROUNDS rounds then run over every
    key, placed or not, with no read of the device (:func:`claim_masked`), and one read says
    whether any is left (the same rounds, so the same buckets, as the loop alone).
    """
    n = records.shape[0]
    if n == 0:
        return
    if sink is None:
        at = _Tables(buckets.shape[0], base, size)
        p = _home(records[:, 0], at.size) if start is None else at.local(start)
        claim_rest(buckets, records, torch.arange(n, device=records.device), p, base, size, 1)
        return
    _, left, p = claim_masked(buckets, records, start, base, size, sink)
    idx = kept_positions(left, int(left.sum()))  # the one read of the device, when every key found its bucket
    claim_rest(buckets, records, idx, p[idx], base, size)


def claim_masked(buckets: torch.Tensor, records: torch.Tensor, start: torch.Tensor | None,
                 base: torch.Tensor | None, size: torch.Tensor | None, sink: int,
                 active: torch.Tensor | None = None,
                 landed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first _MASKED_ROUNDS rounds of :func:`claim` over the records `active` (default all),
    with no read of the device: the writes of the keys not placed in a round land in the bucket
    `sink` (of no table; emptied again at the end).

    Returns where each record landed (`sink`: nowhere), which active records are left, and
    each key's local position to go on from (:func:`claim_rest` with those records).
    `landed`: int64 [n] filled with `sink`, updated in place before each round's write, so
    that a caller whose claim raises half-way knows every bucket it may have written.
    """
    if base is None:  # one table over all of `buckets`: the sink would be one of its buckets
        raise ValueError("claim: a sink needs the tables' base and size (a bucket outside every table)")
    n, dev = records.shape[0], records.device
    at = _Tables(buckets.shape[0], base, size)
    p = _home(records[:, 0], at.size) if start is None else at.local(start)
    ar = torch.arange(_MAX_WINDOW, device=dev)
    bkeys = buckets[:, 0]
    left = torch.ones(n, dtype=torch.bool, device=dev) if active is None else active.clone()
    if landed is None:
        landed = torch.full((n,), sink, dtype=torch.int64, device=dev)
    width = 1
    for _ in range(_MASKED_ROUNDS):
        q, has, won = _claim_round(bkeys, at, p, ar[:width], left)
        landed.copy_(torch.where(won, q, landed))
        buckets[torch.where(won, q, sink)] = records
        p = at.wrap(torch.where(has, at.local(q) + 1, p + width))
        left &= ~won
        width = min(2 * width, _MAX_WINDOW)
    new_buckets(1, dev, out=buckets[sink : sink + 1])  # the sink holds no record (scans see none)
    return landed, left, p


def claim_rest(buckets: torch.Tensor, records: torch.Tensor, idx: torch.Tensor, p: torch.Tensor,
               base: torch.Tensor | None, size: torch.Tensor | None, width: int = 1 << _MASKED_ROUNDS) -> None:
    """Claims buckets for records[idx], from local positions `p` on (after claim_masked's rounds:
    their windows go on doubling from 2**_MASKED_ROUNDS), a read of the device per round."""
    at = _Tables(buckets.shape[0], base, size, idx)
    ar = torch.arange(_MAX_WINDOW, device=records.device)
    bkeys = buckets[:, 0]
    width = min(width, _MAX_WINDOW)
    while idx.numel():
        q, has, won = _claim_round(bkeys, at, p, ar[:width])
        # Losers retry right after the bucket they lost; keys with no empty in
        # their window skip the whole window (all of it was occupied).
        nxt = torch.where(has, at.local(q) + 1, p + width)
        w, kept = _split(won)  # one read of the device per round
        buckets[q[w]] = records[idx[w]]
        idx = idx[kept]
        p = at.keep(kept, nxt)
        width = min(2 * width, _MAX_WINDOW)


def unclaim(buckets: torch.Tensor, at: torch.Tensor, sink: int) -> None:
    """Empties the buckets `at` (claim_masked's `landed`, or the part of it to undo; `sink`: none)
    and the sink.  A table's claims all undone leave its buckets as they were: the claims only
    filled empty buckets."""
    empty = new_buckets(1, buckets.device)
    buckets[at] = empty
    buckets[sink : sink + 1] = empty


def _claim_round(bkeys: torch.Tensor, at: "_Tables", p: torch.Tensor, ar: torch.Tensor,
                 active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One round of :func:`claim` over the keys at local positions `p` (those `active`, default
    all): (the first empty bucket in each key's window, whether it has one, whether it won it)."""
    win = at.window(p, ar)
    empty = bkeys[win] == EMPTY
    has = empty.any(1)
    if active is not None:
        has &= active
    q = win.gather(1, empty.to(torch.uint8).argmax(1)[:, None]).squeeze(1)
    # Several keys may want the same empty bucket: the lowest batch index wins (keys are in
    # ascending batch order, so the first of each run of a stable sort by bucket).
    want = torch.where(has, q, -1)
    order = torch.argsort(want, stable=True)
    ws = want[order]
    first = torch.ones_like(has)
    first[1:] = ws[1:] != ws[:-1]
    won = torch.zeros_like(has)
    won[order] = first
    return q, has, won & has


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
                return Outcome.DUPLICATE_KEY, codes, None, None, [int(sk[1:][dup][0]), 0, 0, 0]
        k = s.admit_min_count
        is_a = codes[ti] == -1
        need_row = torch.where(is_a, c[ti] >= k, new_count[ti] >= k)
        new_rows = int(need_row.sum())
        new_pend = int((is_a & ~need_row).sum())
        need = [int((is_a & (tk != EMPTY)).sum()), new_rows, new_pend, 0]
        if s._st_get("rows") + new_rows > row_limit:
            return Outcome.OVER_LIMIT, codes, None, None, need
        if (s._st_get("entries") + need[0] > s._max_entries()
                or s._st_get("row_hwm") + max(0, new_rows - s._st_get("num_free")) > s._storage.shape[0]):
            return Outcome.MUST_GROW, codes, None, None, need

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
        return Outcome.DONE, out, slots, tk[need_row], need

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
