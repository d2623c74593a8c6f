"""EmbeddingOptimizer: the learning rates of a collection's in-backward updates, as a torch Optimizer.

The sparse updates run inside backward (no separate step), but users drive learning
rates with ``torch.optim.lr_scheduler`` and save them in checkpoints.  This class is
a real ``torch.optim.Optimizer`` with one param group per trainable table (holding a
0-element placeholder, never a table), whose ``"lr"`` the backward reads each step.
``step()`` and ``zero_grad()`` do nothing: the tables were already updated.
"""

from __future__ import annotations

import torch

__all__ = ["EmbeddingOptimizer"]


class EmbeddingOptimizer(torch.optim.Optimizer):
    """Learning rates (and their schedule) of an EmbeddingCollection's sparse optimizers.

    Example::

        sched = torch.optim.lr_scheduler.StepLR(ec.optimizer, step_size=1000, gamma=0.5)
        for batch in data:
            loss(ec(batch)).backward()   # tables updated here with the group's current lr
            ec.optimizer.step()          # no-op, keeps the usual loop (and the scheduler) happy
            sched.step()
    """

    def __init__(self, collection) -> None:
        groups = []
        self.group_of_table: dict[int, int] = {}
        for t, (cfg, rule) in enumerate(zip(collection.tables, collection.rules)):
            if rule is None:
                continue
            self.group_of_table[t] = len(groups)
            groups.append({"params": [torch.zeros(0)], "lr": rule.lr, "table": cfg.name, "rule": rule.name})
        if not groups:  # every table frozen: keep a valid, empty-handed optimizer
            groups.append({"params": [torch.zeros(0)], "lr": 0.0, "table": None, "rule": None})
        super().__init__(groups, defaults={"lr": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing to do: the tables were updated in backward.  Evaluates `closure` if given."""
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: tables never hold gradients."""

    def set_lr(self, lr: float, table: str | None = None) -> None:
        """Sets the learning rate of one table's group, or of every group."""
        hit = False
        for g in self.param_groups:
            if table is None or g["table"] == table:
                g["lr"] = float(lr)
                hit = True
        if not hit:
            raise KeyError(f"no trainable table {table!r}")
