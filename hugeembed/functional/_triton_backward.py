"""The backward on the triton kernels: a training step's pooled-output gradients, read by the fused
optimizer kernel (hugeembed/_triton/segment_optim.py) through each kept id, with no gradient rows made.

A row-grad hook with ``fusable()`` / ``fused(grads)`` methods (nn/_updates.RowUpdates) takes a
:class:`FusedGrads` instead of per-table gradient rows, when the lookup runs on triton and the batch
is what the kernels take (:func:`fuses`): pooled features only, no max_norm, every id a row (static
tables), float32 output gradients.  Anything else takes the torch reference's backward_torch.
"""

from __future__ import annotations

import dataclasses

import torch

from ._plan import LookupPlan, Prepared

__all__ = ["FusedGrads", "fuses"]


def fuses(plan: LookupPlan, prep: Prepared, pooled: list, unpooled: list, unsure: list[int]) -> bool:
    """Whether a step's gradients can go to the fused kernel: pooled float32 outputs only, float32 (or
    no) weights, no max_norm, no table whose ids may lack a row."""
    return (not unsure and prep.deduplicated and not any(u is not None for u in unpooled)
            and not any(t.max_norm for t in plan.tables) and all(p is None or p.dtype == torch.float32 for p in pooled)
            and (prep.weights is None or prep.weights.dtype == torch.float32))


class FusedGrads:
    """One step's pooled-output gradients and, per kept entry (``prep.inverse``'s order), its row (slot
    in its group's rows), its key and its table (lookup position); per dim, the :class:`PooledGrads`
    the kernel reads.  Made in one launch (segment_optim.bag_terms) and no host read."""

    def __init__(self, plan: LookupPlan, prep: Prepared, slots: torch.Tensor, pooled: list) -> None:
        from .._triton.segment_optim import PooledGrads, bag_terms  # (triton imports: the lookup runs on it)

        dev = prep.offsets.device
        B = prep.batch_size
        n = prep.inverse.numel()
        arrays = plan.arrays(dev)
        bag_of, denom, self.entry_tables, self.entry_slots, self.entry_keys = bag_terms(
            prep.offsets, prep.weights, arrays["combiner"], B, n,
            entries=(prep.inverse, slots, prep.unique_keys, arrays["table"]))
        self.count = n
        # the triton prepare's runs (its sorted entries by unique key) with the slots as their rows: the
        # update reads them instead of deduplicating the entries' slots again
        self.runs = None if prep.runs is None else dataclasses.replace(prep.runs, rows=slots)
        self._by_dim: dict[int, PooledGrads] = {}
        for g, group in enumerate(plan.groups):
            if not group.pooled:
                continue
            k_of = [0] * plan.num_features
            for k, f in enumerate(group.pooled):
                k_of[f] = k
            grad = pooled[g].reshape(-1, group.dim)
            self._by_dim[group.dim] = PooledGrads(grad if grad.is_contiguous() else grad.contiguous(),
                                                  plan.on_device(tuple(k_of), dev), bag_of, denom, prep.weights,
                                                  B, len(group.pooled))

    def of_dim(self, dim: int):
        """The PooledGrads (hugeembed/_triton/segment_optim.py) the entries of dim `dim`'s tables read."""
        return self._by_dim[dim]
