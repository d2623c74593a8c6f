"""The state of one sharded step, and the autograd node that runs its backward exchange."""

from __future__ import annotations

import torch

from ..errors import StoreError
from ._wire import padded

__all__ = ["StepState", "ExchangeBackward", "OwnedRowsGroup", "compute_dtype", "group_dtypes", "MAGIC"]

MAGIC = 0x48454D42  # "HEMB": a header from something else is caught at once


def compute_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.float32 if dt in (torch.float16, torch.bfloat16) else dt


def group_dtypes(plan, dtypes: list[torch.dtype]) -> dict[int, torch.dtype]:
    """Table index -> the output dtype of its dim group (as the fused lookup promotes it)."""
    out = {}
    for group in plan.groups:
        ts = sorted({plan.feature_table[f] for f in group.pooled + group.unpooled})
        dt = dtypes[ts[0]]
        for t in ts:
            dt = torch.promote_types(dt, dtypes[t])
        out.update({t: dt for t in ts})
    return out


class StepState:
    """What one forward leaves for the rest of the step (and for backward)."""

    COL_B, COL_W, COMMON = 3, 4, 5

    def __init__(self, training: bool, step: int, rank: int, world_size: int, batch_size: int,
                 grad_scale: float) -> None:
        self.training, self.step, self.rank, self.world_size = training, step, rank, world_size
        self.batch_size, self.grad_scale = batch_size, grad_scale
        self.prep_l = self.prep_p = self.slots_l = self.hdr_in = self.in_readers = self.replies = None
        self.storages_l: list = []
        self.req: dict = {}
        self.own: dict = {}
        self.rare: dict = {}  # owner groups: (hit counts per distinct key or None, per table its shared row's slot)
        self.pooled: dict = {}
        self.pool_replies: list = []
        self.local_grads: dict = {}
        self.outputs: list = []
        self.flight = None  # InFlight of the owner rows this rank fetched for a training step
        self.stale_reads = False  # rows are read K >= 1 steps ahead: replicas are copied at the fetch
        self.replicas_late = False  # ... or later (replicated_staleness < K): _read_replicas copies them


class ExchangeBackward(torch.autograd.Function):
    """Makes loss.backward() run the sharded backward (exchange + owners' optimizer) once per step."""

    @staticmethod
    def forward(ctx, coll, st, anchor):  # type: ignore[override]
        ctx.coll, ctx.st = coll, st
        return tuple(t.detach() for t in st.outputs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        coll, st = ctx.coll, ctx.st
        if st is None:  # its exchange and the owners' update ran already; a second one would add them twice
            raise StoreError("the backward of a sharded step runs once (retain_graph cannot repeat it): "
                             "every rank exchanges its gradients and applies them in one collective step")
        ctx.st = None
        coll.backward_step(st, grads)
        return None, None, None


class OwnedRowsGroup:
    """The owner side of the backward of a group whose owners hold (table, key) rows: row-wise
    and data-parallel groups.  ``compute`` leaves ``st.own[self] = (inv, slots, per_table, ...)``
    (or None when nothing came); subclasses set cols, dim, grad_dtype, _grad_bytes, rules, ts,
    coll and trainable."""

    def owned_slots(self, st: StepState, uniq: torch.Tensor, per_table: list[int], counts: torch.Tensor | None,
                    training: bool, shared_rows: bool = True) -> torch.Tensor:
        """Row slots of the distinct keys `uniq` (grouped by table as `per_table`): in training
        one fetch per group (fetch_slots: new keys get rows, pinned until the backward
        of the step), else find (readers take the rows through ``coll.current_rows``).
        Leaves ``st.rare[self]``: hit counts (lr_count_scale) and each table's shared row slot.
        `shared_rows`: as for fetch_slots (False: row-wise shards)."""
        parts, start = [], 0
        for t, n in zip(self.ts, per_table):
            if n:
                parts.append((t, slice(start, start + n)))
            start += n
        got = self.coll.fetch_slots([t for t, _ in parts], [uniq[sl] for _, sl in parts], st.step, training,
                                    None if counts is None else [counts[sl] for _, sl in parts],
                                    shared_rows=shared_rows)
        slots = torch.empty(uniq.numel(), dtype=torch.int64, device=uniq.device)
        hits = None
        shared = dict.fromkeys(self.ts, -1)
        for (t, sl), g, h, sh in zip(parts, got.slots, got.hits, got.shared):
            slots[sl] = g
            shared[t] = sh
            if h is not None:
                if hits is None:
                    hits = torch.zeros(uniq.numel(), dtype=torch.int64, device=uniq.device)
                hits[sl] = h
            if training:
                st.flight.pin(self.coll.group_index(t), g)
        st.rare[self] = (hits, [shared[t] for t in self.ts])
        return slots

    def grad_bytes(self, st: StepState, r: int) -> int:
        return padded(int(st.hdr_in[r, self.cols].sum()) * self._grad_bytes) if self.trainable else 0

    def apply(self, st: StepState, readers) -> None:
        """Sums the gradient rows every rank sent for each distinct (table, key) of ``compute``, in
        rank order so every run sums the same way, and applies each table's optimizer once per key."""
        if not self.trainable:
            return
        per_src = st.hdr_in[:, self.cols].sum(1).tolist()
        parts = [readers[r].take(n * self.dim, self.grad_dtype).view(n, self.dim) for r, n in enumerate(per_src)]
        own = st.own.get(self)
        if own is None:  # nothing came this step (the readers were still consumed above)
            return
        inv, slots, per_table, uniq = own[:4]
        dev = self.coll.device
        grad = torch.zeros(slots.numel(), self.dim, dtype=self.grad_dtype, device=dev)
        off = 0
        for r, n in enumerate(per_src):
            if n:
                grad.index_add_(0, inv[off : off + n], parts[r].to(dev))
                off += n
        hits, shared = st.rare.get(self, (None, [-1] * len(self.ts)))
        start = 0
        for i, n in enumerate(per_table):
            rule, sl = self.rules[i], slice(start, start + n)
            start += n
            if rule is None or n == 0:
                continue
            s, g, k = slots[sl], grad[sl], uniq[sl]
            h = hits[sl] if hits is not None and self.coll.tables[self.ts[i]].lr_count_scale is not None else None
            known = s >= 0  # keys not admitted yet take no update
            if not bool(known.all()):
                s, g, k = s[known], g[known], k[known]
                h = h[known] if h is not None else None
            if s.numel():
                self.coll.update_rows(self.ts[i], s, g, st.flight, keys=k, hits=h, shared_slot=shared[i])
