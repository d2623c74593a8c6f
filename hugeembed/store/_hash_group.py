"""find_or_insert of many torch-backend hash tables in one pass (the GPU path's dynamic tables).

Each HashStore probes its own bucket array; over 32 tables that is 32 probe loops, each
round of each a read of the device.  Here the stores of one call join a
:class:`BucketGroup`: their bucket arrays become parts of one ``[sum B_t + 1, 3]`` array
(the last bucket a write-only sink for masked writes) and their scalars rows of one host
``[T, K]`` tensor, each store keeping views of its part, so every layout-reading path of
the store works unchanged.  The keys of all tables then probe together, each within its
own part (``_hash_torch.probe`` with a base and size per key), the tables' admission and
capacity counts come back in one host read, and the accepted tables' records, counts and
scalars are written with one op each.  New keys claim their buckets before that read
(:class:`_Speculation`), undone for the tables that refuse them.

A table that must grow its index, evict, or raise (a duplicate key, a count < 1, the key equal
to the empty-bucket sentinel) is left to its own find_or_insert, exactly as before; the others'
results, rows and buckets are those of their own calls.  The new rows' values are made before
anything is written, so an initializer that raises changes no table.  A store leaves the group's array when it rehashes
(or is loaded or moved): the next call joins the stores again (one copy of the buckets).
"""

from __future__ import annotations

import struct
from dataclasses import fields
from itertools import accumulate

import torch

from ..functional import joined, joined_view, kept_positions, repeat_each
from . import _alloc
from .. import _native
from .._device import host_to_device
from ..errors import CapacityError
from .._hashing import mix64
from ._array import _row_ptr
from ._common import init_rows
from ._hash_torch import (_MAX_WINDOW, _ST, _WINDOW_ELEMENTS, EMPTY, PENDING, claim, claim_masked, claim_rest, code_of,
                          count_of, entries, new_buckets, pack, probe, probe_window, unclaim)
from ._init import Constant, Normal, TruncatedNormal, Uniform, Zeros, seed_mix

__all__ = ["BucketGroup", "DynamicRows", "find_or_insert_group", "find_group"]


class BucketGroup:
    """The bucket arrays and scalars of `stores`, joined: each store's ``_buckets`` and ``_st``
    become views of ``buckets`` and ``stats`` (contents copied, unchanged)."""

    def __init__(self, stores, sizes: list[int] | None = None) -> None:
        """`sizes`: bucket counts to give the stores (default: theirs); a store given more is
        rehashed into its new part (all such stores' records placed by one claim loop, in the
        order the store's own rehash places them: the same buckets)."""
        dev = stores[0].device
        self.expect_new = True  # whether the last find_or_insert_group had new keys (_Speculation)
        self.sizes = [s.num_buckets for s in stores] if sizes is None else list(sizes)
        self.bases = [0, *accumulate(self.sizes)][:-1]
        total = sum(self.sizes)
        self.buckets = new_buckets(total + 1, dev, out=_alloc.empty((total + 1, 3), torch.int64, dev))
        self.stats = torch.stack([s._st for s in stores])
        moved, where = [], []
        for i, s in enumerate(stores):
            if self.sizes[i] == s.num_buckets:
                self.buckets[self.bases[i] : self.bases[i] + self.sizes[i]] = s._buckets
            else:
                moved.append(entries(s._buckets))
                where.append(i)
        if moved:
            counts = [m.shape[0] for m in moved]
            claim(self.buckets, torch.cat(moved), None, repeat_each([self.bases[i] for i in where], counts, dev),
                  repeat_each([self.sizes[i] for i in where], counts, dev))
        for i, s in enumerate(stores):
            s._buckets = self.buckets[self.bases[i] : self.bases[i] + self.sizes[i]]
            s._st = self.stats[i]
            s._bucket_group = (self, i)
        self.sink = total  # a bucket in no table: where writes masked off land
        # buckets of each key's path that a find-or-insert probes before its one read of the
        # device (doubled, up to _MAX_WINDOW, when a batch has a key farther from home)
        self.window = 16
        self.base_t = torch.tensor(self.bases, dtype=torch.int64, device=dev)
        self.size_t = torch.tensor(self.sizes, dtype=torch.int64, device=dev)

    def index_of(self, store) -> int | None:
        """The store's row in this group while its arrays are still this group's views, else None."""
        g = getattr(store, "_bucket_group", None)
        if g is None or g[0] is not self:
            return None
        i = g[1]
        b, st = store._buckets, store._st
        if (b.shape[0] != self.sizes[i] or b.untyped_storage().data_ptr() != self.buckets.untyped_storage().data_ptr()
                or b.storage_offset() != self.bases[i] * 3 or st.storage_offset() != i * self.stats.shape[1]
                or st.untyped_storage().data_ptr() != self.stats.untyped_storage().data_ptr()):
            return None
        return i

    @staticmethod
    def of(stores) -> tuple["BucketGroup", list[int]]:
        """The group all `stores` are views of (and their rows in it), joining them anew when
        they are not (first call, a rehash, a load, a move)."""
        g = getattr(stores[0], "_bucket_group", None)
        rows = None if g is None else [g[0].index_of(s) for s in stores]
        if rows is None or None in rows:
            g = (BucketGroup(stores), 0)
            rows = list(range(len(stores)))
        return g[0], rows


