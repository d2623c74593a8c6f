"""Converters between SparseFeatures and tensor layouts: dense padded, COO, torch sparse COO.

All of them are vectorised (no Python loop per id or per sample; at most one per feature)
and keep the device of their input. Converters *into* SparseFeatures build int64 ids and
int64 offsets; converters *out of* it return int64 ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..errors import InputError
from ._coo import check_below, check_width, coo_indices, parse_shape, sample_words, sort_into_bags, sparse_parts
from ._inputs import (INT_DTYPES, Part, as_ids, as_tensor, as_weights, assemble, bag_positions, first_true, names,
                      refuse_meta)

if TYPE_CHECKING:
    from ._sparse import SparseFeatures

__all__ = ["TensorConverters"]


class TensorConverters:
    """Mixin of SparseFeatures: dense padded, COO and torch sparse COO converters."""

    __slots__ = ()

    # -- dense padded [B, slots, max_nnz] (HugeCTR) -------------------------------------

    @classmethod
    def from_dense_padded(cls, keys: Sequence[str] | str, dense: torch.Tensor,
                          weights: torch.Tensor | None = None, padding: int = -1) -> "SparseFeatures":
        """From HugeCTR-style dense keys ``[B, slots, max_nnz]``; slot s becomes feature ``keys[s]``.

        Any negative entry is padding, wherever it sits in the bag (not only at the end), and
        so is any entry equal to `padding` (pass e.g. ``padding=0`` for data padded with 0).
        The kept ids of a bag stay in column order. Ids may be int32 or int64.

        Args:
            keys: one feature name per slot (``len(keys) == slots``).
            dense: integer ``[B, slots, max_nnz]``.
            weights: optional float ``[B, slots, max_nnz]``; entries at padding are ignored.
            padding: the fill value (default -1).

        Example::

            dense [B=2, slots=2, max_nnz=3]      ->   user: [4, 9] [ ]      item: [3] [5, 6]
              sample 0: [[4, -1, 9], [3, -1, -1]]
              sample 1: [[-1, -1, -1], [5, 6, -1]]

            >>> sf = SparseFeatures.from_dense_padded(["user", "item"], dense)
            >>> sf.values().tolist(), sf.lengths().tolist()
            ([4, 9, 3, 5, 6], [2, 0, 1, 2])
        """
        keys = names(keys, "from_dense_padded")
        what = f"from_dense_padded {keys}"
        d = as_tensor(dense, what)
        if d.dtype not in INT_DTYPES:
            raise InputError(f"{what}: dense keys must be integers (int32 or int64), got {d.dtype}")
        if d.dim() != 3:
            raise InputError(
                f"{what}: dense keys must be [B, slots, max_nnz], got shape {tuple(d.shape)}"
                + ("; for a single slot use dense.unsqueeze(1)" if d.dim() == 2 else "")
            )
        b, slots, _ = d.shape
        if len(keys) != slots:
            raise InputError(f"{what}: {len(keys)} feature names for {slots} slots; give one name per slot")
        refuse_meta(d, what)
        fm = d.to(torch.int64).transpose(0, 1)  # [slots, B, max_nnz]: feature-major like SparseFeatures
        keep = fm >= 0
        if padding >= 0:
            keep &= fm != padding
        w = None
        if weights is not None:
            w = as_weights(weights, d, what).transpose(0, 1)[keep]
        lengths = keep.sum(dim=2).reshape(-1)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=d.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        # boolean indexing walks the view in (feature, sample, column) order: the jagged order
        return cls(keys, fm[keep], offsets=offsets, weights=w, batch_size=b)

    def to_dense_padded(self, max_nnz: int | None = None, padding: int = -1, with_weights: bool = False):
        """Dense keys ``[B, F, max_nnz]`` with ids at the front of each bag and `padding` after.

        Args:
            max_nnz: width of the last dim; default the longest bag. A longer bag is an
                InputError naming feature and sample: ids are never dropped.
            padding: fill value. An id that is negative or equal to `padding` would read back
                as padding, so it is an InputError too.
            with_weights: also return the weights ``[B, F, max_nnz]`` (0 at padding).

        Returns:
            ids int64 ``[B, F, max_nnz]``, or ``(ids, weights)`` with `with_weights`.
        """
        what = f"to_dense_padded of {list(self.keys())}"
        self._readable(what)
        f, b = self.num_features, self.batch_size
        offsets = self.offsets().to(torch.int64)
        lengths = offsets[1:] - offsets[:-1]
        longest = int(lengths.max()) if lengths.numel() else 0
        if max_nnz is None:
            max_nnz = longest
        elif max_nnz < 0:
            raise InputError(f"{what}: max_nnz must be >= 0, got {max_nnz}")
        bad = first_true(lengths > max_nnz)
        if bad is not None:
            feature, sample = self.bag_location(bad)
            raise InputError(
                f"{what}: feature {feature!r} sample {sample} has {int(lengths[bad])} ids, more than "
                f"max_nnz={max_nnz}; pass a larger max_nnz (ids are never dropped)"
            )
        values = self.values().to(torch.int64)
        clash = values < 0 if padding < 0 else (values < 0) | (values == padding)
        bad = first_true(clash)
        if bad is not None:
            feature, sample = self.id_location(bad)
            raise InputError(
                f"{what}: feature {feature!r} sample {sample} has id {int(values[bad])}, which would "
                f"read back as padding (negative or {padding})"
            )
        bag, col = bag_positions(offsets, values.numel())
        out = torch.full((f * b, max_nnz), padding, dtype=torch.int64, device=values.device)
        out[bag, col] = values
        ids = out.view(f, b, max_nnz).transpose(0, 1).contiguous()
        if not with_weights:
            return ids
        w = self.weights()
        wout = torch.zeros((f * b, max_nnz), dtype=w.dtype, device=w.device)
        wout[bag, col] = w
        return ids, wout.view(f, b, max_nnz).transpose(0, 1).contiguous()

    # -- COO (HugeCTR fprop, TF SparseTensor) -------------------------------------------

    @classmethod
    def from_coo(cls, keys: Mapping[str, tuple] | Sequence[str] | str, row_indices: Any = None,
                 values: Any = None, dense_shape: Any = None, weights: Any = None, *,
                 batch_size: int | None = None) -> "SparseFeatures":
        """From COO: a row index (the sample) per id, as HugeCTR's fprop or a TF SparseTensor.

        Three forms:

        * per feature, ``from_coo({name: (rows, values[, dense_shape[, weights]])})``;
        * one feature, ``from_coo("user", rows, values, dense_shape=None, weights=None)``;
        * HugeCTR slots, ``from_coo(["user", "item"], rows, values, dense_shape)``: rows index
          the keys reshaped to ``[B * slots, max_nnz]``, so row r is sample ``r // slots`` of
          feature ``keys[r % slots]``.

        Rows are ``[n]`` or TF-style indices ``[n, 2]`` (row, column). Rows need not be
        sorted: ids are sorted stably by row, so ids of one row keep their input order; with
        ``[n, 2]`` indices they are ordered by column, and a repeated position is an error.

        Args:
            keys: a dict of features, one feature name, or the names of the slots.
            row_indices: integer ``[n]`` or ``[n, 2]``; each row in ``[0, B)``.
            values: integer ``[n]`` ids.
            dense_shape: ``[B]`` or ``[B, max_nnz]``; B is taken from it, else from
                `batch_size`, else from the largest row (trailing empty samples need one of those).
            weights: optional float ``[n]``.

        Example::

            rows = [2, 0, 0], values = [7, 1, 5], dense_shape = [3]  ->  bags [1, 5] [ ] [7]

            >>> SparseFeatures.from_coo("user", [2, 0, 0], [7, 1, 5], [3]).values().tolist()
            [1, 5, 7]
        """
        what = f"from_coo {list(keys) if isinstance(keys, Mapping) else names(keys, 'from_coo')}"
        if batch_size is not None and batch_size < 0:
            raise InputError(f"{what}: batch_size must be >= 0, got {batch_size}")
        if isinstance(keys, Mapping):
            if row_indices is not None or values is not None or dense_shape is not None or weights is not None:
                raise InputError(f"{what}: with a dict of features, give rows and values inside the dict")
            return cls._from_coo_dict(keys, batch_size, "from_coo")
        if isinstance(keys, str):
            return cls._from_coo_dict({keys: (row_indices, values, dense_shape, weights)}, batch_size, "from_coo")
        return cls._from_coo_slots(names(keys, "from_coo"), row_indices, values, dense_shape, weights, batch_size)

    @classmethod
    def _from_coo_dict(cls, features: Mapping[str, tuple], batch_size: int | None,
                       caller: str) -> "SparseFeatures":
        parsed = []
        ref = f"batch_size={batch_size}" if batch_size is not None else None
        for name, item in features.items():
            what = f"{caller}: feature {name!r}"
            if not isinstance(item, (tuple, list)) or not 2 <= len(item) <= 4:
                raise InputError(f"{what}: expected (rows, values[, dense_shape[, weights]]), got {type(item).__name__}")
            rows, cols = coo_indices(item[0], what)
            ids = as_ids(item[1], what)
            if ids.numel() != rows.numel() or ids.device != rows.device:
                raise InputError(f"{what}: {rows.numel()} row indices on {rows.device} for {ids.numel()} ids on {ids.device}")
            refuse_meta(ids, what)
            shape = parse_shape(item[2] if len(item) > 2 else None, what)
            w = as_weights(item[3], ids, what) if len(item) > 3 and item[3] is not None else None
            if shape is not None:
                if batch_size is None:
                    batch_size, ref = shape[0], f"feature {name!r}"
                elif shape[0] != batch_size:
                    raise InputError(f"{what} has batch size {shape[0]}, but {ref} has {batch_size}")
            parsed.append((name, what, rows, cols, ids, shape, w))
        if batch_size is None:  # no dense_shape anywhere: the largest row decides
            batch_size = max([int(p[2].max()) + 1 for p in parsed if p[2].numel()] + [0])
        parts = []
        for name, what, rows, cols, ids, shape, w in parsed:
            width = shape[1] if shape is not None and len(shape) == 2 else None
            check_below(rows, batch_size, what, "row index")
            if cols is not None:
                check_below(cols, width, what, "column index")
            vals, w, lengths = sort_into_bags(rows, cols, ids, w, batch_size, what, sample_words)
            check_width(lengths, width, what, sample_words)
            parts.append(Part(name, vals, lengths, w))
        return assemble(cls, parts, caller, batch_size)

    @classmethod
    def _from_coo_slots(cls, keys: list[str], row_indices: Any, values: Any, dense_shape: Any,
                        weights: Any, batch_size: int | None) -> "SparseFeatures":
        what = f"from_coo {keys}"
        if row_indices is None or values is None:
            raise InputError(f"{what}: give row_indices and values")
        if not keys:
            raise InputError(f"{what}: give at least one feature name")
        slots = len(keys)
        rows, cols = coo_indices(row_indices, what)
        ids = as_ids(values, what)
        if ids.numel() != rows.numel() or ids.device != rows.device:
            raise InputError(f"{what}: {rows.numel()} row indices on {rows.device} for {ids.numel()} ids on {ids.device}")
        refuse_meta(ids, what)
        w = None if weights is None else as_weights(weights, ids, what)
        shape = parse_shape(dense_shape, what)
        if shape is not None:
            if shape[0] % slots:
                raise InputError(f"{what}: dense_shape[0]={shape[0]} rows do not split into {slots} slots")
            if batch_size is not None and batch_size != shape[0] // slots:
                raise InputError(f"{what}: batch_size={batch_size} but dense_shape gives {shape[0] // slots}")
            batch_size = shape[0] // slots
        elif batch_size is None:
            batch_size = int(rows.max()) // slots + 1 if rows.numel() else 0
        width = shape[1] if shape is not None and len(shape) == 2 else None
        check_below(rows, batch_size * slots, what, "row index")
        if cols is not None:
            check_below(cols, width, what, "column index")
        bags = (rows % slots) * batch_size + rows // slots  # feature-major bag number

        def where(bag: int) -> str:
            return f"feature {keys[bag // batch_size]!r} sample {bag % batch_size}"

        vals, w, lengths = sort_into_bags(bags, cols, ids, w, slots * batch_size, what, where)
        check_width(lengths, width, what, where)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=ids.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls(keys, vals, offsets=offsets, weights=w, batch_size=batch_size)

    def to_coo(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per feature ``(rows, values, weights)``: int64 sample index of each id, sorted.

        Example: bags ``[1, 5] [ ] [7]`` give rows ``[0, 0, 2]``, values ``[1, 5, 7]``.
        """
        self._readable(f"to_coo of {list(self.keys())}")
        out = {}
        for key in self.keys():
            jf = self._feature(key)
            b = torch.arange(jf.batch_size, dtype=torch.int64, device=jf.values.device)
            rows = torch.repeat_interleave(b, jf.lengths().to(torch.int64), output_size=jf.values.numel())
            out[key] = (rows, jf.values.to(torch.int64), jf.weights)
        return out

    # -- torch.sparse_coo_tensor [B, max_len] ------------------------------------------

    @classmethod
    def from_sparse_coo_tensors(cls, tensors: Mapping[str, torch.Tensor],
                                weights: Mapping[str, torch.Tensor] | None = None, *,
                                batch_size: int | None = None) -> "SparseFeatures":
        """From one 2-D ``torch.sparse_coo_tensor`` ``[B, max_len]`` per feature; values are ids.

        Ids of a sample are taken in column order (the coalesced order). An uncoalesced
        tensor is fine, but a position given twice is an error (coalescing would add ids).

        Args:
            tensors: ``{name: sparse [B, max_len] integer tensor}``.
            weights: optional ``{name: sparse float tensor}`` with the same indices.
        """
        weights = {} if weights is None else dict(weights)
        extra = [k for k in weights if k not in tensors]
        if extra:
            raise InputError(f"from_sparse_coo_tensors: weights for unknown feature {extra[0]!r}")
        items = {}
        for name, t in tensors.items():
            what = f"from_sparse_coo_tensors: feature {name!r}"
            idx, vals = sparse_parts(t, what)
            w = None
            if weights:
                if name not in weights:
                    raise InputError(f"{what}: has no weights, but other features do")
                widx, w = sparse_parts(weights[name], f"{what} weights", ids=False)
                if widx.shape != idx.shape or not torch.equal(widx, idx):
                    raise InputError(f"{what}: weights must have the same indices as the ids")
            items[name] = (idx.t(), vals, tuple(t.shape), w)
        return cls._from_coo_dict(items, batch_size, "from_sparse_coo_tensors")

    def to_sparse_coo_tensors(self, max_len: int | None = None, with_weights: bool = False):
        """Per feature a coalesced sparse ``[B, max_len]`` tensor whose values are the ids.

        Args:
            max_len: second dim; default each feature's longest bag. A longer bag is an error.
            with_weights: also return ``{name: sparse float weights}`` with the same indices.

        Returns:
            ``{name: tensor}``, or ``({name: ids}, {name: weights})`` with `with_weights`.
        """
        self._readable(f"to_sparse_coo_tensors of {list(self.keys())}")
        if max_len is not None and max_len < 0:
            raise InputError(f"to_sparse_coo_tensors: max_len must be >= 0, got {max_len}")
        ids_out, w_out = {}, {}
        if with_weights:
            self.weights()  # raises if this batch has none
        for key in self.keys():
            jf = self._feature(key)
            lengths = jf.lengths().to(torch.int64)
            longest = int(lengths.max()) if lengths.numel() else 0
            width = longest if max_len is None else max_len
            bad = first_true(lengths > width)
            if bad is not None:
                raise InputError(
                    f"to_sparse_coo_tensors: feature {key!r} sample {bad} has {int(lengths[bad])} ids, "
                    f"more than max_len={width}"
                )
            rows, cols = bag_positions(jf.offsets, jf.values.numel())
            idx = torch.stack([rows, cols])
            shape = (jf.batch_size, width)
            # built sorted and unique, so it is coalesced by construction; skip the checks
            ids_out[key] = torch.sparse_coo_tensor(idx, jf.values.to(torch.int64), shape,
                                                   is_coalesced=True, check_invariants=False)
            if with_weights:
                w_out[key] = torch.sparse_coo_tensor(idx, jf.weights, shape, is_coalesced=True,
                                                     check_invariants=False)
        return (ids_out, w_out) if with_weights else ids_out
