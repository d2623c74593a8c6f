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
Protected slots (the current batch, pinned in-flight batches) never go.

One victim chooser serves every store: ``choose_victims`` takes the k smallest candidates in
the policy's order (``policy_columns``: the same for the dynamic store's max_rows and the
tiered cache's victims) with a linear time selection, not a sort of the table: the native
kernel he_choose_victims (csrc/victims.cpp) on the CPU, _common.lowest_k elsewhere.
"""

from __future__ import annotations

import math

import torch

from .. import _native
from ..errors import ConfigError
from ._common import check_step, lowest_k, protect_mask

__all__ = ["select_victims", "check_evict_args", "choose_victims", "policy_columns", "EVICTION_POLICIES"]

EVICTION_POLICIES = ("lfu", "lru")


def policy_columns(policy: str, counts: torch.Tensor, lasts: torch.Tensor, keys: torch.Tensor) -> list[torch.Tensor]:
    """The order victims go in, smallest first: "lfu" = (count, last use, key), "lru" = (last use,
    count, key).  The key (unique) settles every tie, so the victims are one set."""
    return [counts, lasts, keys] if policy == "lfu" else [lasts, counts, keys]


def choose_victims(cols: list[torch.Tensor], k: int, candidates: torch.Tensor | None = None,
                   exclude: torch.Tensor | None = None, min_take: int = 0) -> tuple[int, torch.Tensor]:
    """Among indices s with ``candidates[s] >= 0`` (None: all) not in `exclude` (entries < 0
    ignored), the ``min(count, k)`` smallest in lexicographic order of `cols` (int32 / int64, the
    last unique among candidates), ascending.  Returns (count of candidates, victims); victims is
    empty when the count is below `min_take`.  Raises _native.KernelError (BAD_VALUE) for an
    `exclude` entry past the columns."""
    n = cols[0].numel()
    dev = cols[0].device
    exclude = torch.zeros(0, dtype=torch.int64, device=dev) if exclude is None else \
        exclude.reshape(-1).to(torch.int64)
    if candidates is None:
        candidates = torch.zeros(n, dtype=torch.int64, device=dev)
    if dev.type == "cpu" and _native.available() and len(cols) <= 3 and \
            all(c.dtype in (torch.int32, torch.int64) for c in cols):
        out = torch.empty(max(0, min(int(k), n)), dtype=torch.int64)
        cols = [c.contiguous() for c in cols] + [None] * (3 - len(cols))
        got = _native.call("he_choose_victims", [candidates.contiguous(), exclude.contiguous(), *cols, out],
                           [int(min_take), int(k)])
        return got, (out[:0] if got < min_take else out[: min(got, out.numel())])
    if bool((exclude >= n).any()):
        i = int((exclude >= n).nonzero()[0])
        raise _native.KernelError("he_choose_victims", _native.Status.BAD_VALUE, (i, int(exclude[i]), n),
                                  f"he_choose_victims: exclude[{i}] = {int(exclude[i])} is not an index of the "
                                  f"{n} candidates")
    cand = candidates >= 0
    cand[exclude[exclude >= 0]] = False
    idx = cand.nonzero().squeeze(1)
    if idx.numel() < min_take:
        return idx.numel(), idx[:0]
    return idx.numel(), idx[lowest_k([c[idx] for c in cols], min(int(k), idx.numel()))]


def check_evict_args(name: str, step, ttl, max_rows, policy, min_norm=None) -> int:
    step = check_step(name, step)
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0):
        raise ConfigError(f"table '{name}': ttl must be an int >= 0 or None, got {ttl!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
        raise ConfigError(f"table '{name}': max_rows must be an int >= 0 or None, got {max_rows!r}")
    if policy not in EVICTION_POLICIES:
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
            cand = torch.where(gone | prot, -1, 0)
            gone[choose_victims(policy_columns(policy, row_counts, row_lasts, row_keys), excess, cand)[1]] = True
    more = pending_excess - int(pgone.sum())
    if more > 0:  # fewest hits first, whatever the policy
        cand = torch.where(pgone, -1, 0)
        pgone[choose_victims(policy_columns("lfu", pend_counts, pend_lasts, pend_keys), more, cand)[1]] = True
    return gone, pgone
