"""What a collection does for rare ids: the shared row (TableConfig.shared_row) and the per-row
learning rate by hit count (TableConfig.lr_count_scale).

Both exist because of one measured effect (docs/quality.md): with per-coordinate adaptive
rules (Adagrad, Adam) the first update of a row moves it by about ``lr`` whatever the size of
its gradient, so a row seen once or twice in training is pushed by a single label (mostly 0 at
a CTR of 12%) and predicts too low when its id comes back at eval.  A shared row pools
those ids' gradients (one row learns "a rare id"); a count-scaled lr shrinks the first steps.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..optim import SparseOptimizer

__all__ = ["SHARED_ROW_KEY", "check_count_scalable", "count_lr_scale", "update_scaled", "coalesce"]

# The key of a table's shared row: negative, so no id reaches it (the clean stage drops ids < 0
# of tables with prune_negative, which TableConfig requires with shared_row).
SHARED_ROW_KEY = -1


def check_count_scalable(rule: SparseOptimizer, table: str) -> None:
    """ConfigError naming the table when `rule`'s step is not linear in lr (the scaling
    multiplies the row's weight change by the scale: exact only for such rules)."""
    if rule.name == "ftrl" or rule.moves_untouched_rows:
        raise ConfigError(f"table {table!r}: lr_count_scale scales each row's step, which needs a rule whose step is "
                          f"linear in lr; {rule.name!r}"
                          + (" (global mode, which moves untouched rows)" if rule.moves_untouched_rows else "")
                          + " is not: use sgd, momentum, adagrad, rowwise_adagrad or lazy adam")


def count_lr_scale(counts: torch.Tensor, scale: int | torch.Tensor) -> torch.Tensor:
    """float64 ``min(1, n / scale)`` of hit counts n (a row's lr is ``lr * this``); `scale` one int or
    one per count."""
    by = scale.to(torch.float64) if isinstance(scale, torch.Tensor) else float(scale)
    return (counts.to(torch.float64) / by).clamp(max=1.0)


def coalesce(slots: torch.Tensor, grad: torch.Tensor, *per_row: torch.Tensor | None):
    """Unique slots with their gradients summed (several ids read the shared row): what the
    optimizer rules expect.  Each of `per_row` (one value per given slot, or None) is taken per
    unique slot: ids sharing a slot share its scale, its key and its table's seed."""
    uniq, inv = torch.unique(slots, return_inverse=True)
    if uniq.numel() == slots.numel():
        return (slots, grad, *per_row)
    summed = torch.zeros(uniq.numel(), grad.shape[1], dtype=grad.dtype, device=grad.device).index_add_(0, inv, grad)
    taken = [None if x is None else torch.empty(uniq.numel(), dtype=x.dtype, device=x.device).scatter_(0, inv, x)
             for x in per_row]
    return (uniq, summed, *taken)


def update_scaled(rule: SparseOptimizer, store, slots: torch.Tensor, grad: torch.Tensor, *, lr: float, step: int,
                  scale: torch.Tensor) -> None:
    """``rule.update`` with row i's weight change multiplied by ``scale[i]``: for a rule whose
    step is linear in lr (check_count_scalable), the step of lr ``lr * scale[i]``; the state
    (Adagrad's sum, Adam's moments) advances as for any step, as it does not depend on lr.
    Plain float layouts only (TableConfig checks it): the weights are the first D columns."""
    dim = store.layout.dim
    before = store.storage().index_select(0, slots)[:, :dim].clone()
    rule.update(store, slots, grad, lr=lr, step=step, slots_checked=True)  # the store's own slots
    storage = store.storage()
    after = storage.index_select(0, slots)[:, :dim]
    s = scale.to(after.dtype).unsqueeze(1)
    storage[slots, :dim] = before + s * (after - before)
