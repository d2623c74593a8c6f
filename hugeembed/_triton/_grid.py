"""Launching a kernel's grid of programs: all at once, or (tests) one program at a time in a shuffled order.

Every kernel takes its first program id as its first argument (``pid0``) and uses
``pid0 + tl.program_id(0)``; a grid of one program launched with ``pid0 = p`` runs program p alone.
Under :func:`shuffled_programs` each launch runs its programs that way in a random order, so a test
catches a kernel whose result depends on the order its programs run (the interpreter otherwise
always runs them in order).
"""

from __future__ import annotations

import contextlib
import random

__all__ = ["launch", "shuffled_programs"]

_shuffle: random.Random | None = None


@contextlib.contextmanager
def shuffled_programs(seed: int):
    """Within the block, every :func:`launch` runs its programs one by one in a random order."""
    global _shuffle
    before, _shuffle = _shuffle, random.Random(seed)
    try:
        yield
    finally:
        _shuffle = before


def launch(kernel, programs: int, *args, **meta) -> None:
    """``kernel[(programs,)](0, *args, **meta)``, or its programs one at a time when shuffled."""
    if programs <= 0:
        return
    if _shuffle is None:
        kernel[(programs,)](0, *args, **meta)
        return
    order = list(range(programs))
    _shuffle.shuffle(order)
    for p in order:
        kernel[(1,)](p, *args, **meta)
