"""Choosing eviction victims (shared by every backend of HashStore).

Order of removal, from the contract:
  1. ttl: rows (and pending keys) with ``step - last_step > ttl``;
  2. min_norm: rows whose weight L2 norm is below it (DeepRec's L2-weight eviction: a
     row trained towards zero carries little and is cheap to recreate);
  3. max_rows: while more than `max_rows` rows remain, the least valuable
     unprotected row goes: "lfu" = ascending (count, last_step, key),
     "lru" = ascending (last_step, count, key);
  4. pending_excess: that many pending (not admitted) keys go in all, fewest hits first
     (ascending (count, last_step, key)), the ttl's victims counted.
Protected slots (the current batch, pinned in-flight batches) never go.  The choice is
made with a linear time k-smallest selection (_common.lowest_k), not a sort of the table.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ._common import check_step, lowest_k, protect_mask

__all__ = ["select_victims", "check_evict_args"]


def check_evict_args(name: str, step, ttl, max_rows, policy, min_norm=None) -> int:
    step = check_step(name, step)
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0):
        raise ConfigError(f"table '{name}': ttl must be an int >= 0 or None, got {ttl!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
        raise ConfigError(f"table '{name}': max_rows must be an int >= 0 or None, got {max_rows!r}")
    if policy not in ("lfu", "lru"):
        raise ConfigError(f"table '{name}': eviction policy must be 'lfu' or 'lru', got {policy!r}")
    if min_norm is not None and (isinstance(min_norm, bool) or not isinstance(min_norm, (int, float))
                                 or not math.isfinite(min_norm) or min_norm <= 0):
        raise ConfigError(f"table '{name}': min_norm must be a positive finite number or None, got {min_norm!r}")
    return step


def select_victims(name: str, step: int, ttl: int | None, max_rows: int | None, policy: str,
                   protect: torch.Tensor | None, num_slots: int, row_keys: torch.Tensor, row_slots: torch.Tensor,
                   row_counts: torch.Tensor, row_lasts: torch.Tensor, pend_keys: torch.Tensor,
                   pend_counts: torch.Tensor, pend_lasts: torch.Tensor, *, row_norms: torch.Tensor | None = None,
                   min_norm: float | None = None, pending_excess: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool masks (rows to remove, pending keys to remove) over the given rows / pending keys.

    `row_norms` (the weight L2 norm of each row) is needed only with `min_norm`.
    """
    step = check_evict_args(name, step, ttl, max_rows, policy, min_norm)
    dev = row_keys.device
    prot = protect_mask(name, protect, num_slots, dev)[row_slots]
    gone = torch.zeros(row_keys.numel(), dtype=torch.bool, device=dev)
    pgone = torch.zeros(pend_lasts.numel(), dtype=torch.bool, device=dev)
    if ttl is not None:
        gone |= ((step - row_lasts) > ttl) & ~prot
        pgone |= (step - pend_lasts) > ttl
    if min_norm is not None:
        gone |= (row_norms < min_norm) & ~prot
    if max_rows is not None:
        excess = int((~gone).sum()) - max_rows
        if excess > 0:
            cand = (~gone & ~prot).nonzero().squeeze(1)
            cols = [row_counts, row_lasts] if policy == "lfu" else [row_lasts, row_counts]
            cols = [c[cand] for c in cols] + [row_keys[cand]]
            gone[cand[lowest_k(cols, min(excess, cand.numel()))]] = True
    more = pending_excess - int(pgone.sum())
    if more > 0:
        cand = (~pgone).nonzero().squeeze(1)
        cols = [pend_counts[cand], pend_lasts[cand], pend_keys[cand]]
        pgone[cand[lowest_k(cols, min(more, cand.numel()))]] = True
    return gone, pgone
