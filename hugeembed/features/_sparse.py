"""SparseFeatures: the one jagged layout of sparse ids that every part of hugeembed takes.

Layout (feature-major, the same as TorchRec's KeyedJaggedTensor), for F features
over a batch of B samples::

    keys     = ("user", "item")                    F = 2, B = 3
    bags       user: [1, 5] [ ] [7]   item: [2] [2, 3, 9] [4]
    values   = [1, 5, 7, 2, 2, 3, 9, 4]             int64 [N]
    lengths  = [2, 0, 1, 1, 3, 1]                   [F*B], bag f*B + b
    offsets  = [0, 2, 2, 3, 4, 7, 8]                [F*B + 1], int32 or int64
    weights  = None or float [N] (one weight per id)

The constructor is cheap (shape checks only, no pass over the data and no device
sync); call :meth:`validate` on untrusted input.

Converters (classmethod ``from_X`` / method ``to_X``), see ``_convert.py`` and ``_interop.py``:
``dense_padded`` (HugeCTR ``[B, slots, max_nnz]`` with -1 padding), ``coo`` (HugeCTR fprop,
TF SparseTensor), ``csr``, ``sparse_coo_tensors`` (torch), ``lists``, ``dict``, ``torchrec``.
They check their input as they read it and build int64 ids and int64 offsets.
"""

from __future__ import annotations

import numbers
from typing import Iterator, Sequence

import torch
import torch.utils._pytree as _pytree

from ..errors import InputError
from ._convert import TensorConverters
from ._inputs import INT_DTYPES, names, refuse_meta
from ._interop import PythonConverters
from ._validate import check_layout
from ._jagged import JaggedFeature
from ._reshape import Reshaping

__all__ = ["SparseFeatures", "JaggedFeature"]

