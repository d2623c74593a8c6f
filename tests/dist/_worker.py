"""Entry point of one rank started by _harness.py: init gloo, call the target, save its result."""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> None:
    target, rank, world, port, workdir, timeout = (sys.argv[1:7] if argv is None else argv)
    rank, world, workdir = int(rank), int(world), Path(workdir)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(timeout)))
    module, fn = target.split(":")
    args = pickle.loads((workdir / "args.pkl").read_bytes())
    result = getattr(importlib.import_module(module), fn)(rank, world, **args)
    torch.save(result, workdir / f"result.{rank}.pt")
    if args.get("broken_group"):  # a peer was killed on purpose: no teardown handshake with it
        sys.stdout.flush()
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
