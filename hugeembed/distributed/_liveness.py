"""Which rank died: a heartbeat per rank in the default group's store, read when a collective fails.

A collective that fails only says that *a* peer is gone (gloo: "connection closed" from whichever
neighbour it was reading).  Each rank therefore bumps a counter under ``hugeembed/alive/<rank>`` in
the default group's store every ``interval`` seconds from a daemon thread; a rank that sees a
collective fail marks itself ``failed`` (so it is not blamed when it exits next), reads every
rank's counter twice, ``3 x interval`` apart, and names the ranks whose counter stood still (the
process died or froze) or that exited.  The store lives in the launcher (``--nproc``, torchrun's
agent) or in rank 0 (``tcp://`` init): if it cannot be reached, the message says so.
"""

from __future__ import annotations

import atexit
import threading
import time

import torch.distributed as dist

__all__ = ["Heartbeat", "start_heartbeat", "describe_failure", "default_store"]

_PREFIX = "hugeembed/alive/"
_FAILED, _EXITED = b"failed", b"exited"


def default_store():
    """The default process group's store (every rank a client of the same one), or None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


class Heartbeat:
    """Bumps this rank's counter in `store` every `interval` seconds until :meth:`mark` or exit."""

    def __init__(self, store, rank: int, world_size: int, interval: float = 1.0) -> None:
        self.rank, self.world_size, self.interval = rank, world_size, float(interval)
        try:  # its own connection: the main thread's store calls never wait behind a beat
            self.store = store.clone()
        except (AttributeError, RuntimeError):
            self.store = store
        self._stop = threading.Event()
        self._beats = 0
        self._finding: str | None = None  # computed once: the exchange thread and the main thread may both ask
        self._finding_lock = threading.Lock()
        self.store.set(_PREFIX + str(rank), "0")
        self._thread = threading.Thread(target=self._run, name="hugeembed-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.mark, _EXITED)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beats += 1
            try:
                self.store.set(_PREFIX + str(self.rank), str(self._beats))
            except (RuntimeError, OSError, ValueError):  # the store is gone: nothing left to tell
                return

    def mark(self, state: bytes) -> None:
        """Stops beating and leaves `state` (failed / exited) for the others to read."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.store.set(_PREFIX + str(self.rank), state)
        except (RuntimeError, OSError, ValueError):
            pass

    def _read(self) -> dict[int, bytes | None]:
        out = {}
        for r in range(self.world_size):
            key = _PREFIX + str(r)
            out[r] = bytes(self.store.get(key)) if self.store.check([key]) else None
        return out

    def culprits(self) -> str:
        """A sentence naming the ranks that died, froze or exited (this rank marks itself failed first)."""
        with self._finding_lock:
            if self._finding is None:
                self._finding = self._probe()
            return self._finding

    def _probe(self) -> str:
        self.mark(_FAILED)
        try:
            first = self._read()
            time.sleep(3 * self.interval)
            second = self._read()
        except (RuntimeError, OSError, ValueError) as e:
            return (f"the run's store cannot be reached ({type(e).__name__}): the process hosting it (the launcher, "
                    f"or rank 0 under tcp:// init) is gone")
        dead = [r for r in range(self.world_size) if r != self.rank and second[r] not in (_FAILED, _EXITED)
                and first[r] == second[r]]
        exited = [r for r in range(self.world_size) if r != self.rank and second[r] == _EXITED]
        parts = []
        if dead:
            parts.append(f"{_ranks(dead)} of {self.world_size} stopped responding (heartbeat silent for "
                         f"{3 * self.interval:g} s: the process died or froze)")
        if exited:
            parts.append(f"{_ranks(exited)} exited")
        if not parts:
            return "every rank's heartbeat still runs: a peer hung inside a collective or took a different path"
        return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_current: Heartbeat | None = None
_lock = threading.Lock()


def start_heartbeat(timeout_s: float) -> Heartbeat | None:
    """This process's heartbeat in the default group's store (started once; None without a group or store).

    The interval is min(1 s, timeout / 10), so naming a dead rank adds at most 3 intervals to the timeout."""
    global _current
    with _lock:
        if _current is not None or not dist.is_available() or not dist.is_initialized():
            return _current
        store = default_store()
        if store is None or dist.get_world_size() == 1:
            return None
        _current = Heartbeat(store, dist.get_rank(), dist.get_world_size(), min(1.0, float(timeout_s) / 10))
        return _current


def describe_failure() -> str:
    """A sentence naming the ranks that are gone, for an error message ("" when no heartbeat runs)."""
    hb = _current
    if hb is None:
        return ""
    return " Who is gone: " + hb.culprits() + "."
