"""Columns of a file (an Arrow record batch) -> a Block, as a schema says.

Every value is checked; a bad one is an InputError of one line naming the file, the row (and the
line of a text file), the column and the value::

    clicks.csv: row 17 (line 18): column 'age': not a number: 'abc'

Hashed text columns (single values and bags) go through the native encoder (``_cells``: one pass over
pyarrow's buffers); elsewhere, and where the kernels are not built, a column is dictionary-encoded and
each distinct value hashed once (``_hash.hash_utf8``).  Both give ``hash_text``'s ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ._block import Bag, Block
from ._cells import hash_columns, native_cells, split_hash, string_buffers
from ._hash import hash_utf8, hex_utf8
from ._schema import DenseSpec, Schema, SparseSpec, missing_id

__all__ = ["Encoder", "Where", "require_pyarrow"]

_TRUE = ("1", "true", "1.0")
_FALSE = ("0", "false", "0.0")


def require_pyarrow():
    """pyarrow (the ``data`` extra), or an ImportError saying how to install it."""
    try:
        import pyarrow  # noqa: F401
        import pyarrow.compute  # noqa: F401
    except ImportError:
        raise ImportError('reading CSV, TSV and Parquet files needs pyarrow: pip install "hugeembed[data]"') from None
    return pyarrow


@dataclass(frozen=True)
class Where:
    """Where a chunk's rows come from, for messages: row ``first_row + i + 1`` of `source` (1-based data
    rows); text files add the line (``line_offset`` lines precede the data: the header)."""

    source: str
    first_row: int = 0
    line_offset: int | None = None

    def row(self, i: int) -> str:
        r = self.first_row + int(i) + 1
        line = "" if self.line_offset is None else f" (line {r + self.line_offset})"
        return f"{self.source}: row {r}{line}"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_string(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_number(t) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_decimal(t)


def _parts(col) -> list:
    """The arrays of an Array or ChunkedArray."""
    return list(col.chunks) if hasattr(col, "chunks") else [col]


def _whole(col):
    """One Array of an Array or ChunkedArray (a copy only when it has several chunks)."""
    if not hasattr(col, "chunks"):
        return col
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _nulls(arr) -> np.ndarray:
    """bool [n]: which values are null (without a pass over an array that has none)."""
    if arr.null_count == 0:
        return np.zeros(len(arr), bool)
    return np.asarray(arr.is_null().to_numpy(zero_copy_only=False), bool)


def _digit_labels(col) -> np.ndarray | None:
    """The labels of a string column whose every cell is one byte "0" or "1" (the usual label column),
    read straight off its buffers; None for any other column (the general path then reads it)."""
    offsets, data, _ = string_buffers(col)
    if not len(col) or offsets[-1] - offsets[0] != len(col) or not (np.diff(offsets) == 1).all():
        return None
    digits = data[offsets[0]:offsets[-1]]
    if ((digits != 48) & (digits != 49)).any():  # b"0", b"1"
        return None
    return (digits - 48).astype(np.float32)


class Encoder:
    """Turns record batches with the schema's columns into Blocks (:meth:`encode`)."""

    def __init__(self, schema: Schema, *, native: bool | None = None) -> None:
        require_pyarrow()
        self.schema = schema
        # hashed text columns in one native pass (csrc/encode.cpp); the NumPy path gives the same ids
        self.native = native_cells() if native is None else bool(native)
        self.positions = {s.name: j for j, s in enumerate(schema.sparse)}

    def encode(self, batch, where: Where, *, need_label: bool = True) -> Block:
        """A Block of the rows of `batch` (a pyarrow RecordBatch or Table holding the needed columns).
        Without a label column (`need_label` False: serving requests) the labels are zeros."""
        import pyarrow as pa

        if isinstance(batch, pa.Table) and batch.num_rows and any(c.num_chunks > 1 and pa.types.is_dictionary(c.type)
                                                                  for c in batch.columns):
            # one record batch at a time: joining the chunks would merge each chunk's own dictionary
            blocks, row = [], where.first_row
            for rb in batch.to_batches():
                blocks.append(self.encode(rb, Where(where.source, row, where.line_offset), need_label=need_label))
                row += rb.num_rows
            return Block.concat(blocks)
        n = batch.num_rows
        s = self.schema
        dense = np.empty((n, s.num_dense), np.float32)
        for k, d in enumerate(s.dense):
            dense[:, k] = self._dense(d, self._column(batch, d.column, where, whole=False), where)
        cats = np.empty((n, sum(not spec.is_bag for spec in s.sparse)), np.int64)
        bags, j, hashed = [], 0, []
        for spec in s.sparse:
            col = self._column(batch, spec.column, where, whole=False)
            if spec.is_bag:
                bags.append(self._bag(spec, col, where))
            else:
                text = self._single(spec, col, where, cats, j)
                if text is not None:
                    hashed.append((text, missing_id(self.positions[spec.name]), j))
                j += 1
        if hashed:  # the native encoder's columns, in one pass over the rows of cats
            hash_columns(hashed, cats)
        if s.label is not None and (need_label or s.label.column in batch.schema.names):
            labels = self._label(self._column(batch, s.label.column, where), where)
        else:
            labels = np.zeros(n, np.float32)
        return Block(dense, cats, labels, tuple(bags))

    @staticmethod
    def _column(batch, name: str, where: Where, whole: bool = True):
        """Column `name` of `batch`: one Array (`whole`), or as it is (a Table's column comes in chunks, one
        per block the CSV reader parsed: the native kernels and the dense path take them without a copy)."""
        try:
            col = batch.column(name)
        except KeyError:
            raise InputError(f"{where.source}: no column {name!r}; columns: {', '.join(batch.schema.names)}") from None
        return _whole(col) if whole else col

    # -- dense -------------------------------------------------------------------------------

    def _dense(self, d: DenseSpec, col, where: Where) -> np.ndarray:
        import pyarrow as pa
        import pyarrow.compute as pc

        if _is_string(col.type):
            col = _whole(col)
            text = pc.utf8_trim_whitespace(col)
            empty = pc.fill_null(pc.equal(text, ""), True)
            try:
                values = pc.cast(pc.if_else(empty, "0", text), pa.float64())
            except pa.ArrowInvalid:
                raw = text.to_pylist()
                for i, v in enumerate(raw):
                    if v:
                        try:
                            float(v)
                        except ValueError:
                            raise InputError(f"{where.row(i)}: column {d.column!r}: not a number: {_short(v)}") from None
                raise
        elif _is_number(col.type):
            x = np.empty(len(col), np.float64)  # filled chunk by chunk; a null comes out as NaN (missing below)
            row = 0
            for part in _parts(col):
                x[row:row + len(part)] = pc.cast(part, pa.float64()).to_numpy(zero_copy_only=False)
                row += len(part)
            empty = None
        else:
            raise InputError(f"{where.source}: column {d.column!r} holds {col.type}, a dense column needs numbers "
                             f"(or their text)")
        if _is_string(col.type):
            x = values.to_numpy(zero_copy_only=False).astype(np.float64, copy=True)
        missing = np.isnan(x)
        if empty is not None:
            missing |= np.asarray(empty.to_numpy(zero_copy_only=False), bool)
        bad = np.isinf(x)
        if bad.any() and (bad & ~missing).any():
            i = int(np.argmax(bad & ~missing))
            raise InputError(f"{where.row(i)}: column {d.column!r}: not a finite number: {_short(col[i].as_py())}")
        if missing.any():
            x[missing] = d.fill
        if d.transform == "log1p":
            x = np.log1p(np.maximum(x, 0.0, out=x), out=x)
        elif d.transform == "standardize":
            if d.mean is None or d.std is None:
                raise InputError(f"dense column {d.name!r} is standardized but its mean and std were never fitted "
                                 f"(hugeembed.data.fit_stats, or train / convert, fit them)")
            x = (x - d.mean) / d.std
        return x.astype(np.float32)

    # -- label -------------------------------------------------------------------------------

    def _label(self, col, where: Where) -> np.ndarray:
        import pyarrow as pa
        import pyarrow.compute as pc

        lab = self.schema.label
        assert lab is not None
        null = _nulls(col)
        if null.any():
            i = int(np.argmax(null))
            raise InputError(f"{where.row(i)}: column {lab.column!r}: the label is empty")
        if lab.positive is None and pa.types.is_string(col.type):
            digits = _digit_labels(col)
            if digits is not None:
                return digits
        if lab.positive is not None:
            text = np.asarray(pc.cast(col, pa.string()).to_numpy(zero_copy_only=False), dtype=object)
            y = text == lab.positive
            if lab.negative:
                bad = ~(y | np.isin(text, list(lab.negative)))
                if bad.any():
                    i = int(np.argmax(bad))
                    raise InputError(f"{where.row(i)}: column {lab.column!r}: label {_short(text[i])} is neither "
                                     f"positive {lab.positive!r} nor negative {list(lab.negative)}")
            return y.astype(np.float32)
        if pa.types.is_boolean(col.type):
            return np.asarray(col.to_numpy(zero_copy_only=False), np.float32)
        if _is_number(col.type):
            y = col.to_numpy(zero_copy_only=False).astype(np.float64)
            bad = (y != 0) & (y != 1)
            if bad.any():
                i = int(np.argmax(bad))
                raise InputError(f"{where.row(i)}: column {lab.column!r}: label must be 0 or 1, got "
                                 f"{_short(col[i].as_py())} (or set label.positive)")
            return y.astype(np.float32)
        if not _is_string(col.type):
            raise InputError(f"{where.source}: column {lab.column!r} holds {col.type}, a label is 0/1, true/false "
                             f"or text with label.positive")
        text = pc.utf8_lower(pc.utf8_trim_whitespace(col))
        one = np.asarray(pc.is_in(text, value_set=pa.array(_TRUE)).to_numpy(zero_copy_only=False), bool)
        zero = np.asarray(pc.is_in(text, value_set=pa.array(_FALSE)).to_numpy(zero_copy_only=False), bool)
        bad = ~(one | zero)
        if bad.any():
            i = int(np.argmax(bad))
            raise InputError(f"{where.row(i)}: column {lab.column!r}: label must be 0/1 or true/false, got "
                             f"{_short(col[i].as_py())} (or set label.positive = the value that is 1)")
        return one.astype(np.float32)

    # -- sparse ------------------------------------------------------------------------------

    def _ids(self, spec: SparseSpec, values, where: Where, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, present) of a flat array of values (strings or integers); `rows` maps a value to its row
        for messages (None: the i-th value is row i).  Null and empty values are not present."""
        import pyarrow as pa
        import pyarrow.compute as pc

        t = values.type
        row = (lambda i: int(i)) if rows is None else (lambda i: int(rows[i]))
        if spec.ids in ("hash", "hex"):
            if pa.types.is_dictionary(t):  # dictionary-encoded by the CSV reader as it parsed
                enc = values
            elif _is_string(t):
                enc = values.dictionary_encode()
            elif spec.ids == "hash" and _is_number(t) and not pa.types.is_decimal(t):
                enc = pc.cast(values, pa.string()).dictionary_encode()
            else:
                raise InputError(f"{where.source}: column {spec.column!r} holds {t}: "
                                 + ("categorical values are text or integers" if spec.ids == "hash"
                                    else 'ids = "hex" needs text'))
            offsets, data, _ = string_buffers(enc.dictionary)
            # a null value's index is null: 0 stands in for it (it is not present), NumPy takes no nulls
            idx = np.asarray(pc.fill_null(enc.indices, 0).to_numpy(zero_copy_only=False), np.int64)
            present = ~_nulls(enc.indices)
            empty_code = np.flatnonzero(np.diff(offsets) == 0)
            if empty_code.size:
                present &= idx != empty_code[0]
            if spec.ids == "hash":
                table = hash_utf8(offsets, data)
            else:
                table, bad_code = hex_utf8(offsets, data)
                bad = present & bad_code[np.where(present, idx, 0)] if table.size else present & False
                if bad.any():
                    i = int(np.argmax(bad))
                    raise InputError(f"{where.row(row(i))}: column {spec.column!r}: not a hex id of 1-15 digits: "
                                     f"{_short(enc[i].as_py())}")
            ids = table[np.where(present, idx, 0)] if table.size else np.zeros(len(values), np.int64)
            return ids, present
        if spec.ids == "int":
            if _is_string(t):
                text = pc.utf8_trim_whitespace(values)
                present = ~np.asarray(pc.fill_null(pc.equal(text, ""), True).to_numpy(zero_copy_only=False), bool)
                try:
                    ints = pc.cast(pc.if_else(pa.array(present), text, "0"), pa.int64())
                except pa.ArrowInvalid:
                    for i, v in enumerate(text.to_pylist()):
                        if v:
                            try:
                                int(v)
                            except ValueError:
                                raise InputError(f"{where.row(row(i))}: column {spec.column!r}: not an integer id: "
                                                 f"{_short(v)}") from None
                    raise
            elif pa.types.is_integer(t):
                present = ~_nulls(values)
                ints = pc.fill_null(values, 0).cast(pa.int64())
            else:
                raise InputError(f"{where.source}: column {spec.column!r} holds {t}: ids = \"int\" needs integers")
            ids = np.asarray(ints.to_numpy(zero_copy_only=False), np.int64)
            neg = present & (ids < 0)
            if neg.any():
                i = int(np.argmax(neg))
                raise InputError(f"{where.row(row(i))}: column {spec.column!r}: id {int(ids[i])} < 0 (ids = \"int\" "
                                 f"takes ids >= 0; ids = \"hash\" takes any value)")
            return ids, present

    def _single(self, spec: SparseSpec, col, where: Where, cats: np.ndarray, j: int):
        """Column `j` of `cats`: the feature's id in each row; or, where the native encoder hashes the column,
        its text (the caller hashes all such columns together)."""
        import pyarrow as pa

        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            raise InputError(f"{where.source}: column {spec.column!r} holds lists ({col.type}): give "
                             f"sparse.{spec.name} a separator to read it as a bag")
        missing = missing_id(self.positions[spec.name])
        if self.native and spec.ids == "hash":
            if _is_string(col.type):
                return col
            if _is_number(col.type) and not pa.types.is_decimal(col.type):  # a number hashes as its text
                return col.cast(pa.string())
        ids, present = self._ids(spec, _whole(col), where, None)
        cats[:, j] = np.where(present, ids, missing)
        return None

    def _bag(self, spec: SparseSpec, col, where: Where, distinct: bool = False) -> Bag:
        import pyarrow as pa
        import pyarrow.compute as pc

        n = len(col)
        if self.native and spec.ids == "hash" and _is_string(col.type):
            return split_hash(col, spec.separator, spec.max_length, missing_id(self.positions[spec.name]))
        col = _whole(col)
        if pa.types.is_dictionary(col.type):  # the distinct cells' bags, then each row its cell's
            cells = self._bag(spec, pc.fill_null(col.dictionary, ""), where, distinct=True)
            idx = col.indices.to_numpy(zero_copy_only=False) if col.null_count == 0 else \
                pc.fill_null(col.indices, -1).to_numpy(zero_copy_only=False)
            if (idx < 0).any():  # a null cell: an empty one
                return Bag.concat([cells, self._bag(spec, pa.array([""]), where)]).take(
                    np.where(idx < 0, len(cells), idx))
            return cells.take(idx)
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            lists = col
        elif _is_string(col.type) and spec.ids == "hash" and not distinct:  # each distinct cell split once
            return self._bag(spec, col.dictionary_encode(), where)
        elif _is_string(col.type):
            lists = pc.split_pattern(col, spec.separator)
        else:  # a column of single numbers read as bags of one
            lists = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), col)
        items = pc.list_flatten(lists)
        parents = np.asarray(pc.list_parent_indices(lists).to_numpy(zero_copy_only=False), np.int64)
        ids, present = self._ids(spec, items, where, parents)
        if present.all() and lists.null_count == 0:  # no empty item: the lists' own lengths
            lengths = np.asarray(pc.list_value_length(lists).to_numpy(zero_copy_only=False), np.int64)
        else:
            ids, parents = ids[present], parents[present]
            lengths = np.bincount(parents, minlength=n).astype(np.int64)
        if spec.max_length is not None and lengths.size and lengths.max() > spec.max_length:
            starts = np.zeros(n + 1, np.int64)
            np.cumsum(lengths, out=starts[1:])
            rank = np.arange(ids.size, dtype=np.int64) - starts[parents]  # position within the row
            keep = rank >= (lengths - spec.max_length)[parents]          # the last max_length of each row
            ids, parents = ids[keep], parents[keep]
            lengths = np.minimum(lengths, spec.max_length)
        empty = lengths == 0
        if empty.any():  # an empty cell is one missing id, as a single-valued feature's
            before = np.cumsum(empty) - empty  # empty rows before each row: how far its items move
            out = np.full(ids.size + int(empty.sum()), missing_id(self.positions[spec.name]), np.int64)
            out[np.arange(ids.size) + before[parents]] = ids
            ids = out
            lengths[empty] = 1
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Bag(np.ascontiguousarray(ids, np.int64), offsets)
