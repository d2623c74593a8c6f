"""Converters between SparseFeatures and per-feature layouts: CSR, dicts, Python lists, TorchRec.

TorchRec is optional: it is imported inside the two functions that need it, never when
``hugeembed.features`` is imported.
"""

from __future__ import annotations

import bisect
import itertools
import numbers
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ..errors import InputError
from ._inputs import INT_DTYPES, Part, as_ids, as_index, as_weights, assemble, offsets_to_lengths
from ._jagged import JaggedFeature

if TYPE_CHECKING:
    from ._sparse import SparseFeatures

__all__ = ["PythonConverters"]

TORCHREC_HINT = (
    'pip install "hugeembed[torchrec]" (torchrec pins a CUDA build of fbgemm-gpu, so install '
    "torchrec itself with `pip install --no-deps torchrec` next to fbgemm-gpu-cpu)"
)


def _keyed_jagged_tensor(caller: str):
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    except ImportError as e:
        raise ImportError(f"SparseFeatures.{caller} needs torchrec, which cannot be imported ({e}): "
                          f"{TORCHREC_HINT}") from e
    return KeyedJaggedTensor


def _jagged_part(name: str, values: Any, offsets: Any, weights: Any, what: str) -> Part:
    ids = as_ids(values, what)
    offsets = as_index(offsets, what, "offsets")
    if offsets.device != ids.device:  # before reading the offsets: a meta tensor has nothing to read
        raise InputError(f"{what}: offsets are on {offsets.device} but ids are on {ids.device}")
    lengths = offsets_to_lengths(offsets, ids.numel(), what)
    w = None if weights is None else as_weights(weights, ids, what)
    return Part(name, ids, lengths, w)


def _flatten(rows: Any, what: str, ids: bool, device: torch.device | None) -> tuple[torch.Tensor, list[int]]:
    """A list of samples (each a list of numbers) as one flat tensor on `device`, and their lengths."""
    try:
        rows = list(rows)
        lengths = list(map(len, rows))
    except TypeError:
        raise InputError(f"{what}: expected a list of samples, each a list of ids") from None
    flat = list(itertools.chain.from_iterable(rows))
    _check_numbers(flat, lengths, what, ids)
    try:
        t = torch.tensor(flat) if flat else torch.zeros(0, dtype=torch.int64 if ids else torch.float32)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise InputError(f"{what}: cannot read the values as numbers ({e})") from None
    t = t.to(device=device, dtype=torch.int64 if ids else (t.dtype if t.dtype.is_floating_point else torch.float32))
    return t, lengths


