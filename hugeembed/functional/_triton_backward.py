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

__all__ = ["FusedGrads", "fuses", "sums_on_triton", "gradient_rows_triton"]


def fuses(plan: LookupPlan, prep: Prepared, pooled: list, unpooled: list, unsure: list[int]) -> bool:
    """Whether a step's gradients can go to the fused kernel: pooled float32 outputs only, float32 (or
    no) weights, no max_norm, no table whose ids may lack a row."""
    return not unsure and not any(t.max_norm for t in plan.tables) and _kernels_read(prep, pooled, unpooled)


def _kernels_read(prep: Prepared, pooled: list, unpooled: list) -> bool:
    """Whether the kernels read these gradients: a deduplicated batch, pooled float32 outputs only, float32
    (or no) weights."""
    return (prep.deduplicated and not any(u is not None for u in unpooled)
            and all(p is None or p.dtype == torch.float32 for p in pooled)
            and (prep.weights is None or prep.weights.dtype == torch.float32))


class FusedGrads:
    """One step's pooled-output gradients and, per kept entry (``prep.inverse``'s order), its row (slot
    in its group's rows), its key and its table (lookup position); per dim, the :class:`PooledGrads`
    the kernel reads.  Made in one launch (segment_optim.bag_terms) and no host read."""

    def __init__(self, plan: LookupPlan, prep: Prepared, slots: torch.Tensor, pooled: list) -> None:
        from .._triton.segment_optim import bag_terms  # (triton imports: the lookup runs on it)

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
        self._by_dim = {plan.groups[g].dim: src for g, src in _pooled_grads(plan, prep, pooled, bag_of, denom)}

    def of_dim(self, dim: int):
        """The PooledGrads (hugeembed/_triton/segment_optim.py) the entries of dim `dim`'s tables read."""
        return self._by_dim[dim]


def _pooled_grads(plan: LookupPlan, prep: Prepared, pooled: list, bag_of, denom):
    """(group index, PooledGrads) of each dim group with pooled features: how the kernels read its gradient."""
    from .._triton.segment_optim import PooledGrads

    dev = prep.offsets.device
    for g, group in enumerate(plan.groups):
        if not group.pooled:
            continue
        grad = pooled[g].reshape(-1, group.dim)
        yield g, PooledGrads(grad if grad.is_contiguous() else grad.contiguous(), _slot_of(plan, g, dev),
                             bag_of, denom, prep.weights, prep.batch_size, len(group.pooled))


def _tables_of_dim(plan: LookupPlan, dim: int, device: torch.device) -> torch.Tensor:
    """int64 [T]: 1 for the tables of `dim`."""
    return plan.memo(("tables_of_dim", dim, device),
                     lambda: plan.on_device(tuple(int(t.dim == dim) for t in plan.tables), device))


def _slot_of(plan: LookupPlan, g: int, device: torch.device) -> torch.Tensor:
    """Each plan feature's place among group g's pooled features (0 for the other groups' features)."""
    def make():
        k_of = [0] * plan.num_features
        for k, f in enumerate(plan.groups[g].pooled):
            k_of[f] = k
        return plan.on_device(tuple(k_of), device)

    return plan.memo(("slot_of", g, device), make)


def sums_on_triton(prep: Prepared, pooled: list, unpooled: list) -> bool:
    """Whether the triton kernels can sum a step's gradient rows: a batch the triton prepare deduplicated
    (its sorted runs), pooled float32 outputs only, float32 (or no) weights."""
    return prep.runs is not None and _kernels_read(prep, pooled, unpooled)


def gradient_rows_triton(plan: LookupPlan, prep: Prepared, pooled: list) -> dict[int, torch.Tensor]:
    """gradient_rows_torch's result (per dim D, ``[capacity, D]``: each unique key's summed output gradient, other
    dims' rows zero) from the triton prepare's runs: each row summed by one program in batch order, with no
    ``[ids, D]`` product made (at batch 65536, d128, pooling 20 that product alone is 16 GiB) and no float
    atomics (CUDA's index_add_ sums in no fixed order); after :func:`sums_on_triton` said yes."""
    from .._triton.segment_optim import bag_terms, segment_sum

    dev = prep.offsets.device
    bag_of, denom = bag_terms(prep.offsets, prep.weights, plan.arrays(dev)["combiner"], prep.batch_size,
                              prep.inverse.numel())
    out: dict[int, torch.Tensor] = {}
    for g, src in _pooled_grads(plan, prep, pooled, bag_of, denom):
        D = plan.groups[g].dim
        rows = out.setdefault(D, torch.zeros(prep.capacity, D, dtype=torch.float32, device=dev))
        segment_sum(prep.runs, src, rows, _tables_of_dim(plan, D, dev))
    return out
