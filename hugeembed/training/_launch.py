"""``hugeembed train --nproc N``: N processes on this machine, their rendezvous on the loopback interface only.

torchrun's ``--standalone`` hosts its TCP store on every interface (``*:port``): whoever reaches
the machine could join the run's store or disrupt it.  This launcher hosts the store itself, on
a socket it bound to 127.0.0.1 (TCPStore's ``master_listen_fd``), and starts the processes as
torchrun's agent does: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT``
and ``TORCHELASTIC_USE_AGENT_STORE`` (every rank a client of the launcher's store), with gloo's
and NCCL's own sockets on the loopback interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
``lo``, unless set).  The first process to fail stops the others; SIGINT / SIGTERM are passed on.
Several machines: run ``torchrun`` yourself (its ``--rdzv-endpoint`` on the network you choose).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from ..errors import ConfigError

__all__ = ["launch_local", "run_local", "LOOPBACK"]

LOOPBACK = "127.0.0.1"
_POLL_S = 0.05


def launch_local(nproc: int, args: Sequence[str], python: str = sys.executable) -> int:
    """Runs ``hugeembed <args>`` in `nproc` processes on this machine; returns the launch's exit status."""
    return run_local(nproc, [python, "-m", "hugeembed", *args])


def run_local(nproc: int, command: Sequence[str]) -> int:
    """Runs `command` as ranks 0..nproc-1 of one process group whose store listens on 127.0.0.1 only.

    Returns 0 when every process exits 0, else the first failure's status (a process killed by a
    signal: 128 + the signal); the others are then terminated."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"--nproc must be a positive integer, got {nproc!r}")
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(max(128, nproc))
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    # the store owns the socket from here (it closes it); it serves the ranks until they all exit
    store = dist.TCPStore(LOOPBACK, port, world_size=nproc, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach())
    env = {**os.environ, "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nproc):
            procs.append(subprocess.Popen(list(command), env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
        return _wait(procs)
    finally:
        _stop(procs)
        del store


def _wait(procs: list[subprocess.Popen]) -> int:
    """Waits for every process; on the first failure (or SIGINT/SIGTERM here) stops the others."""
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                print(f"hugeembed: rank {rank} of {len(procs)} {how}; stopping the other ranks", file=sys.stderr,
                      flush=True)
                return _status(code)
            if all(c == 0 for c in codes):
                return 128 + received[0] if received else 0
            time.sleep(_POLL_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # Popen: -N for a process killed by signal N


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