class SparseFeatures(Reshaping, TensorConverters, PythonConverters):
    """A batch of named sparse features in one jagged, feature-major layout.

    Args:
        keys: feature names, unique, in the order their bags appear in `values`.
        values: int64 ``[N]`` ids of all features, feature-major then sample-major.
        offsets: ``[F*B + 1]`` int32/int64 start of each bag (give this or `lengths`).
        lengths: ``[F*B]`` number of ids in each bag (give this or `offsets`).
        weights: optional float ``[N]`` per-id weights.
        batch_size: B; needed only when there are no features.

    Example::

        >>> sf = SparseFeatures.from_lists({"user": [[1, 5], [], [7]], "item": [[2], [2, 3, 9], [4]]})
        >>> sf.batch_size, sf.keys(), sf.lengths().tolist()
        (3, ('user', 'item'), [2, 0, 1, 1, 3, 1])
    """

    __slots__ = ("_keys", "_index", "_values", "_offsets", "_weights", "_batch_size")

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        *,
        offsets: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        batch_size: int | None = None,
    ) -> None:
        keys = tuple(names(keys, "SparseFeatures"))
        index = {k: i for i, k in enumerate(keys)}
        if len(index) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise InputError(f"SparseFeatures: duplicate feature names {dup}")
        what = f"SparseFeatures {list(keys)}"
        if (offsets is None) == (lengths is None):
            raise InputError(f"{what}: give exactly one of offsets= or lengths=")
        for name, t in (("values", values), ("offsets", offsets), ("lengths", lengths), ("weights", weights)):
            if (t is not None or name == "values") and not isinstance(t, torch.Tensor):
                raise InputError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        if values.dim() != 1:
            raise InputError(f"{what}: values must be a 1-D tensor of ids, got shape {tuple(values.shape)}")
        if offsets is None:
            assert lengths is not None  # guaranteed by the exactly-one check above
            if lengths.dim() != 1:
                raise InputError(f"{what}: lengths must be a 1-D tensor, got shape {tuple(lengths.shape)}")
            if lengths.dtype not in INT_DTYPES:  # cumsum would fail on bool, or make float offsets
                raise InputError(f"{what}: lengths must be integers, got {lengths.dtype}")
            offsets = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
            torch.cumsum(lengths, 0, out=offsets[1:])
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise InputError(f"{what}: offsets must be a 1-D tensor with at least one element, "
                             f"got shape {tuple(offsets.shape)}")
        num_bags = offsets.numel() - 1
        if keys:
            if num_bags % len(keys) != 0:
                raise InputError(f"{what}: {num_bags} bags do not split evenly over {len(keys)} features")
            derived = num_bags // len(keys)
            if batch_size is not None and batch_size != derived:
                raise InputError(f"{what}: batch_size={batch_size} but offsets describe {derived} samples")
            batch_size = derived
        elif num_bags:
            raise InputError(f"{what}: no features, but offsets describe {num_bags} bags")
        elif batch_size is None:
            batch_size = 0
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 0:
            raise InputError(f"{what}: batch_size must be >= 0, got {batch_size!r} (an int)")
        if weights is not None and (weights.dim() != 1 or weights.numel() != values.numel()):
            raise InputError(
                f"{what}: weights must be 1-D with one weight per id ({values.numel()}), "
                f"got shape {tuple(weights.shape)}"
            )
        # the kernels read raw memory: a strided view (ids[::2], a column of a matrix) is
        # valid input, so it is copied here once; contiguous() of a contiguous tensor is free
        values, offsets = values.contiguous(), offsets.contiguous()
        if weights is not None:
            weights = weights.contiguous()
        self._keys = keys
        self._index = index
        self._values = values
        self._offsets = offsets
        self._weights = weights
        self._batch_size = int(batch_size)

    # -- accessors ---------------------------------------------------------------------

    def keys(self) -> tuple[str, ...]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def lengths(self) -> torch.Tensor:
        return self._offsets[1:] - self._offsets[:-1]

    def weights(self) -> torch.Tensor:
        """Per-id weights; raises if this batch has none (see :meth:`weights_or_none`)."""
        if self._weights is None:
            raise InputError("SparseFeatures: this batch has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_features(self) -> int:
        return len(self._keys)

    @property
    def device(self) -> torch.device:
        return self._values.device

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def index_of(self, key: str) -> int:
        """Position of feature `key`; raises KeyError listing the known features."""
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"no feature {key!r} in this batch; features: {list(self._keys)}") from None

    def feature(self, key: str) -> JaggedFeature:
        """The ids of one feature, with offsets rebased to start at 0."""
        self.index_of(key)
        self._readable(f"feature {key!r}")
        return self._feature(key)

    __getitem__ = feature

    def _feature(self, key: str) -> JaggedFeature:
        """feature() of a batch already checked by _readable (converters walk every feature)."""
        f = self.index_of(key)
        b = self._batch_size
        offs = self._offsets[f * b : (f + 1) * b + 1]
        start, end = (int(x) for x in (offs[0], offs[-1])) if offs.numel() else (0, 0)
        w = None if self._weights is None else self._weights[start:end]
        return JaggedFeature(self._values[start:end], offs - start, w, name=key)

    def _readable(self, what: str) -> None:
        """Before reading the bags: refuses a meta batch (it has shapes only), naming `what`,
        and offsets that validate() would refuse (the constructor does not read them).
        One vectorised pass over the offsets: for the converters, not the lookup path."""
        refuse_meta(self._offsets, what)
        refuse_meta(self._values, what)
        check_layout(self)

    def lengths_per_feature(self) -> torch.Tensor:
        """Lengths as ``[F, B]``."""
        return self.lengths().view(len(self._keys), self._batch_size)

    # -- device and memory -----------------------------------------------------------

    def _map(self, fn) -> "SparseFeatures":
        return SparseFeatures(
            self._keys,
            fn(self._values),
            offsets=fn(self._offsets),
            weights=None if self._weights is None else fn(self._weights),
            batch_size=self._batch_size,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SparseFeatures":
        """This batch on `device`; returns self (no copy) when every tensor is already there."""
        device = torch.device(device)
        if all(_is_on(t, device) for t in (self._values, self._offsets, self._weights) if t is not None):
            return self
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "SparseFeatures":
        """A copy in page-locked host memory, for fast asynchronous host-to-GPU copies."""
        return self._map(lambda t: t.pin_memory())

    def is_pinned(self) -> bool:
        return self._values.is_pinned()

    # -- checking ----------------------------------------------------------------------

    def validate(self) -> "SparseFeatures":
        """Checks dtypes, offsets and weights; raises InputError naming the feature and value.

        Returns self so it can be chained: ``sf = SparseFeatures(...).validate()``.
        """
        from ._validate import validate_features

        validate_features(self)
        return self

    def bag_location(self, bag: int) -> tuple[str, int]:
        """(feature name, sample index) of flat bag number `bag`."""
        b = max(self._batch_size, 1)
        return self._keys[bag // b], bag % b

    def id_location(self, position: int) -> tuple[str, int]:
        """(feature name, sample index) of the id at flat position `position` in values."""
        offsets = self._offsets.to(torch.int64).cpu()
        bag = int(torch.searchsorted(offsets, torch.tensor([position]), right=True)[0]) - 1
        return self.bag_location(bag)

    def __repr__(self) -> str:
        w = "" if self._weights is None else f", weights={self._weights.dtype}"
        return (
            f"SparseFeatures(keys={list(self._keys)}, batch_size={self._batch_size}, "
            f"num_ids={self._values.numel()}, device={self.device}{w})"
        )


def _is_on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` lives on `device`, where a bare "cuda" means the current CUDA device."""
    if t.device == device:
        return True
    if device.index is not None or t.device.type != device.type:
        return False
    # torch.device("cuda") != torch.device("cuda:0") although a tensor moved there lands on cuda:0
    return device.type != "cuda" or t.device.index == torch.cuda.current_device()


# SparseFeatures as a pytree node (its tensors the leaves, names and batch size the context), so
# torch.export takes it as a model input and torch.compile guards on it like on a tensor tuple.
def _flatten(sf: SparseFeatures):
    return [sf._values, sf._offsets, sf._weights], (sf._keys, sf._batch_size)


def _flatten_with_keys(sf: SparseFeatures):
    leaves, context = _flatten(sf)
    return [(_pytree.GetAttrKey(k), v) for k, v in zip(("values", "offsets", "weights"), leaves)], context


def _unflatten(leaves, context) -> SparseFeatures:
    values, offsets, weights = leaves
    keys, batch_size = context
    return SparseFeatures(keys, values, offsets=offsets, weights=weights, batch_size=batch_size)


_pytree.register_pytree_node(SparseFeatures, _flatten, _unflatten, serialized_type_name="hugeembed.SparseFeatures",
                             flatten_with_keys_fn=_flatten_with_keys)
