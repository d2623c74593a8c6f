"""Row-wise sharding ("distributed" embedding): rows live on their owners, requesters pool locally.

Owner of a key, over the table's ranks ``R = (r_0 .. r_{n-1})``::

    dynamic table: R[(mix64(key) & 0xFFFFFFFF) mod n]   (the low hash bits; the hash
                                                        table's home bucket uses the high ones)
    static table : R[key mod n], stored at slot key // n (see ShardArrayStore)

One step, for the row-wise tables of one dim and dtype (a group, handled with a fixed
number of tensor ops whatever the number of tables)::

    requester: unique keys of its batch per table (prepare) ── sorted by (owner, table) ─►
               one segment of keys (+ hit counts) per owner
    owner    : per table, the union of the keys every rank sent ── find_or_insert (training)
               / find (eval) ── one weight row per key and requester ─► back, one segment each
    requester: pools its batch from the rows it received (the same fused lookup as one process;
               every table of the group reads the one received buffer)
    backward : its per-unique-key row gradients ─► owners, which sum a key's gradients over the
               ranks (in rank order) and apply the optimizer once per key

A table-wise table whose features are sequences (combiner "none") takes this path with
its single owner: there is nothing to pool.

Shared row of rare ids (TableConfig.shared_row): one row per table, the key SHARED_ROW_KEY
held by that key's owner like any key (so snapshots reshard it like any key).  Requesters ask
for it with their keys; owners send back, beside the rows, whether each key has a row of its
own; a requester reads the shared row for the keys that have none, and sends their summed
gradient to the shared row's owner, which applies it once, as one process does::

    requester: keys of t + SHARED_ROW_KEY ─► owners ─► rows + "has a row" flags
               keys without a row pool from the shared row; their gradients add up in its row
"""

from __future__ import annotations

import torch

from .._hashing import mix64
from ..errors import ShardingError
from ..nn._rare import SHARED_ROW_KEY
from ._step import OwnedRowsGroup
from ._wire import Packer, padded, segments, union_received

__all__ = ["RowWiseGroup", "owner_index"]

_LOW32 = 0xFFFFFFFF


def owner_index(keys: torch.Tensor, n: int, static: bool) -> torch.Tensor:
    """Index into the table's ranks of each key's owner (int64, same shape)."""
    if n == 1:
        return torch.zeros_like(keys)
    if static:
        return torch.remainder(keys, n)
    return torch.remainder(mix64(keys) & _LOW32, n)


