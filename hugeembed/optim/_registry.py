"""Optimizers by name, for the command line and for snapshots (SparseOptimizer.from_dict)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError
from ._adagrad import Adagrad, RowWiseAdagrad
from ._adam import Adam
from ._base import SparseOptimizer
from ._ftrl import FTRL
from ._sgd import SGD, MomentumSGD

__all__ = ["make_optimizer", "RULES", "NAMES"]

# The rule class of each SparseOptimizer.name (what to_dict() writes).
RULES: dict[str, type[SparseOptimizer]] = {
    rule.name: rule for rule in (SGD, MomentumSGD, Adagrad, RowWiseAdagrad, Adam, FTRL)
}

# Every name make_optimizer accepts: (rule, settings implied by the name).
NAMES: dict[str, tuple[type[SparseOptimizer], dict[str, Any]]] = {
    "sgd": (SGD, {}),
    "momentum": (MomentumSGD, {}),
    "nesterov": (MomentumSGD, {"nesterov": True}),
    "adagrad": (Adagrad, {}),
    "rowwise_adagrad": (RowWiseAdagrad, {}),
    "adam": (Adam, {}),
    "lazy_adam": (Adam, {"mode": "lazy"}),
    # torch.optim.Adam per row: bias correction by the row's own update count, so a new row's
    # first step is lr, not the ~3 lr of a late-born row under global-step correction (docs/quality.md)
    "adam_per_row": (Adam, {"mode": "lazy", "bias_correction": "per_row"}),
    "global_adam": (Adam, {"mode": "global"}),
    "ftrl": (FTRL, {}),
}


def make_optimizer(name: str, /, **kwargs: Any) -> SparseOptimizer:
    """The optimizer called `name`, configured by `kwargs` (the rule's fields).

    Example::

        >>> make_optimizer("global_adam", lr=0.01)
        Adam(lr=0.01, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0, decoupled_weight_decay=False, mode='global', bias_correction='global_step', epsilon='torch')
    """
    entry = NAMES.get(name)
    if entry is None:
        raise ConfigError(f"unknown optimizer {name!r}; choices: {', '.join(NAMES)}")
    rule, implied = entry
    for key, value in implied.items():
        if key in kwargs and kwargs[key] != value:
            raise ConfigError(f"optimizer {name!r} implies {key}={value!r}, got {key}={kwargs[key]!r}")
    fields = {f.name for f in dataclasses.fields(rule)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ConfigError(f"optimizer {name!r} ({rule.__name__}) has no option {', '.join(unknown)}; "
                          f"options: {', '.join(sorted(fields))}")
    try:
        return rule(**{**kwargs, **implied})
    except TypeError as e:  # a required option (lr) is missing
        raise ConfigError(f"optimizer {name!r} ({rule.__name__}): {e}") from None
