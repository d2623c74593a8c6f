"""Admission and pending-key rules shared by the dynamic stores (HashStore and its DictStore oracle).

Two admission filters, as DeepRec's EmbeddingVariable offers:

* counter filter (``admit_min_count = k``): a key gets a row once seen k times; until then
  it waits as a *pending* key (count + last step, no row).  Pending keys are bounded by
  ``max_pending``: past it, the least valuable ones (fewest hits, then oldest, then
  smallest key: the LFU order of rows) are forgotten, so a stream of ids seen once cannot
  grow the index without limit.  A forgotten key starts counting again from zero.
* probability filter (``admit_probability = p``): each sighting of a key without a row
  admits it with probability p, decided by a counter-based hash of (seed, key, step) so
  a run is reproducible.  A key not admitted leaves no trace (no pending entry).
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ._init import _base, _unit

__all__ = ["check_admission", "admission_draw", "pending_victims", "DEFAULT_MAX_PENDING", "PENDING_SLACK"]

# ~40 MiB of index at the store's 0.6 load factor (24 B per record): large enough that an
# id seen twice within the last million new ids is admitted, small enough to never matter
# next to the rows.  A table option overrides it.
DEFAULT_MAX_PENDING = 1 << 20
# Past the bound, forget down to (1 - 1/PENDING_SLACK) of it, so the choice runs once per
# max_pending/64 new keys rather than on every batch.
PENDING_SLACK = 64
# A stream of its own for the draw: admission never correlates with the initializer's values.
_ADMIT_SALT = 0x5A17_AD31_7C0F_FEE5


def check_admission(name: str, admit_min_count, admit_probability, max_pending) -> None:
    """ConfigError naming the table for a bad or contradictory admission setting."""
    if isinstance(admit_min_count, bool) or not isinstance(admit_min_count, int) or admit_min_count < 1:
        raise ConfigError(f"table '{name}': admit_min_count must be an int >= 1, got {admit_min_count!r}")
    if admit_probability is not None:
        if isinstance(admit_probability, bool) or not isinstance(admit_probability, (int, float)) \
                or not math.isfinite(admit_probability) or not 0.0 < admit_probability <= 1.0:
            raise ConfigError(f"table '{name}': admit_probability must be a number in (0, 1] or None, "
                              f"got {admit_probability!r}")
        if admit_min_count != 1:
            raise ConfigError(f"table '{name}': admit_probability and admit_min_count={admit_min_count} are two "
                              f"admission filters; choose one")
    if max_pending is not None and (isinstance(max_pending, bool) or not isinstance(max_pending, int)
                                    or max_pending < 1):
        raise ConfigError(f"table '{name}': max_pending must be an int >= 1 or None, got {max_pending!r}")


def admission_draw(keys: torch.Tensor, step: int, seed: int, p: float) -> torch.Tensor:
    """Bool [n]: whether each sighting of `keys` at `step` admits the key (probability p each)."""
    u = _unit(_base(keys, seed ^ _ADMIT_SALT)[:, None], torch.tensor([step], dtype=torch.int64,
                                                                     device=keys.device))
    return u[:, 0] < p


def pending_victims(num_pending: int, max_pending: int | None) -> int:
    """How many pending keys to forget now (0 while within the bound)."""
    if max_pending is None or num_pending <= max_pending:
        return 0
    return num_pending - (max_pending - max_pending // PENDING_SLACK)