class RowWiseGroup(OwnedRowsGroup):
    """Exchange of the row-wise tables of one (dim, dtype, trainable) group.

    Args:
        coll: the ShardedEmbeddingCollection.
        members: per table, (collection index, index in the local lookup, its ranks).
        col: the first of its header columns (one per table: keys sent to each rank).
        grad_dtype: the dtype of the row gradients the local lookup computes.
    """

    def __init__(self, coll, members: list[tuple[int, int, tuple[int, ...]]], col: int,
                 grad_dtype: torch.dtype) -> None:
        self.coll = coll
        self.ts = [t for t, _, _ in members]
        self.lts = [lt for _, lt, _ in members]
        self.cols = list(range(col, col + len(members)))
        self.header_cols = len(members)
        first = coll.tables[self.ts[0]]
        self.dim, self.dtype = first.dim, first.dtype
        self.names = [coll.tables[t].name for t in self.ts]
        self.rules = [coll.rules[t] for t in self.ts]
        self.trainable = any(r is not None for r in self.rules)
        self.grad_dtype = grad_dtype
        W = coll.world_size
        self.member = [coll.rank in ranks for _, _, ranks in members]
        # per-table constants of the owner rule, on the device once (not copied every step)
        dev = coll.device
        self._n = torch.tensor([len(r) for _, _, r in members], dtype=torch.int64, device=dev)
        self._static = torch.tensor([coll.tables[t].num_rows is not None for t in self.ts], device=dev)
        self._ranks = torch.tensor([list(r) + [-1] * (W - len(r)) for _, _, r in members], dtype=torch.int64,
                                   device=dev)
        self._identity = all(r == tuple(range(W)) for _, _, r in members)
        self._all_dynamic = not bool(self._static.any())
        # tables with a shared row (their local index in the group), and each one's admission count
        self._share_list = [i for i, t in enumerate(self.ts) if coll.tables[t].shared_row]
        self._shares = torch.tensor(self._share_list, dtype=torch.int64, device=dev) if self._share_list else None
        self._admit = {i: coll.tables[self.ts[i]].admit_min_count for i in self._share_list}
        self._row_bytes = self.dim * torch.empty(0, dtype=self.dtype).element_size()
        self._grad_bytes = self.dim * torch.empty(0, dtype=grad_dtype).element_size()

    def _owners(self, keys: torch.Tensor, tid: torch.Tensor) -> torch.Tensor:
        if self._identity and self._all_dynamic:
            return torch.remainder(mix64(keys) & _LOW32, self.coll.world_size)
        h = mix64(keys) & _LOW32
        if not self._all_dynamic:
            h = torch.where(self._static[tid], keys, h)
        idx = torch.remainder(h, self._n[tid])
        return idx if self._identity else self._ranks[tid, idx]

    # -- forward -------------------------------------------------------------------------

    def input_dist(self, st, header: torch.Tensor, packer: Packer) -> None:
        """Every table's unique keys (+ hit counts in training), one segment per owner."""
        prep, W, T = st.prep_l, st.world_size, len(self.ts)
        counts = [prep.unique_count[lt] for lt in self.lts]
        N = sum(counts)
        if N == 0:
            header[:, self.cols] = 0
            st.req[self] = None
            return
        dev = self.coll.device
        pos, tid = segments([prep.unique_base[lt] for lt in self.lts], counts, dev)
        keys = prep.unique_keys[pos]
        hits = prep.unique_counts[pos].to(torch.int32) if st.training else None
        if self._shares is not None:  # each shared row is asked for like a key (its owner counts it once)
            S = self._shares.numel()
            keys = torch.cat([keys, torch.full((S,), SHARED_ROW_KEY, dtype=torch.int64, device=dev)])
            tid = torch.cat([tid, self._shares])
            if hits is not None:
                hits = torch.cat([hits, torch.zeros(S, dtype=torch.int32, device=dev)])
        if W == 1 and self._shares is None:
            perm, per_dest = None, [N]
            header[0, self.cols] = torch.tensor(counts, dtype=torch.int64)
        else:
            comp = self._owners(keys, tid) * T + tid
            perm = torch.argsort(comp, stable=True)  # by owner, then table; unique order kept inside
            sizes = torch.bincount(comp, minlength=W * T).view(W, T).cpu()
            header[:, self.cols] = sizes
            per_dest = sizes.sum(1).tolist()
            keys = keys[perm]
            hits = hits[perm] if hits is not None else None
        off = 0
        for d, n in enumerate(per_dest):
            if n:
                packer.add(d, keys[off : off + n])
                if hits is not None:
                    packer.add(d, hits[off : off + n])
                off += n
        st.req[self] = (pos, perm, per_dest, tid)

    def input_bytes(self, st, r: int) -> int:
        n = int(st.hdr_in[r, self.cols].sum())
        return padded(8 * n) + (padded(4 * n) if st.training else 0)

    def compute(self, st, readers, replies: Packer) -> None:
        """Owner: per table the union of the keys it got, find-or-insert once; each requester's rows back."""
        sizes = st.hdr_in[:, self.cols]
        for i, name in enumerate(self.names):
            if not self.member[i] and bool(sizes[:, i].any()):
                raise ShardingError(f"table {name!r}: rank {st.rank} got keys but holds no row of this table "
                                    "(ranks disagree on the sharding plan)")
        got = union_received(readers, sizes, self.coll.device, with_counts=st.training)
        if got is None:
            st.own[self] = None
            return
        per_src, inv, uniq, per_table, ucounts = got
        shared_at = self._shared_keys(uniq, per_table)
        if shared_at and ucounts is not None:  # a shared row counts once per step, admitted at once (as in one process)
            for i, at in shared_at.items():
                ucounts[at] = self._admit[i]
        slots = self.owned_slots(st, uniq, per_table, ucounts, st.training, shared_rows=False)
        if shared_at:  # the shared rows held here: they move at the full lr (lr_count_scale)
            shared = st.rare[self][1]
            for i, at in shared_at.items():
                shared[i] = int(slots[at])
        rows = torch.zeros(uniq.numel(), self.dim, dtype=self.dtype, device=self.coll.device)
        start = 0
        for t, n in zip(self.ts, per_table):
            if n:
                sl = slice(start, start + n)
                storage, got = self.coll.rows_of(t), slots[sl]
                if not st.training:  # eval reads rows as they are now (see coll.current_rows)
                    storage, got = self.coll.current_rows(t, got, uniq[sl])
                weights = storage[:, : self.dim]
                known = got >= 0  # not admitted yet / unknown in eval: reads zeros, as in one process
                if bool(known.all()):
                    rows[sl] = weights[got]
                elif bool(known.any()):
                    rows[sl][known] = weights[got[known]]
            start += n
        back = rows[inv]  # each requester's keys, in the order they came
        has_row = (slots >= 0).to(torch.uint8)[inv] if self._shares is not None else None
        off = 0
        for r, n in enumerate(per_src):
            if n:
                replies.add(r, back[off : off + n])
                if has_row is not None:
                    replies.add(r, has_row[off : off + n])
                off += n
        st.own[self] = (inv, slots, per_table, uniq, shared_at)

    def _shared_keys(self, uniq: torch.Tensor, per_table: list[int]) -> dict[int, int]:
        """Per table with a shared row whose key came: its position in `uniq` (the first of its
        table: the keys of a table are sorted, and ids are >= 0)."""
        out, start = {}, 0
        for i, n in enumerate(per_table):
            if n and i in self._admit and int(uniq[start]) == SHARED_ROW_KEY:
                out[i] = start
            start += n
        return out

    def output_bytes(self, st, d: int) -> int:
        req = st.req[self]
        if req is None:
            return 0
        flags = padded(req[2][d]) if self._shares is not None else 0
        return padded(req[2][d] * self._row_bytes) + flags

    def output_dist(self, st, readers) -> None:
        """Requester: the received rows become the storage every table of the group pools from."""
        dev = self.coll.device
        req = st.req[self]
        if req is None:
            empty = torch.zeros(0, self.dim, dtype=self.dtype, device=dev)
            for lt in self.lts:
                st.storages_l[lt] = empty
            return
        pos, perm, per_dest, tid = req
        parts, flags = [], []
        for d, n in enumerate(per_dest):
            if n:
                parts.append(readers[d].take(n * self.dim, self.dtype).view(n, self.dim))
                if self._shares is not None:
                    flags.append(readers[d].take(n, torch.uint8))
        rows = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dev)
        for lt in self.lts:
            st.storages_l[lt] = rows
        where = torch.arange(rows.shape[0], device=dev)  # each key's row among the received ones
        if perm is not None:
            where = torch.empty_like(where).index_copy_(0, perm, where)
        N = pos.numel()
        slots = where[:N]
        if self._shares is not None:  # keys without a row of their own read their table's shared row
            has_row = torch.cat(flags).to(dev).bool()
            shared_row = torch.full((len(self.ts),), -1, dtype=torch.int64, device=dev)
            shared_row[self._shares] = where[N:]
            redirect = (shared_row[tid[:N]] >= 0) & ~has_row[slots]
            slots = torch.where(redirect, shared_row[tid[:N]], slots)
            # whether this batch read each shared row: its owner updates it only if some batch did
            read = torch.bincount(tid[:N][redirect], minlength=len(self.ts))[self._shares] > 0
            st.req[self] = (*req, read.to(torch.uint8))
        st.slots_l[pos] = slots

    # -- backward ------------------------------------------------------------------------

    def grad_dist(self, st, packer: Packer) -> None:
        """Requester: each unique key's row gradient to its owner (in the order the keys went)."""
        req = st.req[self]
        if not self.trainable or req is None:
            return
        per_dest = req[2]
        grad = torch.zeros(sum(per_dest), self.dim, dtype=self.grad_dtype, device=self.coll.device)
        for lt in self.lts:
            got = st.local_grads.get(lt)
            if got is not None:  # slots are positions in the received rows: the owner-sorted order
                # (index_add: the keys reading a shared row add their gradients up in its row)
                grad.index_add_(0, got[0], got[1].to(self.grad_dtype))
        if st.grad_scale != 1.0:
            grad.mul_(st.grad_scale)
        off = 0
        for d, n in enumerate(per_dest):
            if n:
                if self._shares is not None:  # first: whether this batch read each shared row
                    packer.add(d, req[4])
                packer.add(d, grad[off : off + n])
                off += n

    def grad_bytes(self, st, r: int) -> int:
        flags = padded(self._shares.numel()) if self._shares is not None and self.trainable and bool(
            st.hdr_in[r, self.cols].any()) else 0
        return flags + super().grad_bytes(st, r)

    def apply(self, st, readers) -> None:
        """The owners' update (OwnedRowsGroup.apply); a shared row held here that no rank's batch read
        this step takes no update, as in one process (lazy Adam would move it on a zero gradient)."""
        if self.trainable and self._shares is not None:
            senders = st.hdr_in[:, self.cols].sum(1).tolist()
            read = torch.zeros(self._shares.numel(), dtype=torch.bool)
            for r, n in enumerate(senders):
                if n:
                    read |= readers[r].take(self._shares.numel(), torch.uint8).cpu().bool()
            own = st.own.get(self)
            if own is not None:
                for i, at in own[4].items():  # (the shared rows held here)
                    if not read[self._share_list.index(i)]:
                        own[1][at] = -1  # its slot: no update
        super().apply(st, readers)
