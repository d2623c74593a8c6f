"""Adagrad (element-wise, torch.optim.Adagrad) and row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .._tensors import row_independent
from . import _native_ops
from ._base import SparseOptimizer
from ._checks import check_real
from ._kernel_floats import rdiv, sqrt_rn

__all__ = ["Adagrad", "RowWiseAdagrad"]


@dataclass(frozen=True)
class Adagrad(SparseOptimizer):
    """Adagrad with torch.optim.Adagrad semantics; state: ``sum [D]``.

    Per touched row at global step t::

        g'  = g + weight_decay * w
        clr = lr / (1 + (t - 1) * lr_decay)
        sum = sum + g' * g'                         (sum starts at initial_accumulator_value)
        w   = w - clr * g' / (sqrt(sum) + eps)

    Untouched rows keep their weight and sum, exactly as dense torch.optim.Adagrad
    with a zero gradient for them (or its sparse-gradient path).  `t` is the
    table's step, so lr_decay follows the global step.

    Args:
        lr: learning rate, >= 0.
        initial_accumulator_value: starting value of `sum`, >= 0.
        eps: added to the denominator, > 0.
        lr_decay: >= 0.
        weight_decay: L2 penalty added to the gradient of touched rows, >= 0.
    """

    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    name: ClassVar[str] = "adagrad"

    def __post_init__(self) -> None:
        super().__post_init__()
        o = self._owner
        self._set("initial_accumulator_value",
                  check_real(o, "initial_accumulator_value", self.initial_accumulator_value, ge=0.0))
        self._set("eps", check_real(o, "eps", self.eps, gt=0.0))
        self._set("lr_decay", check_real(o, "lr_decay", self.lr_decay, ge=0.0))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, ge=0.0))

    def state_width(self, dim: int) -> int:
        return dim

    @row_independent
    def init_state(self, state: torch.Tensor) -> None:
        self._check_state(state)
        state.fill_(self.initial_accumulator_value)

    def _clr(self, lr: float, step: int) -> float:
        return lr / (1 + (step - 1) * self.lr_decay)

    def _apply_native(self, storage, slots, grad, lr, step):
        _native_ops.run("he_optim_adagrad", storage, slots, grad, grad.shape[1],
                        reals=(self._clr(lr, step), self.eps, self.weight_decay))

    def _apply_torch(self, io, slots, grad, lr, step):
        w, acc = io.read(slots)
        g = grad.to(w.dtype)
        if self.weight_decay != 0.0:
            g = g + w * self.weight_decay
        acc = acc + g * g
        std = sqrt_rn(acc) + self.eps
        w = w - (g * self._clr(lr, step)) / std
        io.write(slots, w, acc)


@dataclass(frozen=True)
class RowWiseAdagrad(SparseOptimizer):
    """Row-wise Adagrad: one accumulator per row (FBGEMM's EXACT_ROWWISE_ADAGRAD); state width 1.

    Per touched row (FBGEMM's CPU/GPU update with weight_decay_mode L2)::

        g'   = g + weight_decay * w
        acc  = acc + mean_d(g'_d ** 2)              (acc starts at initial_accumulator_value)
        mult = lr / (sqrt(acc) + eps)
        w    = (1 - mult * weight_decay) * w - mult * g      ( = w - mult * g' )

    The mean is summed in float64 and rounded once.

    Args:
        lr: learning rate, >= 0.
        eps: added to the denominator, > 0 (FBGEMM's default 1e-8).
        initial_accumulator_value: starting value of `acc`, >= 0.
        weight_decay: L2 penalty, >= 0 (FBGEMM's WeightDecayMode.L2).
    """

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    weight_decay: float = 0.0
    name: ClassVar[str] = "rowwise_adagrad"

    def __post_init__(self) -> None:
        super().__post_init__()
        o = self._owner
        self._set("eps", check_real(o, "eps", self.eps, gt=0.0))
        self._set("initial_accumulator_value",
                  check_real(o, "initial_accumulator_value", self.initial_accumulator_value, ge=0.0))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, ge=0.0))

    def state_width(self, dim: int) -> int:
        return 1

    def _dims_for_width(self, width: int) -> range:
        return range(1, 2)

    @row_independent
    def init_state(self, state: torch.Tensor) -> None:
        self._check_state(state)
        state.fill_(self.initial_accumulator_value)

    def _apply_native(self, storage, slots, grad, lr, step):
        _native_ops.run("he_optim_rowwise_adagrad", storage, slots, grad, grad.shape[1],
                        reals=(lr, self.eps, self.weight_decay))

    def _apply_torch(self, io, slots, grad, lr, step):
        dim = grad.shape[1]
        w, acc = io.read(slots)
        g = grad.to(w.dtype)
        gp = g + w * self.weight_decay if self.weight_decay != 0.0 else g
        gp64 = gp.double()
        mean = ((gp64 * gp64).sum(dim=1, keepdim=True) / dim).to(w.dtype)
        acc = acc + mean
        mult = rdiv(lr, sqrt_rn(acc) + self.eps)
        if self.weight_decay != 0.0:
            w = w * (1.0 - mult * self.weight_decay) - g * mult
        else:
            w = w - g * mult
        io.write(slots, w, acc)