class DynamicRows:
    """One ``[R, W]`` storage holding the rows of several torch-backend hash tables of one row
    width and dtype, each store's ``_storage`` a view of its part (``HashStore.block_rows()``),
    so a collection gathers and updates their rows with one op each, as a RowBlock's.

    A store's part is `headroom` times the rows it has handed out (at least 64 more; within its
    capacity): a store that outgrows it takes storage of its own (its ``_grow_rows``) and leaves
    the block; the next :meth:`join` copies all members into a new block, each part again sized
    by its own use (so a table that does not grow keeps the same part).  Each table rebuilds the
    block once per 1.5x of its growth: T tables growing alike copy about 3.4 T times their final
    rows over a run, and a rebuild holds the old and the new block at once.
    """

    def __init__(self, stores, headroom: float = 1.5) -> None:
        parts = []
        for s in stores:
            used = s._st_get("row_hwm")
            want = max(int(used * headroom), used + 64)
            parts.append(max(used, min(want, s.capacity)) if s.capacity is not None else want)
        firsts = [0, *accumulate(parts)][:-1]
        first = stores[0]._storage
        # zeros: the spare rows touched now, as a store's own growth does (page faults cost more
        # than the writes, better paid here than per batch)
        self.storage = torch.zeros(sum(parts), first.shape[1], dtype=first.dtype, device=first.device)
        for s, f, p in zip(stores, firsts, parts):
            used = s._st_get("row_hwm")  # rows past it were never handed out
            self.storage[f : f + used] = s._storage[:used]
            s._storage = self.storage[f : f + p]
            s._row_block = (self, f)

    @staticmethod
    def rows_of(store) -> tuple["DynamicRows", int] | None:
        """``(block, first_row)`` while `store`'s rows are still that block's view, else None."""
        g = store.__dict__.get("_row_block")
        if g is None:
            return None
        blk, first = g
        st = blk.storage
        if (store._storage.data_ptr() == _row_ptr(st, first) and store._storage.shape[1] == st.shape[1]
                and store._storage.untyped_storage().data_ptr() == st.untyped_storage().data_ptr()):
            return g
        return None

    @staticmethod
    def join(stores) -> None:
        """Makes `stores` (torch-backend hash tables with rows, one row width, dtype and device)
        parts of one block, unless they already are."""
        got = [DynamicRows.rows_of(s) for s in stores]
        if all(g is not None and g[0] is got[0][0] for g in got):
            return
        DynamicRows(stores)


