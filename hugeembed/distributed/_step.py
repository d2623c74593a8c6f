"""The state of one sharded step, and the autograd node that runs its backward exchange."""

from __future__ import annotations

import torch

__all__ = ["StepState", "ExchangeBackward", "apply_received_grads", "compute_dtype", "group_dtypes", "MAGIC"]

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
        self.pooled: dict = {}
        self.pool_replies: list = []
        self.local_grads: dict = {}
        self.outputs: list = []


class ExchangeBackward(torch.autograd.Function):
    """Makes loss.backward() run the sharded backward (exchange + owners' optimizer) once per step."""

    @staticmethod
    def forward(ctx, coll, st, anchor):  # type: ignore[override]
        ctx.coll, ctx.st = coll, st
        return tuple(t.detach() for t in st.outputs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        coll, st = ctx.coll, ctx.st
        ctx.st = None
        coll.backward_step(st, grads)
        return None, None, None


def apply_received_grads(group, st: StepState, readers, inv: torch.Tensor | None, slots: torch.Tensor | None,
                         per_table: list[int] | None) -> None:
    """Owner side of a row group's backward: sums the gradient rows every rank sent for each
    distinct (table, key) of `compute` (``inv``/``slots``/``per_table``), in rank order so that
    every run sums the same way, and applies each table's optimizer once per key."""
    per_src = st.hdr_in[:, group.cols].sum(1).tolist()
    parts = [readers[r].take(n * group.dim, group.grad_dtype).view(n, group.dim) for r, n in enumerate(per_src)]
    if slots is None:  # nothing came this step (the readers were still consumed above)
        return
    dev = group.coll.device
    grad = torch.zeros(slots.numel(), group.dim, dtype=group.grad_dtype, device=dev)
    off = 0
    for r, n in enumerate(per_src):
        if n:
            grad.index_add_(0, inv[off : off + n], parts[r].to(dev))
            off += n
    start = 0
    for i, n in enumerate(per_table):
        rule, sl = group.rules[i], slice(start, start + n)
        start += n
        if rule is None or n == 0:
            continue
        s, g = slots[sl], grad[sl]
        known = s >= 0  # keys not admitted yet take no update
        if not bool(known.all()):
            s, g = s[known], g[known]
        if s.numel():
            rule.apply(group.coll._stores[group.ts[i]].storage(), s, g, lr=group.coll._lr(group.ts[i]), step=st.step)
