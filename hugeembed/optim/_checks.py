"""Checks of an optimizer's config fields: each returns the value or raises a ConfigError
naming the optimizer and the field."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError


def check_real(owner: str, field: str, value: Any, *, ge: float | None = None, gt: float | None = None,
               lt: float | None = None, le: float | None = None) -> float:
    """`value` as a finite float within the given bounds, else a ConfigError naming owner and field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{owner}: {field} must be a real number, got {value!r}")
    v = float(value)
    bad = not math.isfinite(v)
    bounds = []
    if ge is not None:
        bad |= not v >= ge
        bounds.append(f">= {ge}")
    if gt is not None:
        bad |= not v > gt
        bounds.append(f"> {gt}")
    if lt is not None:
        bad |= not v < lt
        bounds.append(f"< {lt}")
    if le is not None:
        bad |= not v <= le
        bounds.append(f"<= {le}")
    if bad:
        rule = " and ".join(["finite", *bounds])
        raise ConfigError(f"{owner}: {field} must be {rule}, got {value!r}")
    return v


def check_bool(owner: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}: {field} must be True or False, got {value!r}")
    return value


def check_choice(owner: str, field: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{owner}: {field} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value