def find_or_insert_group(stores, keys, counts, step: int, regrown: bool = False) -> list[torch.Tensor | None]:
    """find_or_insert of torch-backend HashStores (distinct, one device, rows kept, no probability
    filter) in one pass: for each store the slots of its (validated int64) keys, or None where
    that store must take its own find_or_insert (grow, evict, or raise)."""
    sizes = [k.numel() for k in keys]
    group, rows = BucketGroup.of(stores)
    dev = stores[0].device
    T = len(stores)
    n = sum(sizes)
    out: list[torch.Tensor | None] = [None] * T
    if n == 0:
        return [k.clone() for k in keys]
    key = joined(list(keys))  # a collection's per-table keys are parts of one tensor: a view
    c = torch.ones(n, dtype=torch.int64, device=dev) if all(ct is None for ct in counts) else \
        joined([ct if ct is not None else torch.ones_like(k) for k, ct in zip(keys, counts)])
    tid = repeat_each(list(range(T)), sizes, dev)
    gid = host_to_device(rows, torch.int64, dev)[tid]
    base, size = group.base_t[gid], group.size_t[gid]
    codes, pos, unresolved = probe_window(group.buckets, key, base, size, group.window)
    kmin = repeat_each([s.admit_min_count for s in stores], sizes, dev)
    order = key.argsort(stable=True)
    order = order[tid[order].argsort(stable=True)]
    stats = host_to_device(group.stats[rows], torch.int64, dev)
    tally = _tally(key, tid, c, kmin, order, codes, pos, group.buckets, T)
    # The new keys claim their buckets before the read, as if every table accepted its keys:
    # a table that does not has its claims undone (they only filled empty buckets of its own
    # part), so a step with new keys reads the device once here, not twice.  Only when the
    # group's last call had new keys: else the claim's rounds would be ops spent for nothing
    # (the buckets are the same either way).
    side, is_a = tally[0], tally[3]
    spec = _Speculation(group, is_a & ~side, base, size, group.expect_new)
    try:
        spec.claim(key, step, pos)
        return _find_or_insert_read(stores, keys, counts, step, regrown, group, rows, key, c, tid, base, size,
                                    codes, pos, unresolved, kmin, order, stats, tally, spec)
    except BaseException:
        spec.undo()  # an initializer, an allocation or a table's own path raised: no claim stays
        raise


