"""The SparseOptimizer contract: an in-place rule over the touched rows of one table.

A table's rows live in one 2-D tensor ``storage [R, W]``; each row holds its
weight and, beside it, its optimizer state (OneEmbedding's ``size_factor``)::

    storage[r] = | w_0 ... w_{D-1} | state_0 ... state_{S-1} | (unused) |
                   0             D-1 D                   D+S-1  D+S .. W-1

That is the plain layout (weights and state of one dtype).  A store's RowLayout may
instead pack 16-bit weights into float32 columns beside float32 state; callers holding
a store use :meth:`SparseOptimizer.update`, the one update path, which reads both
through the layout's typed views.  :meth:`SparseOptimizer.apply` takes a plain storage.

An optimizer is a frozen, validated config plus two implementations: a native C++
kernel (plain contiguous CPU float32 storage and float32 gradient) and a
plain-PyTorch twin (any device and layout; computed in float32 for 16-bit weights,
else in the weight dtype; weights written back rounded to nearest or, when the layout
asks, stochastically).  Both perform the same sequence of float operations, so they
agree to the last bit in practice.
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from .. import _native
from ..errors import ConfigError, InputError
from .._tensors import row_independent
from ._checks import check_real
from ._row_io import RowIO

__all__ = ["SparseOptimizer"]


@dataclass(frozen=True)
class SparseOptimizer(abc.ABC):
    """Base of every sparse optimizer rule: a frozen config plus an in-place update.

    Args:
        lr: the initial learning rate (the runtime one is passed to :meth:`apply`, so a
            schedule can change it between steps).

    Example::

        >>> import torch
        >>> from hugeembed.optim import Adagrad
        >>> opt = Adagrad(lr=0.1)
        >>> D = 4; storage = torch.zeros(10, D + opt.state_width(D))
        >>> opt.init_state(storage[:, D:])
        >>> opt.apply(storage, torch.tensor([2, 7]), torch.ones(2, D), lr=0.1, step=1)
        >>> storage[2, :D]
        tensor([-0.1000, -0.1000, -0.1000, -0.1000])
    """

    lr: float
    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self._set("lr", check_real(self._owner, "lr", self.lr, ge=0.0))

    # ------------------------------------------------------------------ config
    @property
    def _owner(self) -> str:
        return type(self).__name__

    def _set(self, field: str, value: Any) -> None:
        # Normalises a validated field (int -> float, list -> tuple) on a frozen instance.
        object.__setattr__(self, field, value)

    @property
    def moves_untouched_rows(self) -> bool:
        """Whether a step moves rows it has no gradient for (global Adam), so that rows lag
        until :meth:`catch_up` brings them current; False for every lazy rule."""
        return False

    @abc.abstractmethod
    def state_width(self, dim: int) -> int:
        """S: the number of state columns each row of dimension `dim` needs."""

    @row_independent
    def init_state(self, state: torch.Tensor) -> None:
        """Fills the state ``[n, S]`` of freshly created rows in place (zeros by default)."""
        self._check_state(state)
        state.zero_()

    def _check_state(self, state: torch.Tensor) -> int:
        """Validates a state block and returns the row dimension D it belongs to."""
        if state.dim() != 2:
            raise InputError(f"{self._owner}.init_state: state must be 2-D [n, S], got shape {tuple(state.shape)}")
        width = state.shape[1]
        for dim in self._dims_for_width(width):
            if self.state_width(dim) == width:
                return dim
        raise InputError(f"{self._owner}.init_state: {width} state columns fit no row dimension for this rule")

    def _dims_for_width(self, width: int) -> range:
        return range(1, max(2, width + 1))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data that :meth:`from_dict` turns back into an equal optimizer."""
        out: dict[str, Any] = {"name": self.name}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SparseOptimizer":
        """The optimizer `data` (from :meth:`to_dict`) describes; unknown keys are a ConfigError."""
        from ._registry import RULES  # the registry imports every rule, which import this module

        if not isinstance(data, Mapping) or "name" not in data:
            raise ConfigError(f"optimizer config must be a mapping with a 'name', got {data!r}")
        name = data["name"]
        rule = RULES.get(name) if isinstance(name, str) else None
        if rule is None:
            raise ConfigError(f"optimizer config: unknown name {name!r}; choices: {', '.join(sorted(RULES))}")
        if cls is not SparseOptimizer and rule is not cls:
            raise ConfigError(f"{cls.__name__}.from_dict: config is for {name!r}, not {cls.name!r}")
        fields = {f.name for f in dataclasses.fields(rule)}
        unknown = sorted(set(data) - fields - {"name"})
        if unknown:
            raise ConfigError(f"{rule.__name__}: unknown config keys {unknown}; known: {sorted(fields)}")
        kwargs = {k: v for k, v in data.items() if k != "name"}
        try:
            return rule(**kwargs)
        except TypeError as e:  # a required field is missing
            raise ConfigError(f"{rule.__name__}: {e}") from None

    def check_layout(self, layout) -> None:
        """ConfigError naming the table when this rule cannot keep its state in `layout`
        (called when the table is built; the default: any layout)."""

    # ------------------------------------------------------------------ update
    def update(self, store, slots: torch.Tensor, grad: torch.Tensor, *, lr: float, step: int,
               slots_checked: bool = False, keys: torch.Tensor | None = None,
               seeds: int | torch.Tensor | None = None) -> None:
        """Updates rows `slots` of `store` in place: THE update path of every caller.

        `store` is a RowStore or a table group: anything with a ``layout`` and a ``storage()``.
        Reads the weights and state through the layout's typed views.  A plain layout without
        stochastic rounding (the default float32 table) is exactly :meth:`apply` on
        ``store.storage()``: the native kernel when it can run.  Otherwise the torch twin
        computes in ``layout.compute_dtype`` and writes the weights back rounded to the
        weight dtype (nearest, or stochastically: row i draws from (its table's seed, `step`,
        its key, column), `keys` the rows' keys (default ``store.keys_of(slots)``) and `seeds`
        their tables' seeds (one int or int64 [U]; default ``store.seed``)).

        `slots_checked`: the caller vouches that every slot is in range (the store's own
        slots of this step); the torch twin then skips its range check, a host sync on a GPU.
        """
        lay = store.layout
        storage = store.storage()
        if not lay.packed and not lay.stochastic_rounding:
            self.apply(storage, slots, grad, lr=lr, step=step, slots_checked=slots_checked)
            return
        slots, grad, lr, step = self._check_update(lay.dim, lay.state_width, storage, slots, grad, lr, step)
        if slots.numel() == 0:
            return
        if not slots_checked:
            check_slots_torch(slots, storage.shape[0])
        with torch.no_grad():
            self._apply_torch(RowIO.of_store(store, step, keys, seeds), slots, grad, lr, step)

    def apply(self, storage: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor, *, lr: float, step: int,
              slots_checked: bool = False) -> None:
        """Updates rows `slots` of `storage` (weight and state) in place.

        Args:
            storage: ``[R, W]`` float table, ``W >= D + state_width(D)``.
            slots: int64 ``[U]`` unique row numbers in ``[0, R)``, on storage's device.
            grad: ``[U, D]`` gradient of each touched row (duplicate ids already summed).
            lr: the learning rate of this step (a schedule's current value).
            step: 1-based count of optimizer applications on this table (the global step).
            slots_checked: as for :meth:`update`.

        Uses the native kernel when storage is a contiguous CPU float32 tensor, grad is
        float32 and the kernels are built; otherwise the plain-PyTorch twin.  Slots are
        assumed unique (the dedup stage guarantees it); duplicates are not detected and
        give an unspecified (but memory-safe) result.
        """
        slots, grad, lr, step = self._check_apply(storage, slots, grad, lr, step)
        if slots.numel() == 0:
            return
        if self._native_ok(storage, grad):
            self._apply_native(storage, slots.contiguous(), grad.contiguous(), lr, step)
        else:
            if not slots_checked:
                check_slots_torch(slots, storage.shape[0])
            with torch.no_grad():  # storage may be a Parameter: the update is not part of any graph
                self._apply_torch(RowIO.plain(storage, grad.shape[1], self.state_width(grad.shape[1])), slots,
                                  grad, lr, step)

    def catch_up(self, storage: torch.Tensor, slots: torch.Tensor, step: int, *, lr: float | None = None,
                 dim: int | None = None, keys: torch.Tensor | None = None,
                 seeds: int | torch.Tensor | None = None) -> None:
        """Brings rows `slots` up to date as of `step` (after a snapshot or before an eval).

        Only rules that move untouched rows (global Adam) have anything to do; for
        every other rule an untouched row is already exact, and this only validates.
        The keyword arguments (the skipped steps' lr, the row dimension) matter only
        to global Adam.  `storage` is a plain ``[R, W]`` table or a RowStore (read
        through its layout).
        """
        self._check_catch_up(storage.storage() if is_store(storage) else storage, slots, step)

    @abc.abstractmethod
    def _apply_native(self, storage: torch.Tensor, slots: torch.Tensor, grad: torch.Tensor, lr: float,
                      step: int) -> None: ...

    @abc.abstractmethod
    def _apply_torch(self, io: "RowIO", slots: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
        """The twin: reads rows `slots` with ``io.read``, writes them with ``io.write``."""

    @staticmethod
    def _native_ok(storage: torch.Tensor, grad: torch.Tensor) -> bool:
        return (
            storage.device.type == "cpu"
            and storage.dtype == torch.float32
            and storage.is_contiguous()
            and grad.device.type == "cpu"
            and grad.dtype == torch.float32
            and _native.available()
        )

    def _check_storage(self, storage: torch.Tensor, where: str) -> None:
        if not isinstance(storage, torch.Tensor) or storage.dim() != 2:
            raise InputError(f"{self._owner}.{where}: storage must be a 2-D tensor [R, W], got "
                             f"{getattr(storage, 'shape', type(storage).__name__)}")
        if not storage.dtype.is_floating_point:
            raise InputError(f"{self._owner}.{where}: storage must be a float tensor, got {storage.dtype}")

    def _check_slots_tensor(self, storage: torch.Tensor, slots: torch.Tensor, where: str) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise InputError(f"{self._owner}.{where}: slots must be a 1-D integer tensor, got "
                             f"{getattr(slots, 'shape', type(slots).__name__)}")
        if slots.dtype not in (torch.int64, torch.int32):
            raise InputError(f"{self._owner}.{where}: slots must be int64 (or int32), got {slots.dtype}")
        if slots.device != storage.device:
            raise InputError(f"{self._owner}.{where}: slots are on {slots.device}, storage on {storage.device}")
        return slots.long()

    def _check_step(self, step: Any, where: str) -> int:
        try:
            s = operator.index(step)
        except TypeError:
            raise InputError(f"{self._owner}.{where}: step must be an integer, got {step!r}") from None
        if s < 1:
            raise InputError(f"{self._owner}.{where}: step must be >= 1 (1-based), got {s}")
        return s

    def _check_grad(self, storage, slots, grad, lr, step, where):
        self._check_storage(storage, where)
        slots = self._check_slots_tensor(storage, slots, where)
        if not isinstance(grad, torch.Tensor) or grad.dim() != 2 or grad.shape[0] != slots.shape[0]:
            raise InputError(f"{self._owner}.{where}: grad must be [U, D] with U = {slots.shape[0]} slots, got "
                             f"{getattr(grad, 'shape', type(grad).__name__)}")
        if not grad.dtype.is_floating_point or grad.device != storage.device:
            raise InputError(f"{self._owner}.{where}: grad must be a float tensor on {storage.device}, got "
                             f"{grad.dtype} on {grad.device}")
        lr = check_real(self._owner, "lr (runtime)", lr, ge=0.0)
        return slots, lr, self._check_step(step, where)

    def _check_apply(self, storage, slots, grad, lr, step):
        slots, lr, step = self._check_grad(storage, slots, grad, lr, step, "apply")
        dim = grad.shape[1]
        need = dim + self.state_width(dim)
        if dim < 1 or storage.shape[1] < need:
            raise InputError(f"{self._owner}.apply: rows of dimension {dim} need {need} columns "
                             f"(D + state {self.state_width(dim)}), storage has {storage.shape[1]}")
        return slots, grad, lr, step

    def _check_update(self, dim, state_width, storage, slots, grad, lr, step):
        slots, lr, step = self._check_grad(storage, slots, grad, lr, step, "update")
        if grad.shape[1] != dim or self.state_width(dim) != state_width:
            raise InputError(f"{self._owner}.update: the table's rows have dimension {dim} and {state_width} state "
                             f"values; got a gradient of dimension {grad.shape[1]} for a rule needing "
                             f"{self.state_width(grad.shape[1])} state values")
        return slots, grad, lr, step

    def _check_catch_up(self, storage, slots, step) -> tuple[torch.Tensor, int]:
        self._check_storage(storage, "catch_up")
        slots = self._check_slots_tensor(storage, slots, "catch_up")
        check_slots_torch(slots, storage.shape[0])
        return slots, self._check_step(step, "catch_up")


def is_store(x: Any) -> bool:
    """A RowStore rather than a raw storage tensor (a tensor has a ``layout`` too: torch.strided)."""
    return not isinstance(x, torch.Tensor) and hasattr(x, "layout") and hasattr(x, "storage")


def check_slots_torch(slots: torch.Tensor, rows: int) -> None:
    """IndexError naming the first slot outside ``[0, rows)`` (the native kernels check the same)."""
    if slots.numel() == 0:
        return
    bad = (slots < 0) | (slots >= rows)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise IndexError(f"slot {int(slots[pos])} at position {pos} is out of range for a table of {rows} rows")
