"""Dense gradients under bounded staleness: all-reduced asynchronously, applied K steps later.

DistributedDataParallel all-reduces inside every backward, so every rank waits for the slowest
one at each step.  With staleness K the trainer leaves DDP out: after each backward the dense
gradients (divided by the world size, as DDP does) go into one flat buffer whose all-reduce is
started and not waited for; the gradients of step t are put back into ``.grad`` at step t+K, when
the optimizer steps with them.  K = 0 waits at once (DDP's arithmetic, one bucket).
"""

from __future__ import annotations

import collections
import datetime
import time

import torch
import torch.distributed as dist

from ..errors import ConfigError, ShardingError
from ._comm import DEFAULT_TIMEOUT_S, as_timeout
from ._liveness import describe_failure

__all__ = ["DelayedDenseGrads"]


class DelayedDenseGrads:
    """The dense parameters' gradients of each step, all-reduced in the background, applied K steps later.

    Args:
        params: the dense parameters (every rank the same list, same shapes).
        staleness: K >= 0.
        process_group: the group to all-reduce over (None: the default group).
        timeout: seconds to wait for an all-reduce before a peer counts as dead (ShardingError).
    """

    def __init__(self, params, staleness: int, process_group=None,
                 timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ConfigError(f"staleness must be an int >= 0 (steps), got {staleness!r}")
        self.params = [p for p in params if p.requires_grad]
        self.staleness = staleness
        self.group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.timeout = as_timeout(timeout)
        self._queue: collections.deque = collections.deque()  # (step, flat buffer, work)
        self.waited = 0.0  # seconds pop() blocked on an all-reduce not done yet

    @property
    def pending(self) -> int:
        return len(self._queue)

    def push(self, step: int) -> None:
        """Starts the all-reduce of the gradients now in ``.grad`` (step `step`); a missing one counts as 0."""
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                          for p in self.params]) if self.params else torch.zeros(0)
        flat.div_(self.world_size)
        work = dist.all_reduce(flat, group=self.group, async_op=True) if self.world_size > 1 else None
        self._queue.append((step, flat, work))

    def pop(self, force: bool = False) -> bool:
        """Puts the oldest all-reduced gradients into ``.grad`` when K newer steps were pushed since
        (or `force`, draining); returns whether it did (the optimizer then steps with them)."""
        if not self._queue or (len(self._queue) <= self.staleness and not force):
            return False
        step, flat, work = self._queue.popleft()
        if work is not None:
            t0 = time.perf_counter()
            try:
                work.wait(timeout=self.timeout)
            except (RuntimeError, ValueError, OSError) as e:
                raise ShardingError(f"the dense gradient all-reduce of step {step} failed (timeout "
                                    f"{self.timeout.total_seconds():g} s): a peer process died or hung; resume "
                                    f"from the last snapshot with --resume. Cause: {type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}." + describe_failure()) from e
            finally:
                self.waited += time.perf_counter() - t0
        start = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[start : start + n].view_as(p).to(p.dtype)
            start += n
        return True
