"""Row-wise sharding ("distributed" embedding): rows live on their owners, requesters pool locally.

Owner of a key, over the table's ranks ``R = (r_0 .. r_{n-1})``::

    dynamic table: R[(mix64(key) & 0xFFFFFFFF) mod n]   (the low hash bits; the hash
                                                        table's home bucket uses the high ones)
    static table : R[key mod n], stored at slot key // n (see ShardArrayStore)

One step, for one table::

    requester: unique keys of its batch (prepare) ── sort by owner ─► keys (+ hit counts) per owner
    owner    : union of the keys it got from every rank ── find_or_insert (training) / find (eval)
               ── one weight row per key and requester ─► back to each requester
    requester: pools its batch from the rows it received (the same fused lookup as one process)
    backward : requester's per-unique-key gradient ─► owner, which sums the ranks' gradients of a
               key (in rank order) and applies the optimizer once per key

A table-wise table whose features are sequences (combiner "none") takes this path
with its single owner: there is nothing to pool.
"""

from __future__ import annotations

import torch

from .._hashing import mix64
from ..errors import ShardingError
from ._wire import Packer, padded

__all__ = ["RowWiseRoute", "owner_index"]

_LOW32 = 0xFFFFFFFF


def owner_index(keys: torch.Tensor, n: int, static: bool) -> torch.Tensor:
    """Index into the table's ranks of each key's owner (int64, same shape)."""
    if n == 1:
        return torch.zeros_like(keys)
    if static:
        return torch.remainder(keys, n)
    return torch.remainder(mix64(keys) & _LOW32, n)


