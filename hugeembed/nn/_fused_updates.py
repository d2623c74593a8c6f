"""A training step's update on the triton kernels: per update unit, its entries deduplicated on the device
(the triton prepare's runs, or hugeembed/_triton/dedup.py after another prepare) and its rows' gradients
summed and its rule applied in one kernel (hugeembed/_triton/segment_optim.py), with no gradient rows made and no host read.

A unit takes it when its rule is one the kernel has (optim/_kernel_params.supported_rule), its tables
train at one lr, have no lr_count_scale and no shared row, and its group's rows are float32 / float16 /
bfloat16 weights with float32 state (or state of the weights' dtype).  When a touched unit does not, the
whole step takes the torch path (RowUpdates.spans / many): one path per step.
"""

from __future__ import annotations

import weakref

import torch

from .._device import host_to_device
from .._hashing import _MASK64, _ROUNDING_SALT, mix64_int
from ..optim._kernel_params import kernel_params, supported_rule

__all__ = ["unit_fuses", "fused_update"]

_WEIGHTS = (torch.float32, torch.float16, torch.bfloat16)
# per unit and device: (lookup position -> the unit's table index or -1, the tables' seeds, their bases
# (0: the entries' slots are rows of the group already) and row bound (none: slots are in range)): made once
_CONSTANTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def unit_fuses(unit, layout, lrs: set) -> bool:
    """Whether `unit` (its group's `layout`, its tables' lrs this step) takes the fused kernel."""
    return (supported_rule(unit.rule) and not unit.scaled and not unit.coalesces and len(lrs) == 1
            and layout.dtype in _WEIGHTS and layout.state_dtype in (torch.float32, layout.dtype))


def _constants(unit, positions: int, device: torch.device):
    per = _CONSTANTS.setdefault(unit, {})
    got = per.get(device)
    if got is None:
        local = [-1] * positions
        for i, p in enumerate(unit.positions):
            local[p] = i
        n = len(unit.tables)
        got = per[device] = (host_to_device(local, torch.int64, device),
                             host_to_device(list(unit.seeds), torch.int64, device),
                             host_to_device([0] * n, torch.int64, device),
                             host_to_device([2**62] * n, torch.int64, device))
    return got


def fused_update(unit, group, grads, positions: int, lr: float, step: int) -> None:
    """`unit`'s rule on the rows its tables' entries of this step read (`grads`: functional's FusedGrads;
    `positions`: the lookup's tables)."""
    from .._triton.dedup import dedup
    from .._triton.segment_optim import segment_update

    if grads.count == 0:
        return
    dev = grads.entry_slots.device
    local, seeds, base, bound = _constants(unit, positions, dev)
    storage = group.storage()
    if grads.runs is not None:  # the triton prepare's runs: rows of other units' tables left alone
        dd, unit_tables = grads.runs, local
    else:  # the entries' slots are rows of the group already; entries of other units' tables: table -1
        dd, unit_tables = dedup(grads.entry_slots, local[grads.entry_tables], base, bound, storage.shape[0]), None
    lay = group.layout
    segment_update(dd, grads.of_dim(unit.dim), lay.weights(storage), lay.state(storage),
                   kernel_params(unit.rule, lr, step, lay.dtype), step=step,
                   keys=grads.entry_keys if unit.rounds else None, table_seed=seeds if unit.rounds else None,
                   rounding_mix=mix64_int((step ^ _ROUNDING_SALT) & _MASK64), unit_tables=unit_tables)
