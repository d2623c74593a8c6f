"""Every collective of the embedding exchange goes through :class:`Comm`.

Comm runs each collective asynchronously and waits with a timeout, so a dead or
hung peer becomes a :class:`ShardingError` that names the step and the stage
(``input_dist``, ``output_dist``, ``grad_dist``, ``checkpoint save``...) instead of a
silent hang.  It also counts the bytes each stage sends to each rank (the
dedup test and ``bench/distributed.py`` read them).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError, ShardingError
from ._liveness import describe_failure, start_heartbeat

__all__ = ["Comm", "ExchangeStats", "DEFAULT_TIMEOUT_S", "new_embedding_group", "as_timeout"]

DEFAULT_TIMEOUT_S = 300.0


def as_timeout(timeout: float | datetime.timedelta) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ConfigError(f"timeout must be seconds (a number) or a timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ConfigError(f"timeout must be positive, got {seconds} s")
    return datetime.timedelta(seconds=seconds)


def new_embedding_group(device: torch.device, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S):
    """A process group of every rank dedicated to embedding traffic (collective: call it on every rank).

    Its collectives never interleave with DistributedDataParallel's gradient all-reduce,
    which runs on the default group.  gloo for CPU tables, NCCL for CUDA tables.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ShardingError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                            "(or launch with torchrun and hugeembed.distributed.init_from_env) first")
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    return dist.new_group(backend=backend, timeout=as_timeout(timeout))


@dataclass
class ExchangeStats:
    """Bytes moved by the collection's collectives.

    ``step[stage]`` holds the bytes sent to each rank (own rank included, which no
    network carries) by this rank in the latest step; ``total_remote[stage]`` the bytes
    sent to other ranks over all steps.
    """

    step: dict[str, list[int]] = field(default_factory=dict)
    total_remote: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time spent in each stage's collectives
    collectives: int = 0

    def record(self, stage: str, rank: int, per_rank: list[int]) -> None:
        prev = self.step.get(stage)
        self.step[stage] = per_rank if prev is None else [a + b for a, b in zip(prev, per_rank)]
        self.total_remote[stage] = self.total_remote.get(stage, 0) + sum(per_rank) - per_rank[rank]

    def remote_bytes(self, stage: str | None = None, rank: int | None = None) -> int:
        """Bytes sent to other ranks in the latest step (one stage or all); `rank` is this rank."""
        stages = [stage] if stage is not None else list(self.step)
        out = 0
        for s in stages:
            per = self.step.get(s, [])
            out += sum(per) - (per[rank] if rank is not None and per else 0)
        return out

    def new_step(self) -> None:
        self.step = {}


class Comm:
    """Collectives over one process group, each with a timeout and an error naming step and stage.

    Args:
        group: the process group (see :func:`new_embedding_group`).
        timeout: seconds (or a timedelta) to wait for any collective.
    """

    def __init__(self, group, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.timeout = as_timeout(timeout)
        # NCCL moves CUDA tensors, gloo CPU tensors
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else \
            torch.device("cpu")
        self.step = 0
        self.stats = ExchangeStats()
        if self.world_size > 1:  # so that a failed collective can name the rank that is gone
            start_heartbeat(self.timeout.total_seconds())

    # -- errors --------------------------------------------------------------------------

    def _error(self, stage: str, e: BaseException) -> ShardingError:
        return ShardingError(
            f"rank {self.rank} of {self.world_size}: collective '{stage}' at step {self.step} failed "
            f"(timeout {self.timeout.total_seconds():g} s): a peer process died, hung or took a different path. "
            f"Check the other ranks' logs; resume from the last snapshot with --resume. Cause: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}." + describe_failure())

    def _run(self, stage: str, launch) -> None:
        t0 = time.perf_counter()
        try:
            work = launch()
            if work is not None:
                work.wait(timeout=self.timeout)
        except ShardingError:
            raise
        except (RuntimeError, ValueError, OSError) as e:  # gloo/NCCL raise RuntimeError (DistBackendError)
            raise self._error(stage, e) from e
        self.stats.collectives += 1
        self.stats.seconds[stage] = self.stats.seconds.get(stage, 0.0) + time.perf_counter() - t0

    # -- collectives -----------------------------------------------------------------------

    def exchange_counts(self, stage: str, counts: torch.Tensor) -> torch.Tensor:
        """All-to-all of an int64 ``[W, H]`` table: row d goes to rank d; returns row r = what rank r sent."""
        W = self.world_size
        if counts.dim() != 2 or counts.shape[0] != W or counts.dtype != torch.int64:
            raise ShardingError(f"{stage}: counts must be int64 [{W}, H], got {counts.dtype} {tuple(counts.shape)}")
        send = counts.to(self.device).contiguous()
        self.stats.record(stage, self.rank, [counts.shape[1] * 8] * W)
        recv = torch.empty_like(send)
        if W == 1:
            recv.copy_(send)
        else:
            self._run(stage, lambda: dist.all_to_all_single(recv, send, group=self.group, async_op=True))
        return recv.cpu()

    def all_to_all_bytes(self, stage: str, send: torch.Tensor, send_splits: list[int],
                         recv_splits: list[int]) -> torch.Tensor:
        """All-to-all of a uint8 buffer: ``send_splits[d]`` bytes go to rank d; returns what each rank sent."""
        if send.dtype != torch.uint8 or send.dim() != 1 or send.numel() != sum(send_splits):
            raise ShardingError(f"{stage}: send buffer must be uint8 [{sum(send_splits)}], got {send.dtype} "
                                f"{tuple(send.shape)}")
        self.stats.record(stage, self.rank, list(send_splits))
        send = send.to(self.device)
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        if self.world_size == 1:
            recv.copy_(send)
        else:
            self._run(stage, lambda: dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group,
                                                            async_op=True))
        return recv

    def all_gather_object(self, stage: str, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._run(stage, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def all_gather(self, stage: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (of one shape and dtype on every rank), in rank order, on this comm's device."""
        send = tensor.to(self.device).contiguous()
        if self.world_size == 1:
            return [send]
        out = [torch.empty_like(send) for _ in range(self.world_size)]
        self._run(stage, lambda: dist.all_gather(out, send, group=self.group, async_op=True))
        return out

    def all_reduce_max(self, stage: str, value: int) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            self._run(stage, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return int(t.item())

    def all_reduce_sum(self, stage: str, value: int) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            self._run(stage, lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        return int(t.item())

    def barrier(self, stage: str) -> None:
        if self.world_size > 1:
            t = torch.zeros(1, device=self.device)
            self._run(stage, lambda: dist.all_reduce(t, group=self.group, async_op=True))
