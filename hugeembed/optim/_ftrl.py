"""FTRL-Proximal with TensorFlow's exact per-coordinate update (tf.keras.optimizers.Ftrl)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ConfigError
from .._tensors import row_independent
from . import _native_ops
from ._base import SparseOptimizer
from ._checks import check_real
from ._kernel_floats import sqrt_rn

__all__ = ["FTRL"]


@dataclass(frozen=True)
class FTRL(SparseOptimizer):
    """FTRL-Proximal (McMahan et al. 2013) as TF's ApplyFtrlV2; state ``[n (D) | z (D)]``.

    Per coordinate of a touched row, with p = -lr_power and the runtime lr::

        gs    = g + 2 * l2_shrinkage * w
        n'    = n + g^2                           (the raw gradient, as TF 2.x)
        sigma = (n'^p - n^p) / lr
        z     = z + gs - sigma * w
        l2'   = l2 + beta / (2 * lr)               (Keras / tf.compat.v1 fold beta into l2)
        w     = (clip(z, -l1, l1) - z) / (n'^p / lr + 2 * l2')     ( = 0 when |z| <= l1 )
        n     = n'

    n starts at initial_accumulator_value, z at 0.  With p = 0.5 the powers are
    square roots; otherwise they are computed in float64 and rounded once.

    Args:
        lr: learning rate, > 0 (the update divides by it).
        lr_power: <= 0 (TF's learning_rate_power).
        initial_accumulator_value: >= 0.
        l1, l2, l2_shrinkage, beta: >= 0.
    """

    lr_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1: float = 0.0
    l2: float = 0.0
    l2_shrinkage: float = 0.0
    beta: float = 0.0
    name: ClassVar[str] = "ftrl"

    def __post_init__(self) -> None:
        super().__post_init__()
        o = self._owner
        if self.lr == 0.0:
            raise ConfigError(f"{o}: lr must be > 0 (FTRL divides by it), got {self.lr!r}")
        self._set("lr_power", check_real(o, "lr_power", self.lr_power, le=0.0))
        self._set("initial_accumulator_value",
                  check_real(o, "initial_accumulator_value", self.initial_accumulator_value, ge=0.0))
        for field in ("l1", "l2", "l2_shrinkage", "beta"):
            self._set(field, check_real(o, field, getattr(self, field), ge=0.0))

    def state_width(self, dim: int) -> int:
        return 2 * dim

    @row_independent
    def init_state(self, state: torch.Tensor) -> None:
        dim = self._check_state(state)
        state[:, :dim].fill_(self.initial_accumulator_value)
        state[:, dim:].zero_()

    def _hyper(self, lr: float) -> tuple[float, float]:
        if lr <= 0.0:
            raise ConfigError(f"{self._owner}: the runtime lr must be > 0 (FTRL divides by it), got {lr!r}")
        return 2.0 * (self.l2 + self.beta / (2.0 * lr)), 2.0 * self.l2_shrinkage

    def _apply_native(self, storage, slots, grad, lr, step):
        two_l2, two_shrink = self._hyper(lr)
        _native_ops.run("he_optim_ftrl", storage, slots, grad, grad.shape[1],
                        reals=(lr, self.lr_power, self.l1, two_l2, two_shrink))

    def _apply_torch(self, io, slots, grad, lr, step):
        two_l2, two_shrink = self._hyper(lr)
        D = grad.shape[1]
        w, state = io.read(slots)
        n, z = state[:, :D], state[:, D:]
        cd = w.dtype
        g = grad.to(cd)
        gs = g + w * two_shrink if two_shrink != 0.0 else g
        n_new = n + g * g
        if self.lr_power == -0.5:
            p_new, p_old = sqrt_rn(n_new), sqrt_rn(n)
        else:
            p_new = n_new.double().pow(-self.lr_power).to(cd)
            p_old = n.double().pow(-self.lr_power).to(cd)
        sigma = (p_new - p_old) / lr
        z = z + (gs - sigma * w)
        quad = p_new / lr + two_l2
        w = (z.clamp(-self.l1, self.l1) - z) / quad
        io.write(slots, w, torch.cat([n_new, z], dim=1))
