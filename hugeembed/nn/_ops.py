"""The collection's lookup as ``torch.library`` custom ops, for ``torch.compile`` and ``torch.export``.

Under a compiler (Dynamo, export) ``EmbeddingCollection.forward`` calls one op instead of
its Python stages, so the graph holds the whole model with the embedding lookup inside::

    hugeembed::collection_lookup(handle, training, names_id, batch_size, values, offsets, weights, anchor)
        -> [pooled [B, F_g, D_g] per dim group ..., token]
    hugeembed::collection_backward(handle, token, grads) -> anchor's (empty) gradient

``anchor`` (training only) is the tensor requiring grad that routes the backward into the op.
The op's real implementation is the eager lookup itself (clean, dedup, fetch with inserts,
pins, pooling), so a compiled step does exactly what an eager one does, in the same order;
its fake implementation gives the output shapes from the plan.  ``token`` names the lookup's
saved state (the rows each id read, the in-flight pins) until the backward op applies the
optimizer to those rows; it is dropped with the token tensor when the graph is freed.

``handle`` names a live collection in this process: a compiled or exported graph runs only
where its collection lives.  A portable frozen model is ``hugeembed.serving``'s export.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from ..errors import InputError
from ..features import SparseFeatures

__all__ = ["register", "lookup_op"]

_collections: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)
_runs: dict[int, object] = {}  # token -> the lookup's state awaiting its backward
_tokens = itertools.count(1)
# A batch's feature names as an int (op schemas take no list of strings): interned, a few per model
_names: dict[tuple[str, ...], int] = {}
_names_of: list[tuple[str, ...]] = []


@torch.compiler.assume_constant_result  # run for real while tracing: the graph holds its result
def _names_id(names: tuple[str, ...]) -> int:
    got = _names.get(names)
    if got is None:
        got = _names[names] = len(_names_of)
        _names_of.append(names)
    return got


def register(collection) -> int:
    """A handle naming `collection` in the ops (held weakly: the ops never keep it alive)."""
    handle = next(_handles)
    _collections[handle] = collection
    return handle


def _collection(handle: int):
    ec = _collections.get(handle)
    if ec is None:
        raise InputError(f"hugeembed::collection_lookup: collection {handle} no longer exists (a compiled or "
                         "exported graph runs only in the process, and while the collection it was traced "
                         "with lives)")
    return ec


@torch.library.custom_op("hugeembed::collection_lookup", mutates_args=())
def _lookup(handle: int, training: bool, names: int, batch_size: int, values: torch.Tensor,
            offsets: torch.Tensor, weights: Optional[torch.Tensor], anchor: Optional[torch.Tensor]) -> list[torch.Tensor]:
    ec = _collection(handle)
    sf = SparseFeatures(_names_of[names], values, offsets=offsets, weights=weights, batch_size=batch_size)
    runs: list = []
    out = ec._op_forward(sf, training, runs)
    token = torch.full((), -1, dtype=torch.int64)
    if runs:
        key = next(_tokens)
        _runs[key] = runs[0]
        token = torch.full((), key, dtype=torch.int64)
        weakref.finalize(token, _runs.pop, key, None)  # the graph was freed without a backward: unpin
    return out.groups() + [token]


@_lookup.register_fake
def _lookup_fake(handle, training, names, batch_size, values, offsets, weights, anchor):
    ec = _collection(handle)
    plan = ec.lookup.plan
    if any(g.unpooled for g in plan.groups):
        raise NotImplementedError(f"tables {[t.name for t in plan.tables]}: sequence (unpooled) features inside "
                                  "torch.compile / torch.export are not supported yet; run the collection eagerly")
    dtypes = ec.group_dtypes()
    # the token stays on the CPU on every device: backward reads it on the host
    return [values.new_empty((batch_size, len(g.pooled), g.dim), dtype=dt) for g, dt in zip(plan.groups, dtypes)] + \
        [values.new_empty((), dtype=torch.int64, device="cpu")]


@torch.library.custom_op("hugeembed::collection_backward", mutates_args=())
def _backward_op(handle: int, token: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    run = _runs.pop(int(token), None)
    if run is None:
        raise InputError(f"hugeembed::collection_backward: no pending lookup {int(token)} (its backward already "
                         "ran: a compiled step's graph takes one backward)")
    run.backward(tuple(grads), False)
    return grads[0].new_zeros(0) if grads else torch.zeros(0)


@_backward_op.register_fake
def _backward_fake(handle, token, grads):
    return grads[0].new_empty(0) if grads else torch.empty(0)


def _setup_context(ctx, inputs, output):
    ctx.handle = inputs[0]
    ctx.pooled = [(o.shape, o.dtype, o.device) for o in output[:-1]]  # for outputs the loss does not use
    ctx.save_for_backward(output[-1])


def _backward(ctx, grads):
    (token,) = ctx.saved_tensors
    pooled = [g if g is not None else torch.zeros(shape, dtype=dt, device=dev)
              for g, (shape, dt, dev) in zip(grads, ctx.pooled)]
    return None, None, None, None, None, None, None, _backward_op(ctx.handle, token, pooled)


torch.library.register_autograd("hugeembed::collection_lookup", _backward, setup_context=_setup_context)


def lookup_op(collection, handle: int, features: SparseFeatures, training: bool) -> list[torch.Tensor]:
    """The pooled group tensors of `features` through the op (the compiled path of forward)."""
    out = _lookup(handle, training, _names_id(features.keys()), features.batch_size, features.values(),
                  features.offsets(), features.weights_or_none(), collection._anchor if training else None)
    return out[:-1]
