"""The plain-PyTorch reference of a dynamic group's key index (layout: store/_index.py): the
specification csrc/group_index.cpp implements, the tests' second implementation beside the
DictStore oracle, and the fallback on devices without kernels.

Written to be read, not tuned: probing looks at each key's first 4 buckets, then advances the keys
left over windows that double each round (32 to 128); every call runs the first two rounds (the second
often over no key), and each round reads the device once.  New records go into the first
empty bucket on their path; keys that want the same empty bucket are settled by a stable sort:
the lowest batch position wins, the others move on (so the result never depends on scheduling).
Row slots are handed out in batch order, smallest free slot first, exactly as the kernels do.
"""

from __future__ import annotations

import torch

from ..errors import InputError, StoreError
from ._index import (EMPTY_TABLE, G_ENTRIES, G_NUM_FREE, G_ROW_HWM, NEED_HEAD, PENDING, PROBE_LIMIT, T_ADMIT_K,
                     T_HASH_KEY, T_PENDING, T_ROW_LIMIT, T_ROWS, Need, Outcome, code_of, count_of, home, new_buckets,
                     pack)

__all__ = ["TorchIndex"]

# Each round looks at a window of buckets per key: 4 at first, then 32 (the longest probe among tens of
# thousands of keys is about 8 + 32), doubling to 128.  At a 0.55 load (bench/ops.py's dynamic step, 26
# tables) 89% of the probes stop within 4 buckets, 98% within 8: a first window of 4 does ~25% less
# bucket reading and comparing than one of 8 (the keys past it pay 32 more), and one of 32 for every key
# was most of a dynamic step's work.  Every call runs the first two rounds, the second over the keys
# left (often none): whether some key goes past the first window then changes neither the ops nor the
# Python a step runs (tests/bench/test_ops_per_step.py counts those lines).
_FIRST_WINDOW, _SECOND_WINDOW, _MAX_WINDOW, _ROUNDS = 4, 32, 128, 2


def _wrapped(x: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``x % n`` for x in [0, n + width): one subtraction where it passes the end (an integer remainder
    costs ~4x a compare and a subtraction per element)."""
    return x - n * (x >= n) if width <= n else x % n


def _homes(g, keys: torch.Tensor, tids: torch.Tensor, nbuckets: int | None = None) -> torch.Tensor:
    hk = g.tables[:, T_HASH_KEY].to(keys.device).index_select(0, tids)
    return home(keys, hk, g.buckets.shape[0] if nbuckets is None else nbuckets)


def probe(g, keys: torch.Tensor, tids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, pos, probes) of (table, key) pairs (tids >= 0): code -1 when absent; pos the key's
    bucket or the first empty one on its path; probes the buckets looked at."""
    dev = keys.device
    B = g.buckets.shape[0]
    start = _homes(g, keys, tids)
    idx, p = None, start  # idx: the keys left (None: all of them, the first round: no gathers)
    width, rounds = _FIRST_WINDOW, 0
    while idx is None or idx.numel() or rounds < _ROUNDS:
        win = _wrapped(p[:, None] + torch.arange(width, device=dev), B, width)
        # the window's (key, table) columns in one gather of whole records
        rec = g.buckets.index_select(0, win.reshape(-1)).view(*win.shape, g.buckets.shape[1])
        bkeys, btabs = rec[..., 0], rec[..., 1]
        k, t = (keys, tids) if idx is None else (keys.index_select(0, idx), tids.index_select(0, idx))
        stop = ((bkeys == k[:, None]) & (btabs == t[:, None])) | (btabs == EMPTY_TABLE)
        stops, first = stop.to(torch.uint8).max(1, keepdim=True)  # (max: whether any, and the first, in one pass)
        at = win.gather(1, first).squeeze(1)  # (a key not done yet: written again by a later round)
        if idx is None:
            pos = at
        else:
            pos.index_copy_(0, idx, at)
        keep = (stops.squeeze(1) == 0).nonzero().squeeze(1)  # a read of the device per round
        idx = keep if idx is None else idx.index_select(0, keep)
        p = _wrapped(p.index_select(0, keep) + width, B, width)
        width, rounds = _SECOND_WINDOW if rounds == 0 else min(2 * width, _MAX_WINDOW), rounds + 1
    got = g.buckets.index_select(0, pos)  # (x[i] of a 2-D tensor costs ~8x index_select a row)
    codes = torch.where(got[:, 1] != EMPTY_TABLE, code_of(got[:, 2]), -1)
    probes = (pos - start) % B + 1
    return codes, pos, probes


def _firsts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, rank): x's stable sort order, and each entry's rank among the entries equal to it
    (0 for the lowest position)."""
    order = torch.argsort(x, stable=True)
    xs = x[order]
    i = torch.arange(x.numel(), device=x.device)
    new = torch.ones_like(xs, dtype=torch.bool)
    new[1:] = xs[1:] != xs[:-1]
    rank = torch.empty_like(i)
    rank[order] = i - torch.cummax(torch.where(new, i, 0), 0).values
    return order, rank


def claim(buckets: torch.Tensor, records: torch.Tensor, start: torch.Tensor) -> None:
    """Writes records int64 [n, 4] of absent, unique pairs as linear probing places them from
    `start` on.  Keys whose first empty bucket is one bucket take the empty buckets from there in
    position order (the lowest position the first): one round for a crowd, not one per key; keys of
    two crowds wanting one bucket: the lowest position wins, the other goes on after it.  Each
    bucket a key passes is filled in the same round (by it or by a winner), so no empty bucket
    lies between a key's home and its bucket."""
    B, dev = buckets.shape[0], records.device
    idx, p = torch.arange(records.shape[0], device=dev), start.clone()
    btabs = buckets[:, 1]
    width = _SECOND_WINDOW  # (new keys, few in a steady step: one window of 32, as before)
    while idx.numel():
        win = _wrapped(p[:, None] + torch.arange(width, device=dev), B, width)
        empty = btabs[win] == EMPTY_TABLE
        has = empty.any(1)
        first = win.gather(1, empty.to(torch.uint8).argmax(1, keepdim=True)).squeeze(1)
        _, rank = _firsts(torch.where(has, first, -1))
        at = (empty.cumsum(1) <= rank[:, None]).sum(1)  # the window's (rank+1)-th empty (width: none)
        ok = has & (at < width)
        want = torch.where(ok, win.gather(1, at.clamp(max=width - 1)[:, None]).squeeze(1), -1)
        _, clash = _firsts(want)
        won = ok & (clash == 0)
        buckets[want[won]] = records[idx[won]]
        nxt = torch.where(ok, want + 1, p + width) % B
        keep = (~won).nonzero().squeeze(1)
        idx, p = idx[keep], nxt[keep]
        width = min(2 * width, _MAX_WINDOW)


