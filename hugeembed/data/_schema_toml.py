"""The checks of a schema file (the TOML, or the JSON form a manifest stores): every key known, every value
of its kind, each error one line naming the file and the key::

    schema clicks.toml: unknown key sparse.genres.'seperator' (did you mean 'separator'?); known keys: ...

:meth:`Schema.from_dict` (and so ``load_schema``) builds its Schema here; the Schema object itself, its
specs and Criteo's built-in layout are in ``_schema.py``.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Mapping

from ..errors import ConfigError
from ._schema import (CAT_NAMES, COMBINERS, DENSE_NAMES, FORMATS, ID_KINDS, TRANSFORMS, DenseSpec, LabelSpec, Schema,
                      SparseSpec)

__all__ = ["schema_from_dict"]

_TOP_KEYS = ("format", "header", "columns", "delimiter", "label", "dense", "sparse")
_LABEL_KEYS = ("column", "positive", "negative")
_DENSE_KEYS = ("column", "transform", "fill", "mean", "std")
_SPARSE_KEYS = ("column", "ids", "separator", "combiner", "table", "max_length")


def schema_from_dict(data: Any, source: str = "schema") -> Schema:
    """A schema from its TOML/JSON form (:meth:`Schema.from_dict`); ConfigError naming `source` and the key
    for anything wrong."""
    _mapping(data, source)
    _known(data, _TOP_KEYS, source, "")
    fmt = data.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"{source}: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    header = data.get("header", fmt != "criteo")
    if not isinstance(header, bool):
        raise ConfigError(f"{source}: header must be true or false, got {header!r}")
    columns = data.get("columns")
    if columns is not None:
        if not (isinstance(columns, list) and columns and all(isinstance(c, str) and c for c in columns)):
            raise ConfigError(f"{source}: columns must be a list of column names, got {columns!r}")
        dup = sorted({c for c in columns if columns.count(c) > 1})
        if dup:
            raise ConfigError(f"{source}: columns names {dup} twice")
        columns = tuple(columns)
    if fmt == "criteo":
        if columns is not None and columns != ("label", *DENSE_NAMES, *CAT_NAMES):
            raise ConfigError(f"{source}: a criteo file's columns are label, I1..I13, C1..C26: leave columns out")
        if header:
            raise ConfigError(f"{source}: criteo files have no header line: header = false")
        columns = ("label", *DENSE_NAMES, *CAT_NAMES)
    delimiter = data.get("delimiter")
    if delimiter is not None and not (isinstance(delimiter, str) and len(delimiter) == 1 and delimiter not in "\"\n\r"):
        raise ConfigError(f"{source}: delimiter must be one character (not a quote or a newline), got {delimiter!r}")
    if delimiter is not None and fmt in ("parquet", "criteo"):
        raise ConfigError(f"{source}: delimiter applies to csv and tsv files, not {fmt}")
    if fmt in ("csv", "tsv") and not header and columns is None:
        raise ConfigError(f"{source}: header = false needs columns = [...] naming every column in order")
    label = _label(data.get("label"), source)
    dense = tuple(_dense(n, v, source) for n, v in _section(data, "dense", source).items())
    sparse = tuple(_sparse(n, v, source) for n, v in _section(data, "sparse", source).items())
    try:
        return Schema(fmt, header, columns, delimiter, label, dense, sparse)
    except ConfigError as e:
        raise ConfigError(f"{source}: {str(e).removeprefix('schema: ')}") from None


def _mapping(v: Any, where: str) -> None:
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where} must be a table of settings, got {v!r}")


def _known(d: Mapping, keys: tuple[str, ...], source: str, at: str) -> None:
    for k in d:
        if k not in keys:
            close = difflib.get_close_matches(str(k), keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{source}: unknown key {at}{k!r}{hint}; known keys: {', '.join(keys)}")


def _section(data: Mapping, name: str, source: str) -> Mapping:
    sec = data.get(name, {})
    if isinstance(sec, list):  # the saved form (Schema.to_dict): a list of {"name": ..., settings}
        if not all(isinstance(e, Mapping) and isinstance(e.get("name"), str) for e in sec):
            raise ConfigError(f"{source}: {name} must be a table of columns, got {sec!r}")
        sec = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in sec}
        if len(sec) != len(data[name]):
            raise ConfigError(f"{source}: {name} names a column twice")
    _mapping(sec, f"{source}: [{name}]")
    for feature, body in sec.items():
        _mapping(body, f"{source}: [{name}.{feature}]")
        if not feature or "@" in feature or "." in feature:
            raise ConfigError(f"{source}: {name} name {feature!r} must be non-empty, without '@' or '.'")
    return sec


def _string(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{what} must be a non-empty string, got {v!r}")
    return v


def _label(v: Any, source: str) -> LabelSpec | None:
    if v is None:
        return None
    _mapping(v, f"{source}: [label]")
    _known(v, _LABEL_KEYS, source, "label.")
    column = _string(v.get("column"), f"{source}: label.column")
    positive = v.get("positive")
    if positive is not None:
        positive = _string(positive, f"{source}: label.positive")
    negative = v.get("negative", [])
    if isinstance(negative, str):
        negative = [negative]
    if not isinstance(negative, list) or not all(isinstance(x, str) and x for x in negative):
        raise ConfigError(f"{source}: label.negative must be a string or a list of strings, got {negative!r}")
    if negative and positive is None:
        raise ConfigError(f"{source}: label.negative goes with label.positive (the value that is 1)")
    if positive in negative:
        raise ConfigError(f"{source}: label.positive {positive!r} is also in label.negative")
    return LabelSpec(column, positive, tuple(negative))


def _number(v: Any, what: str, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ConfigError(f"{what} must be a {'positive ' if positive else ''}finite number, got {v!r}")
    return float(v)


def _choice(v: Mapping, key: str, default: str, choices, at: str) -> str:
    """v[key] (or the default), which must be one of `choices` (ConfigError naming the key otherwise)."""
    value = v.get(key, default)
    if value not in choices:
        raise ConfigError(f"{at}{key} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _dense(name: str, v: Mapping, source: str) -> DenseSpec:
    at = f"{source}: dense.{name}."
    _known(v, _DENSE_KEYS, source, f"dense.{name}.")
    transform = _choice(v, "transform", "none", TRANSFORMS, at)
    mean, std = v.get("mean"), v.get("std")
    if (mean is not None or std is not None) and transform != "standardize":
        raise ConfigError(f"{at}mean and std apply to transform = \"standardize\"")
    if (mean is None) != (std is None):
        raise ConfigError(f"{at}mean and std go together (or leave both out: they are fitted on the training data)")
    return DenseSpec(name, _string(v.get("column", name), f"{at}column"), transform,
                     _number(v.get("fill", 0.0), f"{at}fill"),
                     None if mean is None else _number(mean, f"{at}mean"),
                     None if std is None else _number(std, f"{at}std", positive=True))


def _sparse(name: str, v: Mapping, source: str) -> SparseSpec:
    at = f"{source}: sparse.{name}."
    _known(v, _SPARSE_KEYS, source, f"sparse.{name}.")
    ids = _choice(v, "ids", "hash", ID_KINDS, at)
    sep = v.get("separator")
    if sep is not None and (not isinstance(sep, str) or sep == "" or "\n" in sep or '"' in sep):
        raise ConfigError(f"{at}separator must be a non-empty string without quotes or newlines, got {sep!r}")
    combiner = _choice(v, "combiner", "sum", COMBINERS, at)
    max_length = v.get("max_length")
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ConfigError(f"{at}max_length must be a positive integer, got {max_length!r}")
        if sep is None:
            raise ConfigError(f"{at}max_length applies to a bag of values: give separator too")
    table = v.get("table")
    if table is not None:
        table = _string(table, f"{at}table")
        if table == name:
            table = None
    return SparseSpec(name, _string(v.get("column", name), f"{at}column"), ids, sep, combiner, table, max_length)
