"""A hash store's find-or-insert and find as ``torch.library`` custom ops, for ``torch.compile``.

Under a compiler, :meth:`HashStore.find_or_insert` and :meth:`HashStore.find` call one op
each instead of their Python (which branches on the data: growth, eviction, admission),
so code that drives a store itself compiles into one graph::

    hugeembed::store_find_or_insert(handle, version, keys, step, counts) -> slots   (mutates version)
    hugeembed::store_find(handle, version, keys) -> codes

The real implementation is the eager method itself, so a compiled call does exactly what
an eager one does; the fake one gives the slots' shape.  ``version`` is a one-element
counter of the store's that the find-or-insert op increments: marked as mutated, it orders
the ops of one store in the graph, and a compiler never drops a find-or-insert whose slots
look unused.  (It is not the store's own arrays: a functionalizing compiler runs a mutating
op on a copy of its mutated inputs and copies that back, which would undo what the op did
to the store.)  ``handle`` names a live store in this process, held weakly, given at the
store's construction: a shallow copy of a store shares it, so compile with the store itself.
A collection compiles through its own ops (nn/_ops.py), which fetch with these stores inside.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from ..errors import InputError

__all__ = ["register", "find_or_insert_op", "find_op"]

_stores: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def register(store) -> tuple[int, torch.Tensor]:
    """(handle, version counter) of a new store, for its ops (held weakly: never kept alive by them)."""
    handle = next(_handles)
    _stores[handle] = store
    return handle, torch.zeros(1, dtype=torch.int64)


def _store(handle: int):
    s = _stores.get(handle)
    if s is None:
        raise InputError(f"hugeembed::store_find_or_insert: store {handle} no longer exists (a compiled graph runs "
                         "only in the process, and while the store it was traced with lives)")
    return s


@torch.library.custom_op("hugeembed::store_find_or_insert", mutates_args=("version",))
def _find_or_insert(handle: int, version: torch.Tensor, keys: torch.Tensor, step: int,
                    counts: Optional[torch.Tensor]) -> torch.Tensor:
    out = _store(handle).find_or_insert(keys, step, counts=counts)
    version.add_(1)
    return out


@_find_or_insert.register_fake
def _find_or_insert_fake(handle, version, keys, step, counts):
    return keys.new_empty(keys.shape, dtype=torch.int64)


@torch.library.custom_op("hugeembed::store_find", mutates_args=())
def _find(handle: int, version: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return _store(handle).find(keys)


@_find.register_fake
def _find_fake(handle, version, keys):
    return keys.new_empty(keys.shape, dtype=torch.int64)


def find_or_insert_op(store, keys: torch.Tensor, step: int, counts: torch.Tensor | None) -> torch.Tensor:
    return _find_or_insert(store._op_handle, store._op_version, keys, step, counts)


def find_op(store, keys: torch.Tensor) -> torch.Tensor:
    return _find(store._op_handle, store._op_version, keys)
