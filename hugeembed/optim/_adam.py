"""Adam over the touched rows of a table: lazy (sparse) or global (dense-equivalent) updates.

State layout per row (after the D weight columns)::

    | m_0 .. m_{D-1} | v_0 .. v_{D-1} | counter |      counter only for per_row / global
      D               2D               3D

The counter is an integer stored as the bit pattern of an int32 (float32 state)
or int64 (float64 state) in one column, so it stays exact past 2^24 steps: a table
whose state is 16-bit cannot hold it and is refused when built (16-bit tables keep
float32 state by default, see hugeembed.store.RowLayout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from ..errors import ConfigError, InputError
from . import _native_ops
from ._base import SparseOptimizer, is_store
from ._checks import check_bool, check_choice, check_real
from ._kernel_floats import rdiv, sqrt_rn
from ._row_io import RowIO, int_view_dtype
from ._adam_catchup import catch_up_rows, negligible_fraction

__all__ = ["Adam"]

_MODES = ("lazy", "global")
_BIAS = ("global_step", "per_row")
_EPS = ("torch", "tf")
_MODE_CODE = {("lazy", "global_step"): 0, ("lazy", "per_row"): 1, ("global", "global_step"): 2}


@dataclass(frozen=True)
class Adam(SparseOptimizer):
    """Adam for embedding rows, lazy or global; state ``[m (D) | v (D) | counter?]``.

    One step of a touched row at bias-correction step t (bc1 = 1 - b1^t, bc2 = 1 - b2^t)::

        w  = w * (1 - lr * weight_decay)           if decoupled_weight_decay (AdamW)
        g' = g + weight_decay * w                  otherwise (L2, torch.optim.Adam)
        m  = b1 * m + (1 - b1) * g'
        v  = b2 * v + (1 - b2) * g'^2
        epsilon="torch": w -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
        epsilon="tf":    w -= (lr * sqrt(bc2) / bc1) * m / (sqrt(v) + eps)   (TF/Keras/HugeCTR,
                                                                           and torch.optim.SparseAdam)

    Modes:
        * ``mode="lazy", bias_correction="global_step"``: only touched rows' moments
          advance; t = the table's step.  With ``epsilon="tf"`` this is exactly
          torch.optim.SparseAdam on the whole table.  No counter.
        * ``mode="lazy", bias_correction="per_row"``: t = the row's own update count
          (kept in the counter column): torch.optim.Adam on one parameter per row,
          stepped only when that row has a gradient.
        * ``mode="global"``: dense torch.optim.Adam on the whole table where untouched
          rows get a zero gradient (HugeCTR's "Global" update).  The counter holds the
          step a row was last brought up to date; when the row is next touched at step
          t, the skipped steps are first replayed with a zero gradient (see
          :mod:`hugeembed.optim._adam_catchup` for the exact loop and its early stop),
          then step t runs.  Rows never touched again are brought up to date only by
          :meth:`catch_up`.  The replay uses the lr of the step that triggers it: exact
          for a constant lr over the gap.  L2 weight decay is refused (it gives every
          untouched row a non-zero gradient each step); decoupled decay is supported.

    Args:
        lr: learning rate, >= 0.
        betas: (b1, b2), each in [0, 1).
        eps: > 0.
        weight_decay: >= 0; L2 (added to the gradient) or decoupled (AdamW).
        decoupled_weight_decay: use AdamW's ``w *= 1 - lr * weight_decay``.
        mode: "lazy" or "global".
        bias_correction: "global_step" or "per_row" (lazy mode only).
        epsilon: "torch" or "tf" placement of eps.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False
    mode: str = "lazy"
    bias_correction: str = "global_step"
    epsilon: str = "torch"
    name: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        super().__post_init__()
        o = self._owner
        betas: Any = self.betas
        if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise ConfigError(f"{o}: betas must be a pair (beta1, beta2), got {betas!r}")
        self._set("betas", (check_real(o, "betas[0]", betas[0], ge=0.0, lt=1.0),
                            check_real(o, "betas[1]", betas[1], ge=0.0, lt=1.0)))
        self._set("eps", check_real(o, "eps", self.eps, gt=0.0))
        self._set("weight_decay", check_real(o, "weight_decay", self.weight_decay, ge=0.0))
        self._set("decoupled_weight_decay", check_bool(o, "decoupled_weight_decay", self.decoupled_weight_decay))
        check_choice(o, "mode", self.mode, _MODES)
        check_choice(o, "bias_correction", self.bias_correction, _BIAS)
        check_choice(o, "epsilon", self.epsilon, _EPS)
        if self.mode == "global" and self.bias_correction != "global_step":
            raise ConfigError(f"{o}: bias_correction={self.bias_correction!r} needs mode='lazy'; "
                              f"mode='global' always corrects with the global step")
        if self.mode == "global" and self.weight_decay != 0.0 and not self.decoupled_weight_decay:
            raise ConfigError(f"{o}: weight_decay={self.weight_decay} with mode='global' needs "
                              f"decoupled_weight_decay=True: L2 decay gives every untouched row a non-zero "
                              f"gradient each step, which cannot be caught up in O(touched rows)")

    # ------------------------------------------------------------------ layout
    @property
    def _has_counter(self) -> bool:
        return self.mode == "global" or self.bias_correction == "per_row"

    def state_width(self, dim: int) -> int:
        return 2 * dim + (1 if self._has_counter else 0)

    def _mode_code(self) -> int:
        return _MODE_CODE[(self.mode, self.bias_correction)]

    def check_layout(self, layout) -> None:
        if self._has_counter and layout.state_dtype not in (torch.float32, torch.float64):
            raise ConfigError(
                f"table {layout.table!r}: {self._owner}(mode={self.mode!r}, bias_correction={self.bias_correction!r}) "
                f"keeps an integer step counter, which needs float32 or float64 state; the table's state_dtype "
                f"is {layout.state_dtype} (leave state_dtype unset: 16-bit tables default to float32 state)")

    def _check_counter_range(self, state: torch.Tensor, step: int) -> None:
        if not self._has_counter:
            return
        limit = torch.iinfo(int_view_dtype(state, self._owner)).max
        if step > limit:
            raise InputError(f"{self._owner}: step {step} exceeds the {limit} a counter in {state.dtype} "
                             f"state can hold")

    # ------------------------------------------------------------------ update
    def _apply_native(self, storage, slots, grad, lr, step):
        self._check_counter_range(storage, step)
        self._run_native(storage, slots, grad, grad.shape[1], lr, step)

    def _run_native(self, storage, slots, grad, dim, lr, step):
        b1, b2 = self.betas
        _native_ops.run("he_optim_adam", storage, slots, grad, dim,
                        ints=(int(self.decoupled_weight_decay), int(self.epsilon == "tf"), self._mode_code(),
                              int(grad is not None), step),
                        reals=(lr, b1, b2, self.eps, self.weight_decay, negligible_fraction(storage.dtype)))

    def _apply_torch(self, io, slots, grad, lr, step):
        self._check_counter_range(io.state, step)
        self._run_torch(io, slots, grad, grad.shape[1], lr, step)

    @property
    def moves_untouched_rows(self) -> bool:
        return self.mode == "global"

    def catch_up(self, storage: torch.Tensor, slots: torch.Tensor, step: int, *, lr: float | None = None,
                 dim: int | None = None, keys: torch.Tensor | None = None,
                 seeds: int | torch.Tensor | None = None) -> None:
        """Brings rows `slots` of a global-mode table up to date as of `step` (no-op when lazy).

        After it, those rows equal dense torch.optim.Adam after `step` steps in which
        they had a zero gradient since their last touch.  Call it before a snapshot
        or an eval that should see the dense result.

        Args:
            storage: a plain ``[R, W]`` table as in :meth:`apply`, or a RowStore (any layout;
                a 16-bit table's weights are rounded back as in :meth:`update`).
            slots: as in :meth:`apply`.
            step: the last step applied to the table.
            lr: the learning rate the skipped steps used (default: the config's lr).
            dim: D; needed only when storage has more than D + state_width(D) columns.
            keys, seeds: as for :meth:`update` (the draws of stochastic rounding).
        """
        if is_store(storage):  # its layout says where D and the state are
            store = storage
            lay = store.layout
            if dim is not None and dim != lay.dim:
                raise InputError(f"{self._owner}.catch_up: dim={dim}, the store's rows have dimension {lay.dim}")
            dim, storage = lay.dim, store.storage()
            if lay.packed or lay.stochastic_rounding:
                slots, step = self._check_catch_up(storage, slots, step)
                if self.mode != "global" or slots.numel() == 0:
                    return
                lr = self.lr if lr is None else check_real(self._owner, "lr (runtime)", lr, ge=0.0)
                io = RowIO.of_store(store, step, keys, seeds)
                self._check_counter_range(io.state, step)
                with torch.no_grad():
                    self._run_torch(io, slots, None, dim, lr, step)
                return
        slots, step = self._check_catch_up(storage, slots, step)
        if self.mode != "global" or slots.numel() == 0:
            return
        lr = self.lr if lr is None else check_real(self._owner, "lr (runtime)", lr, ge=0.0)
        width = storage.shape[1]
        if dim is None:
            if (width - 1) % 3:
                raise InputError(f"{self._owner}.catch_up: cannot infer D from {width} columns; pass dim=")
            dim = (width - 1) // 3
        if dim < 1 or width < dim + self.state_width(dim):
            raise InputError(f"{self._owner}.catch_up: dim {dim} needs {dim + self.state_width(dim)} columns, "
                             f"storage has {width}")
        self._check_counter_range(storage, step)
        if self._native_ok(storage, storage):
            self._run_native(storage, slots.contiguous(), None, dim, lr, step)
        else:
            with torch.no_grad():
                self._run_torch(RowIO.plain(storage, dim, self.state_width(dim)), slots, None, dim, lr, step)

    def _scalars(self, lr: float, p1, p2):
        """(step_scale, dscale) from b1^t, b2^t: Python floats, or float64 tensors per row."""
        sqrt = torch.sqrt if isinstance(p2, torch.Tensor) else math.sqrt
        bc1, bc2 = 1.0 - p1, 1.0 - p2
        if self.epsilon == "tf":
            return lr * sqrt(bc2) / bc1, 1.0
        return (rdiv(lr, bc1) if isinstance(bc1, torch.Tensor) else lr / bc1), sqrt(bc2)

    def _run_torch(self, io, slots, grad, dim, lr, step):
        D = dim
        w, state = io.read(slots)
        cd = w.dtype
        m, v = state[:, :D], state[:, D:2 * D]
        b1, b2 = self.betas
        mode = self._mode_code()
        counter = None
        if self._has_counter:  # check_layout made the state float32/64 = cd: read raw bits
            counter = io.state[slots, 2 * D].view(int_view_dtype(io.state, self._owner)).long()
        if mode == 2:
            end = step - 1 if grad is not None else step
            gap = end - counter
            need = (gap > 0).nonzero().squeeze(1)
            if need.numel():
                w, m, v = w.clone(), m.clone(), v.clone()
                w[need], m[need], v[need] = catch_up_rows(
                    w[need], m[need], v[need], counter[need], gap[need], lr=lr, betas=self.betas, eps=self.eps,
                    weight_decay=self.weight_decay if self.decoupled_weight_decay else 0.0,
                    epsilon=self.epsilon, tol=negligible_fraction(io.weight_dtype))
            counter = torch.where(gap > 0, step, counter) if grad is None else torch.full_like(counter, step)
            if grad is None:
                self._store(io, slots, w, m, v, counter)
                return
            step_scale, dscale = self._scalars(lr, b1**step, b2**step)
        elif mode == 1:
            counter = counter + 1
            t = counter.double()
            step_scale, dscale = self._scalars(lr, torch.pow(b1, t), torch.pow(b2, t))
            step_scale = step_scale.to(cd)[:, None]
            if isinstance(dscale, torch.Tensor):
                dscale = dscale.to(cd)[:, None]
        else:
            step_scale, dscale = self._scalars(lr, b1**step, b2**step)
        wd = self.weight_decay
        if wd != 0.0 and self.decoupled_weight_decay:
            w = w * (1.0 - lr * wd)
        g = grad.to(cd)
        if wd != 0.0 and not self.decoupled_weight_decay:
            g = g + w * wd
        m = m * b1 + g * (1.0 - b1)
        v = v * b2 + (g * g) * (1.0 - b2)
        w = w - (m / (sqrt_rn(v) / dscale + self.eps)) * step_scale
        self._store(io, slots, w, m, v, counter)

    def _store(self, io, slots, w, m, v, counter) -> None:
        parts = [m, v]
        if counter is not None:
            idt = int_view_dtype(io.state, self._owner)
            parts.append(counter.to(idt).view(io.state.dtype).to(w.dtype)[:, None])
        io.write(slots, w, torch.cat(parts, dim=1))