def _is_number(x: Any, ids: bool) -> bool:
    """An int id (or a real weight): a Python/NumPy number or a 0-d tensor, never a bool."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and (x.dtype in INT_DTYPES if ids else (x.dtype != torch.bool and
                                                                          not x.dtype.is_complex))
    if isinstance(x, bool):  # bool is an int subclass: True would silently become id 1
        return False
    return isinstance(x, numbers.Integral if ids else numbers.Real)


def _check_numbers(flat: list, lengths: list[int], what: str, ids: bool) -> None:
    """Refuses bools, floats among ids, strings, None and nested lists, naming the sample and value.

    torch.tensor would turn True into 1 and mix 1.5 into a float tensor, or fail with a
    message about shapes; this finds the first bad element instead.  The common case
    (plain ints, or plain floats and ints) is one type test per element.
    """
    plain = (int,) if ids else (int, float)
    if all(type(x) in plain for x in flat):
        return
    for pos, x in enumerate(flat):
        if not _is_number(x, ids):
            sample = bisect.bisect_right(list(itertools.accumulate(lengths)), pos)
            kind = "ids must be integers" if ids else "weights must be numbers"
            nested = "; samples are flat lists (no nesting)" if isinstance(x, (list, tuple)) else ""
            raise InputError(f"{what}: {kind}, but sample {sample} has {x!r} ({type(x).__name__}){nested}")


class PythonConverters:
    """Mixin of SparseFeatures: CSR, dict, Python-list and TorchRec converters."""

    __slots__ = ()

    # -- CSR and dicts of jagged features ---------------------------------------------

    @classmethod
    def from_csr(cls, features: Mapping[str, tuple], *, batch_size: int | None = None) -> "SparseFeatures":
        """From CSR per feature: ``{name: (row_offsets [B + 1], values [n][, weights [n]])}``.

        ``values[row_offsets[b]:row_offsets[b + 1]]`` are the ids of sample b; row_offsets
        (int32 or int64) start at 0, never decrease and end at n.

        Example::

            >>> sf = SparseFeatures.from_csr({"user": (torch.tensor([0, 2, 2, 3]), torch.tensor([1, 5, 7]))})
            >>> sf.lengths().tolist()                     # bags: [1, 5] [ ] [7]
            [2, 0, 1]
        """
        parts = []
        for name, item in features.items():
            what = f"from_csr: feature {name!r}"
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise InputError(f"{what}: expected (row_offsets, values[, weights]), got {type(item).__name__}")
            parts.append(_jagged_part(name, item[1], item[0], item[2] if len(item) == 3 else None, what))
        return assemble(cls, parts, "from_csr", batch_size)

    def to_csr(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per feature ``(row_offsets [B + 1] starting at 0, values [n], weights [n] or None)``."""
        self._readable(f"to_csr of {list(self.keys())}")
        out = {}
        for key in self.keys():
            jf = self._feature(key)
            out[key] = (jf.offsets, jf.values, jf.weights)
        return out

    @classmethod
    def from_dict(cls, features: Mapping[str, Any], *, batch_size: int | None = None) -> "SparseFeatures":
        """From ``{name: JaggedFeature | (values, offsets) | (values, offsets, weights)}``.

        Note the tuple order is JaggedFeature's (values first), unlike :meth:`from_csr`.
        """
        parts = []
        for name, item in features.items():
            what = f"from_dict: feature {name!r}"
            if isinstance(item, JaggedFeature):
                item = (item.values, item.offsets, item.weights)
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise InputError(
                    f"{what}: expected a JaggedFeature or (values, offsets[, weights]), got {type(item).__name__}"
                )
            parts.append(_jagged_part(name, item[0], item[1], item[2] if len(item) == 3 else None, what))
        return assemble(cls, parts, "from_dict", batch_size)

    def to_dict(self) -> dict[str, JaggedFeature]:
        """``{name: JaggedFeature}`` with offsets starting at 0 (views, no copy of the ids)."""
        self._readable(f"to_dict of {list(self.keys())}")
        return {key: self._feature(key) for key in self.keys()}

    # -- Python lists ------------------------------------------------------------------

    @classmethod
    def from_lists(cls, features: Mapping[str, Any], weights: Mapping[str, Any] | None = None, *,
                   batch_size: int | None = None, device: torch.device | str | None = None) -> "SparseFeatures":
        """From Python lists: ``{name: [[ids of sample 0], [ids of sample 1], ...]}``.

        Args:
            features: per feature, one list of ids per sample (the same number of samples each).
            weights: optional ``{name: [[weights of sample 0], ...]}`` shaped like `features`.
            batch_size: B when there are no features.
            device: where to put the tensors (default CPU).

        Example::

            >>> sf = SparseFeatures.from_lists({"user": [[1, 5], [], [7]], "item": [[2], [2, 3, 9], [4]]})
            >>> sf.values().tolist(), sf.offsets().tolist()
            ([1, 5, 7, 2, 2, 3, 9, 4], [0, 2, 2, 3, 4, 7, 8])
        """
        extra = [k for k in (weights or {}) if k not in features]
        if extra:
            raise InputError(f"from_lists: weights for unknown feature {extra[0]!r}")
        parts = []
        for name, rows in features.items():
            what = f"from_lists: feature {name!r}"
            ids, lengths = _flatten(rows, what, True, device)
            w = None
            if weights is not None:
                if name not in weights:
                    raise InputError(f"{what}: has no weights, but other features do")
                w, wl = _flatten(weights[name], f"{what} weights", False, device)
                if len(wl) != len(lengths):
                    raise InputError(f"{what}: weights for {len(wl)} samples but ids for {len(lengths)}")
                # compared as lists: no device sync (and a meta device has nothing to compare)
                bad = next((i for i, (a, b) in enumerate(zip(lengths, wl)) if a != b), None)
                if bad is not None:
                    raise InputError(f"{what}: sample {bad} has {lengths[bad]} ids but {wl[bad]} weights")
            parts.append(Part(name, ids, torch.tensor(lengths, dtype=torch.int64, device=device), w))
        return assemble(cls, parts, "from_lists", batch_size, device)

    def to_lists(self, with_weights: bool = False):
        """``{name: [[ids of sample 0], ...]}`` as Python ints.

        With `with_weights`, returns ``(ids, weights)``, two such dicts, so that
        ``SparseFeatures.from_lists(*sf.to_lists(with_weights=True))`` rebuilds `sf`.
        """
        self._readable(f"to_lists of {list(self.keys())}")
        b = self.batch_size
        offsets = self.offsets().tolist()
        values = self.values().tolist()
        w = self.weights().tolist() if with_weights else None
        ids_out, w_out = {}, {}
        for fi, key in enumerate(self.keys()):
            o = offsets[fi * b : (fi + 1) * b + 1]
            # building Python lists is inherently one step per sample; the slicing is all there is
            ids_out[key] = [values[o[i] : o[i + 1]] for i in range(b)]
            if w is not None:
                w_out[key] = [w[o[i] : o[i + 1]] for i in range(b)]
        return (ids_out, w_out) if with_weights else ids_out

    # -- TorchRec ----------------------------------------------------------------------

    def to_torchrec(self):
        """A ``torchrec.sparse.jagged_tensor.KeyedJaggedTensor`` with the same layout (no copy).

        Needs the optional dependency: ``pip install "hugeembed[torchrec]"``.
        """
        kjt = _keyed_jagged_tensor("to_torchrec")
        return kjt(
            keys=list(self.keys()),
            values=self.values(),
            weights=self.weights_or_none(),
            lengths=self.lengths(),
            offsets=self.offsets(),
            stride=self.batch_size,
        )

    @classmethod
    def from_torchrec(cls, kjt: Any) -> "SparseFeatures":
        """From a TorchRec ``KeyedJaggedTensor`` (the same feature-major layout).

        A KJT with a variable batch size per feature (``variable_stride_per_key()``) is refused:
        SparseFeatures has one batch size. Ids become int64 and offsets int64.
        """
        kjt_type = _keyed_jagged_tensor("from_torchrec")
        if not isinstance(kjt, kjt_type):
            raise InputError(f"from_torchrec: expected a KeyedJaggedTensor, got {type(kjt).__name__}")
        if kjt.variable_stride_per_key():
            raise InputError(
                f"from_torchrec: features have different batch sizes {dict(zip(kjt.keys(), kjt.stride_per_key()))}; "
                "SparseFeatures needs one batch size for every feature"
            )
        what = f"from_torchrec {kjt.keys()}"
        ids = as_ids(kjt.values(), what)
        weights = kjt.weights_or_none()
        return cls(
            kjt.keys(),
            ids,
            offsets=kjt.offsets().to(torch.int64),
            weights=None if weights is None else as_weights(weights, ids, what),
            batch_size=kjt.stride(),
        )