class RowWiseRoute:
    """Exchange of one row-wise table (see the module docstring).

    Args:
        coll: the ShardedEmbeddingCollection.
        t: the table's index in the collection; lt: its index in the local lookup.
        ranks: the ranks holding the table's rows.
        col: its column in the exchange header.
    """

    header_cols = 1

    def __init__(self, coll, t: int, lt: int, ranks: tuple[int, ...], col: int, grad_dtype: torch.dtype) -> None:
        cfg = coll.tables[t]
        self.coll, self.t, self.lt, self.col = coll, t, lt, col
        self.name, self.dim, self.dtype = cfg.name, cfg.dim, cfg.dtype
        self.static = cfg.num_rows is not None
        self.ranks = ranks
        self.member = coll.rank in ranks
        self.rule = coll.rules[t]
        self.grad_dtype = grad_dtype
        self._row_bytes = self.dim * torch.empty(0, dtype=self.dtype).element_size()
        self._grad_bytes = self.dim * torch.empty(0, dtype=grad_dtype).element_size()
        self._ranks_t = torch.tensor(ranks, dtype=torch.int64)
        self._identity = ranks == tuple(range(coll.world_size))

    def owner_of(self, keys: torch.Tensor) -> torch.Tensor:
        """The owner rank of each key."""
        idx = owner_index(keys, len(self.ranks), self.static)
        return idx if self._identity else self._ranks_t.to(keys.device)[idx]

    # -- forward -------------------------------------------------------------------------

    def input_dist(self, st, header: torch.Tensor, packer: Packer) -> None:
        """Unique keys (and, in training, their hit counts) to their owners."""
        prep = st.prep_l
        keys = prep.keys_of(self.lt)
        W = st.world_size
        n = keys.numel()
        sizes = [0] * W
        perm = None
        if n:
            if len(self.ranks) == 1:
                sizes[self.ranks[0]] = n
            else:
                dest = self.owner_of(keys)
                perm = torch.argsort(dest, stable=True)
                sizes = torch.bincount(dest, minlength=W).tolist()
                keys = keys[perm]
            counts = prep.counts_of(self.lt).to(torch.int32) if st.training else None
            if counts is not None and perm is not None:
                counts = counts[perm]
            off = 0
            for d, s in enumerate(sizes):
                if s:
                    packer.add(d, keys[off : off + s])
                    if counts is not None:
                        packer.add(d, counts[off : off + s])
                    off += s
        header[:, self.col] = torch.tensor(sizes, dtype=torch.int64)
        st.req[self.t] = (perm, sizes)

    def input_bytes(self, st, r: int) -> int:
        n = int(st.hdr_in[r, self.col])
        return padded(8 * n) + (padded(4 * n) if st.training else 0)

    def compute(self, st, readers, replies: Packer) -> None:
        """Owner: union of the requested keys, find-or-insert them once, send each requester its rows."""
        sizes = st.hdr_in[:, self.col].tolist()
        if not self.member and any(sizes):
            raise ShardingError(f"table {self.name!r}: rank {st.rank} got keys but holds no row of this table "
                                "(ranks disagree on the sharding plan)")
        dev = self.coll.device
        keys = [readers[r].take(s, torch.int64).to(dev) for r, s in enumerate(sizes)]
        counts = [readers[r].take(s, torch.int32).to(dev) for r, s in enumerate(sizes)] if st.training else None
        total = sum(sizes)
        if total == 0:
            st.own[self.t] = None
            return
        sources = [r for r, s in enumerate(sizes) if s]
        if len(sources) == 1:  # one requester: its keys are unique already
            uniq, invs = keys[sources[0]], None
            ucounts = counts[sources[0]].to(torch.int64) if counts is not None else None
        else:
            uniq, inv = torch.unique(torch.cat(keys), sorted=True, return_inverse=True)
            invs = list(torch.split(inv, sizes))
            ucounts = None
            if counts is not None:
                ucounts = torch.zeros(uniq.numel(), dtype=torch.int64, device=dev).index_add_(
                    0, inv, torch.cat(counts).to(torch.int64))
        store = self.coll._stores[self.t]
        slots = store.find_or_insert(uniq, st.step, counts=ucounts) if st.training else store.find(uniq)
        weights = store.storage()[:, : self.dim]
        known = slots >= 0  # not admitted yet / unknown in eval: reads zeros, as in one process
        if bool(known.all()):
            rows = weights[slots]
        else:
            rows = torch.zeros(slots.numel(), self.dim, dtype=self.dtype, device=dev)
            rows[known] = weights[slots[known]]
        if invs is None:
            replies.add(sources[0], rows)
        else:
            for r in sources:
                replies.add(r, rows[invs[r]])
        st.own[self.t] = (invs, slots, sources)

    def output_bytes(self, st, d: int) -> int:
        return padded(st.req[self.t][1][d] * self._row_bytes)

    def output_dist(self, st, readers) -> None:
        """Requester: the rows of its unique keys become this table's storage for the local pooling."""
        perm, sizes = st.req[self.t]
        parts = [readers[d].take(s * self.dim, self.dtype).view(s, self.dim) for d, s in enumerate(sizes)]
        nonzero = [p for p in parts if p.shape[0]]
        dev = self.coll.device
        if len(nonzero) == 1:
            rows = nonzero[0].to(dev)
        elif nonzero:
            rows = torch.cat(nonzero).to(dev)
        else:
            rows = torch.zeros(0, self.dim, dtype=self.dtype, device=dev)
        n = rows.shape[0]
        st.storages_l[self.lt] = rows
        b = st.prep_l.unique_base[self.lt]
        pos = torch.arange(n, device=dev)
        if perm is None:
            st.slots_l[b : b + n] = pos
        else:
            st.slots_l[b + perm] = pos

    # -- backward ------------------------------------------------------------------------

    def grad_dist(self, st, packer: Packer) -> None:
        """Requester: the gradient of each unique key's row to its owner (in the order the keys went)."""
        if self.rule is None:
            return
        _, sizes = st.req[self.t]
        n = sum(sizes)
        if n == 0:
            return
        grad = torch.zeros(n, self.dim, dtype=self.grad_dtype, device=self.coll.device)
        got = st.local_grads.get(self.lt)
        if got is not None:  # slots are positions in the received rows: the owner-sorted order
            grad.index_copy_(0, got[0], got[1].to(self.grad_dtype))
        if st.grad_scale != 1.0:
            grad.mul_(st.grad_scale)
        off = 0
        for d, s in enumerate(sizes):
            if s:
                packer.add(d, grad[off : off + s])
                off += s

    def grad_bytes(self, st, r: int) -> int:
        return 0 if self.rule is None else padded(int(st.hdr_in[r, self.col]) * self._grad_bytes)

    def apply(self, st, readers) -> None:
        """Owner: sum each key's gradients over the ranks (rank order), apply the optimizer once per key."""
        if self.rule is None:
            return
        sizes = st.hdr_in[:, self.col].tolist()
        parts = [readers[r].take(s * self.dim, self.grad_dtype).view(s, self.dim) for r, s in enumerate(sizes)]
        own = st.own.get(self.t)
        if own is None:
            return
        invs, slots, sources = own
        dev = self.coll.device
        if invs is None:
            grad = parts[sources[0]].to(dev)
        else:
            grad = torch.zeros(slots.numel(), self.dim, dtype=self.grad_dtype, device=dev)
            for r in sources:  # keys are unique per requester: no two writes collide within one call
                grad.index_add_(0, invs[r], parts[r].to(dev))
        known = slots >= 0
        if not bool(known.all()):
            slots, grad = slots[known], grad[known]
        if slots.numel():
            self.rule.apply(self.coll._stores[self.t].storage(), slots, grad, lr=self.coll._lr(self.t),
                            step=st.step)