def _state(g, need: list[int]) -> Need:
    """`need` with the group's state after the call appended, as the kernel reports it."""
    after = g.scalars.tolist() + g.tables[:, [T_ROWS, T_PENDING]].reshape(-1).tolist()
    return Need(need + after, g.tables.shape[0])


def _crowding(g, keys: torch.Tensor, tids: torch.Tensor) -> tuple[int, int]:
    """(the longest probe, its table) the keys would have placed alone into an empty index: a lower
    bound on their probes once placed, which ids chosen to share homes make long."""
    if keys.numel() < 2:
        return 0, -1
    homes = _homes(g, keys, tids)
    order = torch.argsort(homes, stable=True)  # ties in batch order: the table reported is the same on any device
    i = torch.arange(keys.numel(), device=keys.device)
    h = homes[order]
    probes = torch.cummax(h - i, 0).values + i - h + 1
    j = int(probes.argmax())
    return int(probes[j]), int(tids[order[j]])


def place_all(buckets: torch.Tensor, records: torch.Tensor, homes: torch.Tensor) -> None:
    """Writes records int64 [n, 4] (unique pairs) with their `homes` into EMPTY `buckets`, as linear
    probing places them: sorted by home, each at ``max(home, the one before + 1)`` (one cummax, not a
    round per bucket); the records pushed past the end wrap to the front, ahead of the rest, until
    none is left past it.  Any insertion order gives the same occupied buckets: this layout is valid."""
    n, B, dev = records.shape[0], buckets.shape[0], records.device
    rest = torch.argsort(homes, stable=True)
    wrapped = rest[:0]
    i = torch.arange(n, device=dev)
    while True:
        order = torch.cat([wrapped, rest])
        start = torch.cat([torch.zeros_like(wrapped), homes[rest]])
        pos = torch.cummax(start - i, 0).values + i
        over = int((pos >= B).sum())  # a read per pass: one pass, two when the end cluster wraps
        if over == 0:
            buckets[pos] = records[order]
            return
        wrapped, rest = torch.cat([wrapped, rest[rest.numel() - over:]]), rest[: rest.numel() - over]


