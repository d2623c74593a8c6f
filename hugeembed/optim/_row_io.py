"""The torch twins' access to a table's rows (RowIO) and the dtypes they compute and count in."""

from __future__ import annotations

import torch

from ..errors import InputError
from ._rounding import round_stochastic

# Storage dtypes the twin computes in float32 (weights rounded back on store).
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Integer views of a float storage column, used for exact integer counters.
_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64}


def compute_dtype(storage: torch.Tensor) -> torch.dtype:
    """The dtype the twin computes in: the storage's own, or float32 for 16-bit storage."""
    return torch.float32 if storage.dtype in _LOW_PRECISION else storage.dtype


def int_view_dtype(storage: torch.Tensor, owner: str) -> torch.dtype:
    """The integer dtype whose bit pattern holds a counter in one column of `storage`."""
    dt = _INT_VIEW.get(storage.dtype)
    if dt is None:
        raise InputError(
            f"{owner}: integer counters need float32 or float64 storage (stored as the bits of an "
            f"int32/int64), got {storage.dtype}; use mode='lazy' with bias_correction='global_step', "
            f"which keeps no counter"
        )
    return dt


class RowIO:
    """The torch twins' access to a table's rows: typed views of its weights ``[R, D]`` and
    state ``[R, S]`` (a RowLayout's, or a plain storage's columns), the dtype to compute in,
    and how updated weights are rounded back (None: to nearest)."""

    def __init__(self, weights: torch.Tensor, state: torch.Tensor, compute: torch.dtype, rounding=None) -> None:
        self.weights, self.state, self.compute, self.rounding = weights, state, compute, rounding

    @classmethod
    def of_store(cls, store, step: int, keys: torch.Tensor | None = None,
                 seeds: int | torch.Tensor | None = None) -> "RowIO":
        """The typed views of `store`'s layout; weights rounded as the layout says (stochastically:
        from the row's table seed, `step`, its key and the column; `keys` / `seeds` as for
        :meth:`SparseOptimizer.update`, aligned with the slots the rule writes)."""
        lay = store.layout
        storage = store.storage()
        rounding = None
        if lay.stochastic_rounding:
            if seeds is None:
                seeds = store.seed

            def rounding(w, slots):
                k = keys if keys is not None else store.keys_of(slots)
                return round_stochastic(w, lay.dtype, seeds=seeds, step=step, keys=k)

        return cls(lay.weights(storage), lay.state(storage), lay.compute_dtype, rounding)

    @classmethod
    def plain(cls, storage: torch.Tensor, dim: int, state_width: int) -> "RowIO":
        """Weights in columns [0, D), state in [D, D + S) of `storage`, both of its dtype."""
        return cls(storage[:, :dim], storage[:, dim : dim + state_width], compute_dtype(storage))

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.weights.dtype

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, state) of `slots` as new tensors in the compute dtype."""
        return self.weights[slots].to(self.compute), self.state[slots].to(self.compute)

    def write(self, slots: torch.Tensor, w: torch.Tensor, state: torch.Tensor | None = None) -> None:
        """Writes `w` (rounded to the weight dtype) and `state` (to the state dtype) at `slots`."""
        if self.rounding is not None:
            self.weights[slots] = self.rounding(w, slots)
        else:
            self.weights[slots] = w.to(self.weights.dtype)
        if state is not None and state.shape[1]:
            self.state[slots] = state.to(self.state.dtype)
