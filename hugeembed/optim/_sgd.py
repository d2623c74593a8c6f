"""Plain and momentum SGD over the touched rows of a table (torch.optim.SGD semantics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from . import _native_ops
from ._base import SparseOptimizer
from ._checks import check_bool, check_real

__all__ = ["SGD", "MomentumSGD"]


@dataclass(frozen=True)
class SGD(SparseOptimizer):
    """Stochastic gradient descent, ``w -= lr * (g + weight_decay * w)``; no state.

    Equals ``torch.optim.SGD(lr, weight_decay=...)`` on the rows that have a
    gradient; untouched rows do not move (weight decay is applied lazily).

    Args:
        lr: learning rate, >= 0.
        weight_decay: L2 penalty added to the gradient of touched rows, >= 0.

    Example::

        >>> import torch
        >>> opt = SGD(lr=0.5)
        >>> table = torch.ones(3, 2)                     # D = 2, no state columns
        >>> opt.apply(table, torch.tensor([1]), torch.tensor([[1.0, -2.0]]), lr=0.5, step=1)
        >>> table[1]
        tensor([0.5000, 2.0000])
    """

    weight_decay: float = 0.0
    name: ClassVar[str] = "sgd"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("weight_decay", check_real(self._owner, "weight_decay", self.weight_decay, ge=0.0))

    def state_width(self, dim: int) -> int:
        return 0

    def _dims_for_width(self, width: int) -> range:
        return range(1, 2)

    def _apply_native(self, storage, slots, grad, lr, step):
        _native_ops.run("he_optim_sgd", storage, slots, grad, grad.shape[1], reals=(lr, self.weight_decay))

    def _apply_torch(self, io, slots, grad, lr, step):
        w, _ = io.read(slots)
        g = grad.to(w.dtype)
        if self.weight_decay != 0.0:
            g = g + w * self.weight_decay
        io.write(slots, w - g * lr)


@dataclass(frozen=True)
class MomentumSGD(SparseOptimizer):
    """SGD with (Nesterov) momentum, dampening 0, applied lazily; state: ``buf [D]``.

    Per touched row, as ``torch.optim.SGD(lr, momentum, nesterov=..., weight_decay=...)``::

        g'  = g + weight_decay * w
        buf = momentum * buf + g'                  (buf starts at 0, so step 1 gives buf = g')
        w  -= lr * (g' + momentum * buf  if nesterov  else  buf)

    Only touched rows' buffers advance (TF's sparse_apply_momentum, HugeCTR): the
    oracle is torch.optim.SGD with one parameter per row, stepped only when that
    row has a gradient.

    Args:
        lr: learning rate, >= 0.
        momentum: in [0, 1).
        nesterov: Nesterov momentum (needs momentum > 0).
        weight_decay: L2 penalty added to the gradient of touched rows, >= 0.
    """

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    name: ClassVar[str] = "momentum"

    def __post_init__(self) -> None:
        super().__post_init__()
        o = self._owner
        self._set("momentum", check_real(o, "momentum", self.momentum, ge=0.0, lt=1.0))
        self._set("nesterov", check_bool(o, "nesterov", self.nesterov))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, ge=0.0))
        if self.nesterov and self.momentum == 0.0:
            raise ConfigError(f"{o}: nesterov=True needs momentum > 0, got momentum={self.momentum}")

    def state_width(self, dim: int) -> int:
        return dim

    def _apply_native(self, storage, slots, grad, lr, step):
        _native_ops.run("he_optim_momentum", storage, slots, grad, grad.shape[1], ints=(int(self.nesterov),),
                        reals=(lr, self.momentum, self.weight_decay))

    def _apply_torch(self, io, slots, grad, lr, step):
        w, buf = io.read(slots)
        g = grad.to(w.dtype)
        if self.weight_decay != 0.0:
            g = g + w * self.weight_decay
        buf = buf * self.momentum + g
        u = g + buf * self.momentum if self.nesterov else buf
        io.write(slots, w - u * lr, buf)