def _true_at(mask: torch.Tensor) -> torch.Tensor | slice:
    """The positions where `mask` holds: a slice of all when it holds everywhere (x[at] is then a
    view, not a gather: the collection's fetch skips no key, and a steady step finds them all)."""
    at = mask.nonzero().squeeze(1)  # (its size: a read of the device, as any nonzero)
    return slice(None) if at.numel() == mask.numel() else at


def _check(g, tids: torch.Tensor, counts: torch.Tensor | None) -> None:
    """The kernel's checks: a table column naming a table of the group (else our bug), counts >= 1."""
    if tids.numel() and bool(((tids < -1) | (tids >= g.tables.shape[0])).any()):
        raise StoreError("group index: a table column entry names no table of the group (internal error)")
    if counts is not None:
        bad = ((counts < 1) & (tids >= 0)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise InputError(f"table '{g.settings[int(tids[i])].name}': counts must be >= 1 (occurrences in the "
                             f"batch), got {int(counts[i])}")


class TorchIndex:
    """The reference backend: the same calls as store/_index_native.py::NativeIndex."""

    name = "torch"

    def find(self, g, keys: torch.Tensor, tids: torch.Tensor, rows_only: bool,
             hits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check(g, tids, None)
        codes = torch.full_like(keys, -1)
        counts = torch.zeros_like(keys) if hits else None
        sel = _true_at(tids >= 0)
        k = keys[sel]
        if k.numel():
            c, pos, _ = probe(g, k, tids[sel])
            codes[sel] = c
            if hits:
                counts[sel] = torch.where(c != -1, count_of(g.buckets[pos, 2]), 0)
        if rows_only:
            codes.clamp_(min=-1)
        return codes, counts

    def find_or_insert(self, g, keys, tids, counts, admit, step: int, out, hits, init) -> tuple[Outcome, list, tuple]:
        """The kernel's contract (csrc/group_find_or_insert.cpp::find_or_insert): (outcome, need, the new
        rows' (slots, keys, tables)).  `init` is not used: the group initialises the new rows."""
        _check(g, tids, counts)
        T, dev = g.tables.shape[0], keys.device
        need = [0] * NEED_HEAD + [0] * (2 * T)
        need[6] = -1
        out.fill_(-1)
        sel = _true_at(tids >= 0)
        k, t = keys[sel], tids[sel]
        c = counts[sel] if counts is not None else torch.ones_like(k)
        codes, pos, probes = probe(g, k, t)
        out[sel] = codes.clamp(min=-1)  # what the kernel leaves in `out` on a refusal: the rows found
        found = codes != -1
        w = torch.where(found, g.buckets[:, 2].index_select(0, pos.clamp(min=0)), 0)
        n_after = count_of(w) + c
        admit_k = g.tables[:, T_ADMIT_K].to(dev).index_select(0, t)
        drawn = torch.ones_like(found) if admit is None else admit[sel].bool()
        new = ~found & drawn
        promote = found & (codes == PENDING) & (n_after >= admit_k)
        made_new = new & (c >= admit_k)
        gets_row, waits = made_new | promote, new & ~made_new  # a row now; a key pending from now on
        fresh = new.nonzero().squeeze(1)  # the new keys (their positions, used below)
        if k.numel():
            j = int(probes.argmax())
            longest = int(probes[j])
            if longest > need[7]:
                need[7], need[6] = longest, int(t[j])
            crowd, at = _crowding(g, k[fresh], t[fresh])
            if crowd > need[7]:  # the new keys' own chains, placed alone: ids chosen to collide
                need[7], need[6] = crowd, at
        # per table: rows made, keys left pending, pending keys promoted (one pass, one read; kept as a host
        # tensor too, for the tables' counters below: no tensor made from Python ints per table)
        per_t = torch.zeros(3, T, dtype=torch.int64, device=dev).index_add_(
            1, t, torch.stack([gets_row, waits, promote]).to(torch.int64)).cpu()
        rows_t, pend_t, _ = per_t.tolist()
        need[NEED_HEAD::2], need[NEED_HEAD + 1 :: 2] = rows_t, pend_t  # table j's at NEED_HEAD + 2j, + 1
        need[0], need[1], need[2] = fresh.numel(), sum(rows_t), sum(pend_t)
        if hits is not None:
            hits.zero_()
            hits[sel] = torch.where(found | new, n_after, 0).clamp(max=2**31 - 1)
        # the keys that get a record or a row (none in a step whose every key is known: no work below)
        changes = bool(fresh.numel() or need[1])
        pairs = torch.stack([t[new | promote], k[new | promote]], 1) if changes else k[:0]
        if pairs.shape[0] > 1:
            # sorted by (table, key): by key, then stably by table (torch.unique(dim=0) costs ~1 us a row)
            by_key = pairs[torch.argsort(pairs[:, 1], stable=True)]
            s = by_key[torch.argsort(by_key[:, 0], stable=True)]
            twice = (s[1:] == s[:-1]).all(1)
            if bool(twice.any()):
                dup = s[1:][twice][0]  # the first repeated pair in (table, key) order
                need[4], need[5] = int(dup[1]), int(dup[0])
                return Outcome.DUPLICATE_KEY, _state(g, need), ()
        tab = g.tables
        if bool((tab[:, T_ROWS] + per_t[0] > tab[:, T_ROW_LIMIT]).any()):
            return Outcome.OVER_LIMIT, _state(g, need), ()
        if need[7] > PROBE_LIMIT:
            return Outcome.LONG_PROBE, _state(g, need), ()
        st = g.scalars
        if int(st[G_ENTRIES]) + need[0] > g.max_entries() or \
                int(st[G_ROW_HWM]) + max(0, need[1] - int(st[G_NUM_FREE])) > g.rows_capacity():
            return Outcome.MUST_GROW, _state(g, need), ()
        # commit: counts and last steps of the keys found, slots in batch order, new records
        slots = g.take_rows(need[1])
        code_now = codes
        if changes:
            code_now = codes.clone()
            code_now[gets_row] = slots
            code_now[waits] = PENDING
        seen = _true_at(found)
        at = pos[seen]
        g.buckets[:, 2].index_copy_(0, at, pack(code_now[seen], n_after[seen]))
        g.buckets[:, 3].index_fill_(0, at, step)
        if fresh.numel():
            kf = k[fresh]
            rec = torch.stack([kf, t[fresh], pack(code_now[fresh], c[fresh]), torch.full_like(kf, step)], 1)
            claim(g.buckets, rec, pos[fresh])
        st[G_ENTRIES] += fresh.numel()
        tab[:, T_ROWS] += per_t[0]
        tab[:, T_PENDING] += per_t[1] - per_t[2]
        out[sel] = torch.where(code_now >= 0, code_now, -1)
        need[3] = slots.numel()
        return Outcome.DONE, _state(g, need), (slots, k[gets_row], t[gets_row]) if changes else (slots, k[:0], t[:0])

    def insert(self, g, keys, tids, codes, counts, lasts) -> None:
        rec = torch.stack([keys, tids, pack(codes.to(torch.int64), counts), lasts], 1)
        claim(g.buckets, rec, _homes(g, keys, tids))
        g.scalars[G_ENTRIES] += keys.numel()

    def erase(self, g, keys: torch.Tensor, tids: torch.Tensor) -> int:
        """Removes the pairs by rebuilding the buckets without them; returns how many were absent."""
        b = g.buckets
        occupied = b[:, 1] != EMPTY_TABLE
        rec = b[occupied]
        gone = torch.zeros(rec.shape[0], dtype=torch.bool, device=b.device)
        if keys.numel() and rec.shape[0]:
            victims = torch.unique(torch.stack([tids, keys], 1), dim=0)
            gone = _member(torch.stack([rec[:, 1], rec[:, 0]], 1), victims)
        missing = keys.numel() - int(gone.sum())
        keep = rec[~gone]
        new_buckets(b.shape[0], b.device, out=b)
        place_all(b, keep, _homes(g, keep[:, 0], keep[:, 1]))
        g.scalars[G_ENTRIES] = keep.shape[0]
        return missing

    def rehash(self, g, new: torch.Tensor) -> int:
        """Fills `new` (allocated, not filled) with every record of the group's buckets, placed by the
        tables' hash keys now; returns the records moved (the group then takes `new`)."""
        rec = g.buckets[g.buckets[:, 1] != EMPTY_TABLE]
        new_buckets(new.shape[0], new.device, out=new)
        place_all(new, rec, _homes(g, rec[:, 0], rec[:, 1], new.shape[0]))
        g.scalars[G_ENTRIES] = rec.shape[0]
        return rec.shape[0]


def _member(cand: torch.Tensor, victims: torch.Tensor) -> torch.Tensor:
    """Whether each (table, key) row of `cand` is a row of the sorted unique `victims`."""
    both = torch.cat([victims, cand])
    _, inv = torch.unique(both, dim=0, return_inverse=True)
    return torch.isin(inv[victims.shape[0]:], inv[: victims.shape[0]])