def _find_or_insert_read(stores, keys, counts, step, regrown, group, rows, key, c, tid, base, size, codes, pos,
                         unresolved, kmin, order, stats, tally, spec):
    """find_or_insert_group from its one read of the device on (the claims of `spec` made)."""
    T, sizes, dev = len(stores), [k.numel() for k in keys], key.device
    out: list[torch.Tensor | None] = [None] * T
    # the one read of the device: each table's counts, its scalars, whether every key was
    # resolved, and how many new keys found no bucket in the claim's rounds
    parts = [tally[-1].flatten(), stats.flatten(), unresolved.sum()[None]]
    host = torch.cat(parts + [spec.left.sum()[None]] if spec.active else parts).tolist()
    n_left = host.pop() if spec.active else 0
    if host[-1]:
        spec.undo()  # decided from codes that were not all known
        # a key farther from home than the window: those keys probed to the end (a read per
        # round), and a wider window from now on (unless the batch's size narrowed it)
        if group.window * key.numel() <= _WINDOW_ELEMENTS:
            group.window = min(2 * group.window, _MAX_WINDOW)
        left = kept_positions(unresolved, host[-1])
        codes[left], pos[left] = probe(group.buckets, key[left], base[left], size[left])
        tally = _tally(key, tid, c, kmin, order, codes, pos, group.buckets, T)
        host = tally[-1].flatten().tolist() + host[5 * T :]
    side, found, new_count, is_a, need_row, pend_new, _ = tally
    K = group.stats.shape[1]
    per_t = [host[5 * t : 5 * t + 5] for t in range(T)]
    group.expect_new = any(per_t[t][1] for t in range(T))
    st = [host[5 * T + K * t : 5 * T + K * t + K] for t in range(T)]

    if not regrown:
        # tables whose index must grow (and that will not evict or raise): grown as each alone
        # would grow, all rehashed into a new group at once, then every key probed again
        sizes_now, grow = list(group.sizes), False
        for t, s in enumerate(stores):
            bad, new_entries, new_rows = per_t[t][:3]
            v = st[t]
            if not bad and v[_ST["rows"]] + new_rows <= s._row_limit and new_entries:
                try:
                    nb = s._buckets_for(v[_ST["entries"]], new_entries)
                except CapacityError:
                    nb = None  # its own call raises
                if nb is not None:
                    sizes_now[rows[t]], grow = nb, True
        if grow:
            members = [None] * len(group.sizes)
            for t, s in enumerate(stores):
                members[rows[t]] = s
            if None not in members:
                spec.undo()
                BucketGroup(members, sizes_now)
                return find_or_insert_group(stores, keys, counts, step, regrown=True)

    ok, take, hwm, first = [], [], [], []
    new_rows_total = 0
    for t, s in enumerate(stores):
        bad, new_entries, new_rows, new_pend, prom = per_t[t]
        v = st[t]
        fits = not bad and v[_ST["rows"]] + new_rows <= s._row_limit and v[_ST["entries"]] + new_entries <= s._max_entries()
        if fits and v[_ST["row_hwm"]] + max(0, new_rows - v[_ST["num_free"]]) > s._storage.shape[0]:
            s._grow_for(0, new_rows)  # more row storage only (the buckets, probed above, stay)
        ok.append(fits)
        tk = min(new_rows, v[_ST["num_free"]]) if fits else 0
        take.append(tk)
        hwm.append(v[_ST["row_hwm"]])
        first.append(new_rows_total)
        new_rows_total += new_rows if fits else 0
    if not any(ok):
        spec.undo()
        return out
    okk = host_to_device(ok, torch.bool, dev)[tid]
    row_ok = need_row & okk
    # slots handed out in batch order per table: free ones (smallest first), then fresh ones
    r = row_ok.cumsum(0) - 1 - repeat_each(first, sizes, dev)
    tk = repeat_each(take, sizes, dev)
    slot = repeat_each(hwm, sizes, dev) + r - tk
    if any(take):
        free = torch.cat([s._free[v[_ST["num_free"]] - k : v[_ST["num_free"]]].flip(0).to(torch.int64)
                          for s, v, k in zip(stores, st, take) if k])
        fstart = repeat_each(list(accumulate([0, *take]))[:-1], sizes, dev)
        slot = torch.where(r < tk, free[(fstart + r).clamp(0, max(free.numel() - 1, 0))], slot)
    # the new rows' initial values, made before anything is written: an initializer or an
    # init_state that raises leaves every table as it was
    made = [per_t[t][2] if ok[t] else 0 for t in range(T)]
    new_rows_at = kept_positions(row_ok, sum(made))
    new_slots, new_keys = slot[new_rows_at], key[new_rows_at]
    values = _new_row_values(stores, made, new_keys)
    code_now = torch.where(row_ok, slot, torch.where(pend_new & okk, PENDING, codes))
    # found keys: counts added, last step set; new keys: a record each; both only in accepted tables
    upd = found & ~side & okk
    at = torch.where(upd, pos, group.sink)
    group.buckets[at, 1:] = torch.stack([pack(code_now, new_count), torch.full_like(at, step)], 1)
    if spec.active:
        spec.keep(okk, pack(code_now, c), n_left)
    else:
        new = kept_positions(is_a & ~side & okk, sum(per_t[t][1] for t in range(T) if ok[t]))
        if new.numel():
            rec = torch.stack([key[new], pack(code_now[new], c[new]), torch.full_like(new, step)], 1)
            claim(group.buckets, rec, pos[new], base[new], size[new], sink=group.sink)
    res = torch.where(code_now >= 0, code_now, -1)
    # scalars of the accepted tables, from the values read above
    upd_rows, upd_vals = [], []
    for t, s in enumerate(stores):
        if not ok[t]:
            continue
        _, new_entries, new_rows, new_pend, prom = per_t[t]
        v = list(st[t])
        v[_ST["entries"]] += new_entries
        v[_ST["rows"]] += new_rows
        v[_ST["pending"]] += new_pend - prom
        v[_ST["num_free"]] -= take[t]
        v[_ST["row_hwm"]] += new_rows - take[t]
        upd_rows.append(rows[t])
        upd_vals.append(v)
    group.stats[upd_rows] = torch.tensor(upd_vals, dtype=torch.int64)
    # new rows: initial weights and optimizer state, per store (each its own storage)
    for s, sl, k, (w, state) in zip(stores, new_slots.split(made), new_keys.split(made), values):
        if sl.numel():
            init_rows(s._storage, sl, k, s.layout, s.initializer, s.init_state, s.seed, weights=w, state=state)
    for t, (s, part) in enumerate(zip(stores, res.split(sizes))):
        if ok[t]:
            if sizes[t]:  # (a table given no keys forgets no pending keys, as its own call)
                s.forget_pending(step)
            out[t] = part
    return out


