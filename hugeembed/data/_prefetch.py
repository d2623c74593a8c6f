"""A generator run in a background thread, its items handed over through a bounded queue."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

__all__ = ["Prefetcher", "threaded"]


class Prefetcher:
    """Runs a generator in a daemon thread, passing items through a bounded queue."""

    def __init__(self, make: Callable[[], Iterator], depth: int) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make,), name="hugeembed-loader", daemon=True)
        self._thread.start()

    def _run(self, make: Callable[[], Iterator]) -> None:
        it = None
        try:
            it = make()
            for item in it:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(("error", e))
        finally:
            if it is not None and hasattr(it, "close"):
                it.close()  # runs the generators' finally blocks: files are closed here

    def _put(self, msg) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(msg, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def get(self):
        while True:
            try:
                return self._q.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    return ("error", RuntimeError("hugeembed loader thread died without a result"))

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a worker waiting on a full queue
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def threaded(make: Callable[[], Iterator], depth: int = 2) -> Iterator:
    """The items of ``make()``, produced ahead in a background thread (exceptions re-raised here, in
    order); closing this generator stops the thread."""
    pre = Prefetcher(make, depth)
    try:
        while True:
            kind, value = pre.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        pre.close()
