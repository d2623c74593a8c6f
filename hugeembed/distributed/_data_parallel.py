"""Data-parallel tables: a full replica on every rank, kept bit-identical.

Training step, for one table::

    every rank: its unique keys + hit counts ─► all ranks
    every rank: union of all ranks' keys (sorted) ── find_or_insert with the summed counts
                (the same call on every replica, so admission, counters and slots agree)
    every rank: pools its own batch from its replica (no rows travel)
    backward  : its per-key gradient ─► all ranks; each rank sums a key's gradients in rank
                order and applies the same update: replicas stay bit-identical

Evaluation needs no exchange at all: each rank reads its replica.
"""

from __future__ import annotations

import torch

from ._wire import Packer, padded

__all__ = ["ReplicatedRoute"]


class ReplicatedRoute:
    """Exchange of one data-parallel table (see the module docstring)."""

    header_cols = 1

    def __init__(self, coll, t: int, lt: int, col: int, grad_dtype: torch.dtype) -> None:
        cfg = coll.tables[t]
        self.coll, self.t, self.lt, self.col = coll, t, lt, col
        self.name, self.dim = cfg.name, cfg.dim
        self.rule = coll.rules[t]
        self.grad_dtype = grad_dtype
        self._grad_bytes = self.dim * torch.empty(0, dtype=grad_dtype).element_size()

    def input_dist(self, st, header: torch.Tensor, packer: Packer) -> None:
        if not st.training:
            header[:, self.col] = 0
            return
        keys = st.prep_l.keys_of(self.lt)
        header[:, self.col] = keys.numel()
        if keys.numel():
            packer.add_all(keys)
            packer.add_all(st.prep_l.counts_of(self.lt).to(torch.int32))

    def input_bytes(self, st, r: int) -> int:
        n = int(st.hdr_in[r, self.col])
        return padded(8 * n) + padded(4 * n)

    def compute(self, st, readers, replies: Packer) -> None:
        store = self.coll._stores[self.t]
        if not st.training:
            st.own[self.t] = (None, None, store.find(st.prep_l.keys_of(self.lt)))
            return
        sizes = st.hdr_in[:, self.col].tolist()
        dev = self.coll.device
        keys = [readers[r].take(s, torch.int64).to(dev) for r, s in enumerate(sizes)]
        counts = [readers[r].take(s, torch.int32).to(dev) for r, s in enumerate(sizes)]
        if sum(sizes) == 0:
            st.own[self.t] = None
            return
        if st.world_size == 1:
            uniq, invs, ucounts = keys[0], None, counts[0].to(torch.int64)
        else:
            uniq, inv = torch.unique(torch.cat(keys), sorted=True, return_inverse=True)
            invs = list(torch.split(inv, sizes))
            ucounts = torch.zeros(uniq.numel(), dtype=torch.int64, device=dev).index_add_(
                0, inv, torch.cat(counts).to(torch.int64))
        slots = store.find_or_insert(uniq, st.step, counts=ucounts)
        local = slots if invs is None else slots[invs[st.rank]]
        st.own[self.t] = (invs, slots, local)

    def output_bytes(self, st, d: int) -> int:
        return 0

    def output_dist(self, st, readers) -> None:
        own = st.own.get(self.t)
        st.storages_l[self.lt] = self.coll._stores[self.t].storage()
        if own is None:
            return
        local = own[2]
        b = st.prep_l.unique_base[self.lt]
        st.slots_l[b : b + local.numel()] = local

    def grad_dist(self, st, packer: Packer) -> None:
        if self.rule is None:
            return
        own = st.own.get(self.t)
        if own is None:
            return
        local = own[2]
        grad = torch.zeros(local.numel(), self.dim, dtype=self.grad_dtype, device=self.coll.device)
        got = st.local_grads.get(self.lt)
        if got is not None:  # the hook saw the admitted keys only, in key order
            known = torch.nonzero(local >= 0).flatten()
            grad.index_copy_(0, known, got[1].to(self.grad_dtype))
        if st.grad_scale != 1.0:
            grad.mul_(st.grad_scale)
        if grad.numel():
            packer.add_all(grad)

    def grad_bytes(self, st, r: int) -> int:
        return 0 if self.rule is None else padded(int(st.hdr_in[r, self.col]) * self._grad_bytes)

    def apply(self, st, readers) -> None:
        if self.rule is None:
            return
        sizes = st.hdr_in[:, self.col].tolist()
        parts = [readers[r].take(s * self.dim, self.grad_dtype).view(s, self.dim) for r, s in enumerate(sizes)]
        own = st.own.get(self.t)
        if own is None:
            return
        invs, slots, _ = own
        dev = self.coll.device
        if invs is None:
            grad = parts[0].to(dev)
        else:
            grad = torch.zeros(slots.numel(), self.dim, dtype=self.grad_dtype, device=dev)
            for r, s in enumerate(sizes):  # rank order on every replica: the same sums everywhere
                if s:
                    grad.index_add_(0, invs[r], parts[r].to(dev))
        known = slots >= 0
        if not bool(known.all()):
            slots, grad = slots[known], grad[known]
        if slots.numel():
            self.rule.apply(self.coll._stores[self.t].storage(), slots, grad, lr=self.coll._lr(self.t),
                            step=st.step)