class _Speculation:
    """The new keys' buckets, claimed before the group's read (claim_masked's rounds, no read):
    kept for the tables that accept their keys, undone for the others.  Inert unless
    `speculate` (the claim then runs after the read, as :func:`claim`)."""

    def __init__(self, group: BucketGroup, new: torch.Tensor, base, size, speculate: bool) -> None:
        self.group, self.new, self.base, self.size = group, new, base, size
        self.active = speculate
        # each new key's bucket (the sink: none), filled in as the claim goes, so that undo
        # knows every bucket written even when the claim itself raises half-way
        self.landed = torch.full_like(new, group.sink, dtype=torch.int64) if speculate else None

    def claim(self, key, step: int, pos) -> None:
        """The claim's masked rounds for the new keys (`key`: all keys; `pos`: where each probe
        stopped), with no read of the device."""
        if not self.active:
            return
        # word 1 (code and count) is written once the host has decided the codes (keep)
        self.records = torch.stack([key, torch.full_like(key, 0xFFFFFFFF), torch.full_like(key, step)], 1)
        _, self.left, self.p = claim_masked(self.group.buckets, self.records, pos, self.base, self.size,
                                            self.group.sink, active=self.new, landed=self.landed)

    def undo(self) -> None:
        """Empties every bucket claimed (idempotent; nothing once kept)."""
        if self.active:
            self.active = False
            unclaim(self.group.buckets, self.landed, self.group.sink)

    def keep(self, accepted: torch.Tensor, word1: torch.Tensor, n_left: int) -> None:
        """Gives the claims of the `accepted` keys their word 1, undoes the others', and places
        the accepted keys the rounds left without a bucket (`n_left`: how many new keys that is,
        accepted or not)."""
        self.active = False
        buckets, sink = self.group.buckets, self.group.sink
        buckets[torch.where(accepted, self.landed, sink), 1] = word1
        unclaim(buckets, torch.where(accepted, sink, self.landed), sink)  # (also empties the sink)
        if n_left:
            rest = self.left & accepted
            idx = kept_positions(rest, int(rest.sum()))
            records = self.records.clone()
            records[:, 1] = word1
            claim_rest(buckets, records, idx, self.p[idx], self.base, self.size)


def _tally(key, tid, c, kmin, order, codes, pos, buckets, T: int):
    """What a group find-or-insert would do with each key given its probe's `codes` and `pos`,
    and the per-table counts of it (int64 [T, 5], on the device): keys that must take their
    table's own path (the sentinel key, a key twice among its table's new keys, a count < 1),
    new bucket entries, rows to make, new pending keys, pending keys promoted."""
    side = key == EMPTY  # the sentinel key's record is a scalar of its store: its own path
    found = codes != -1
    w1 = torch.where(found & ~side, buckets[pos.clamp(min=0), 1], 0)
    new_count = torch.where(found, count_of(w1), 0) + c
    todo = codes < 0
    is_a = codes == -1
    need_row = todo & torch.where(is_a, c >= kmin, new_count >= kmin)
    pend_new = is_a & ~need_row
    promoted = need_row & ~is_a
    # a key twice among one table's new keys (`order`: by table, then key): its own path raises
    ko, to, do = key[order], tid[order], todo[order]
    dup = torch.zeros(key.numel(), dtype=torch.bool, device=key.device)
    dup[order[1:]] = (ko[1:] == ko[:-1]) & (to[1:] == to[:-1]) & do[1:]
    flags = torch.stack([side | dup | (c < 1), is_a & ~side, need_row, pend_new, promoted], 1).to(torch.int64)
    per = torch.zeros(T, 5, dtype=torch.int64, device=key.device).index_add_(0, tid, flags)
    return side, found, new_count, is_a, need_row, pend_new, per


