"""Data-parallel tables: a full replica on every rank, kept bit-identical.

Training step, for the replicated tables of one (dim, dtype, trainable) group::

    every rank: its unique keys + hit counts, all tables in one segment ─► all ranks
    every rank: per table, the union of all ranks' keys (sorted) ── find_or_insert with the
                summed counts (the same call on every replica, so admission, counters and
                slots agree)
    every rank: pools its own batch from its replica (no rows travel)
    backward  : its per-key row gradients ─► all ranks; each rank sums a key's gradients in
                rank order and applies the same update: replicas stay bit-identical

Evaluation needs no exchange at all: each rank reads its replica.
"""

from __future__ import annotations

import torch

from ._step import OwnedRowsGroup
from ._wire import Packer, padded, segments, union_received

__all__ = ["ReplicatedGroup"]


class ReplicatedGroup(OwnedRowsGroup):
    """Exchange of the data-parallel tables of one (dim, dtype, trainable) group.

    Args:
        coll: the ShardedEmbeddingCollection.
        members: per table, (collection index, index in the local lookup).
        col: the first of its header columns (one per table: keys sent to every rank).
        grad_dtype: the dtype of the row gradients the local lookup computes.
    """

    def __init__(self, coll, members: list[tuple[int, int]], col: int, grad_dtype: torch.dtype) -> None:
        self.coll = coll
        self.ts = [t for t, _ in members]
        self.lts = [lt for _, lt in members]
        self.cols = list(range(col, col + len(members)))
        self.header_cols = len(members)
        self.dim = coll.tables[self.ts[0]].dim
        self.rules = [coll.rules[t] for t in self.ts]
        self.trainable = any(r is not None for r in self.rules)
        self.grad_dtype = grad_dtype
        self._grad_bytes = self.dim * torch.empty(0, dtype=grad_dtype).element_size()

    # -- forward -------------------------------------------------------------------------

    def input_dist(self, st, header: torch.Tensor, packer: Packer) -> None:
        prep = st.prep_l
        counts = [prep.unique_count[lt] for lt in self.lts]
        header[:, self.cols] = torch.tensor(counts, dtype=torch.int64) if st.training else 0
        pos, _ = segments([prep.unique_base[lt] for lt in self.lts], counts, self.coll.device)
        st.req[self] = (pos, counts)
        if st.training and pos.numel():
            packer.add_all(prep.unique_keys[pos])
            packer.add_all(prep.unique_counts[pos].to(torch.int32))

    def input_bytes(self, st, r: int) -> int:
        n = int(st.hdr_in[r, self.cols].sum())
        return padded(8 * n) + padded(4 * n)

    def compute(self, st, readers, replies: Packer) -> None:
        pos, counts = st.req[self]
        if not st.training:  # every rank reads its own replica
            keys = st.prep_l.unique_keys[pos]
            slots = self.owned_slots(st, keys, counts, None, False)
            overlay, start = {}, 0
            for t, n in zip(self.ts, counts):  # rows as they are now (see coll.current_rows)
                overlay[t], slots[start : start + n] = self.coll.current_rows(t, slots[start : start + n],
                                                                              keys[start : start + n])
                start += n
            st.own[self] = (None, None, None, None, slots, overlay)
            return
        got = union_received(readers, st.hdr_in[:, self.cols], self.coll.device, with_counts=True)
        if got is None:
            st.own[self] = None
            return
        # the union is the same keys in the same order on every replica
        per_src, inv, uniq, per_table, ucounts = got
        slots = self.owned_slots(st, uniq, per_table, ucounts, True)
        mine = sum(per_src[: st.rank])
        local = slots[inv[mine : mine + per_src[st.rank]]]
        st.own[self] = (inv, slots, per_table, uniq, local, {})

    def output_bytes(self, st, d: int) -> int:
        return 0

    def output_dist(self, st, readers) -> None:
        if not st.replicas_late:  # else the pipeline reads them after the updates this batch may see
            self.read_replica(st)

    def read_replica(self, st) -> None:
        """The batch's rows from this rank's replica as it is now (copied under staleness)."""
        own = st.own.get(self)
        overlay = own[5] if own is not None else {}
        for t, lt in zip(self.ts, self.lts):
            st.storages_l[lt] = overlay.get(t, self.coll.rows_of(t))
        if own is None:
            return
        pos, counts = st.req[self]
        local = own[4]
        if st.stale_reads:  # the replica changes before this batch's forward: copy its rows as of now
            local, start = local.clone(), 0
            for lt, n in zip(self.lts, counts):
                s = local[start : start + n]
                st.storages_l[lt] = st.storages_l[lt][s.clamp(min=0)]
                local[start : start + n] = torch.where(s >= 0, torch.arange(n, device=s.device), s)
                start += n
        st.slots_l[pos] = local

    # -- backward ------------------------------------------------------------------------

    def grad_dist(self, st, packer: Packer) -> None:
        own = st.own.get(self)
        if not self.trainable or own is None:
            return
        local = own[4]
        counts = st.req[self][1]
        grad = torch.zeros(local.numel(), self.dim, dtype=self.grad_dtype, device=self.coll.device)
        start = 0
        for lt, n in zip(self.lts, counts):
            got = st.local_grads.get(lt)
            if got is not None:  # the hook saw this table's admitted keys, in key order
                known = torch.nonzero(local[start : start + n] >= 0).flatten() + start
                grad.index_copy_(0, known, got[1].to(self.grad_dtype))
            start += n
        if st.grad_scale != 1.0:
            grad.mul_(st.grad_scale)
        if grad.numel():
            packer.add_all(grad)
