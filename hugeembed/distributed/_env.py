"""Starting a distributed run: torchrun's environment, the default process group, the launch command."""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError, ShardingError
from ._comm import DEFAULT_TIMEOUT_S, as_timeout

__all__ = ["DistEnv", "init_from_env", "launch_command"]


@dataclass(frozen=True)
class DistEnv:
    """This process's place in a torchrun launch (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "DistEnv | None":
        """The torchrun variables of `environ` (pass ``os.environ``), or None outside torchrun."""
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return None
        try:
            rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
            local = int(environ.get("LOCAL_RANK", rank))
        except ValueError:
            raise ConfigError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers, got {environ.get('RANK')!r}, "
                              f"{environ.get('WORLD_SIZE')!r}, {environ.get('LOCAL_RANK')!r}") from None
        if not 0 <= rank < world:
            raise ConfigError(f"RANK {rank} is outside [0, WORLD_SIZE={world})")
        return cls(rank, world, local)


def init_from_env(env: DistEnv, device: str = "auto",
                  timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S) -> torch.device:
    """Initialises the default process group of a torchrun-launched process; returns its device.

    gloo on CPU, NCCL on CUDA (each process takes GPU ``LOCAL_RANK``).  The timeout bounds
    every collective of the default group (DistributedDataParallel's all-reduce included).
    MASTER_ADDR / MASTER_PORT come from the environment torchrun sets.
    """
    use_cuda = (device == "auto" and torch.cuda.is_available()) or str(device).startswith("cuda")
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but CUDA is not available here")
        if env.local_rank >= torch.cuda.device_count():
            raise ShardingError(f"LOCAL_RANK {env.local_rank} has no GPU: {torch.cuda.device_count()} visible")
        torch.cuda.set_device(env.local_rank)
        target = torch.device("cuda", env.local_rank)
    else:
        target = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size,
                                timeout=as_timeout(timeout))
    return target


def launch_command(nproc: int, args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The torchrun command that runs ``hugeembed <args>`` in `nproc` processes on this machine."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"--nproc must be a positive integer, got {nproc!r}")
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "hugeembed",
            *args]