def find_group(stores, keys) -> list[torch.Tensor]:
    """``[s.find(k) for ...]`` of torch-backend HashStores (distinct, one device; keys validated
    int64) in one probe loop: each key's row slot, -1 where it has none (absent or pending).
    Nothing is inserted or counted (the stores join a group: their contents are unchanged)."""
    sizes = [k.numel() for k in keys]
    if sum(sizes) == 0:
        return [k.clone() for k in keys]
    group, rows = BucketGroup.of(stores)
    dev = stores[0].device
    key = joined(list(keys))
    tid = repeat_each(list(range(len(stores))), sizes, dev)
    gid = host_to_device(rows, torch.int64, dev)[tid]
    base, size = group.base_t[gid], group.size_t[gid]
    codes, _, unresolved = probe_window(group.buckets, key, base, size, group.window)
    n_left = int(unresolved.sum())  # the one read of the device
    if n_left:  # keys farther from home than the window: probed to the end
        left = kept_positions(unresolved, n_left)
        codes[left] = probe(group.buckets, key[left], base[left], size[left])[0]
    # the sentinel key's record is a scalar of its store (host memory: no read of the device)
    st = group.stats[rows]
    side = torch.where(st[:, _ST["side_used"]] != 0, code_of(st[:, _ST["side_word1"]]), -1)
    codes = torch.where(key == EMPTY, host_to_device(side, torch.int64, dev)[tid], codes)
    return list(codes.clamp_(min=-1).split(sizes))


# Initializers whose rows are a function of each key's stream alone (``rows_from_bases``): the
# built-in ones, by exact type (a user's subclass may override generate)
_STREAM_KINDS = (Constant, Zeros, Uniform, Normal, TruncatedNormal)


def _new_row_values(stores, made: list[int], new_keys: torch.Tensor) -> list[tuple]:
    """(initial weights, optimizer state) of each store's new keys (``new_keys`` split by `made`);
    weights None where the native initializer writes them into the storage itself (CPU).  The
    weights of all stores sharing a built-in initializer and width come from one call (each
    key's stream seeded by its own table's seed)."""
    out: list[list] = [[None, None] for _ in stores]
    native = stores[0].device.type == "cpu" and _native.available()
    starts = [0, *accumulate(made)]
    kinds: dict[tuple, list[int]] = {}
    for t, s in enumerate(stores):
        if not made[t]:
            continue
        lay, init = s.layout, s.initializer
        if native and not lay.packed and init._native_spec() is not None and s._storage.dtype == torch.float32:
            pass  # init_rows' kernel: no torch op, cannot fail on its input
        elif type(init) in _STREAM_KINDS:
            # by value, bit for bit (Constant(0.0) == Constant(-0.0) as dataclasses)
            bits = tuple(struct.pack("<d", float(getattr(init, f.name))) for f in fields(init))
            kinds.setdefault((type(init), bits, lay.dim), []).append(t)
        else:
            out[t][0] = init.generate(new_keys[starts[t] : starts[t + 1]], lay.dim, s.seed)
        if lay.state_width:
            state = torch.zeros(made[t], lay.state_width, dtype=lay.state_dtype, device=new_keys.device)
            if s.init_state is not None:
                s.init_state(state)
            out[t][1] = state
    for (_, _, dim), ts in kinds.items():
        keys = joined([new_keys[starts[t] : starts[t + 1]] for t in ts])
        seeds = repeat_each([seed_mix(stores[t].seed) for t in ts], [made[t] for t in ts], keys.device)
        rows = stores[ts[0]].initializer.rows_from_bases(mix64(keys ^ seeds), dim)
        for t, w in zip(ts, rows.split([made[t] for t in ts])):
            out[t][0] = w
    return [tuple(v) for v in out]


def write_into(outs, got, members) -> None:
    """Copies the results of `members` into the caller's buffers with one copy when they lie end to end."""
    region = joined_view([outs[i] for i in members])
    if region is not None and all(got[i] is not None for i in members):
        region.copy_(joined([got[i] for i in members]))
        for i in members:
            got[i] = outs[i]
