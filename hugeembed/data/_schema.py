"""The schema of a click log: which column is the label, which are dense, which are sparse, and how each
becomes model input.  A TOML file (docs/data.md); Criteo's layout is the built-in one (``criteo.toml``)::

    format = "csv"                  # csv | tsv | parquet | criteo (default: from the file's extension)
    header = true                   # csv/tsv: the first line names the columns (else columns = [...])
    [label]
    column = "clicked"              # 0/1 or true/false; or positive = ">50K" (rows equal to it are 1)
    [dense.age]
    transform = "log1p"             # none | log1p | standardize; fill = 0 for empty cells
    [sparse.genres]
    separator = "|"                 # a bag of values per cell
    combiner = "mean"               # sum | mean | sqrtn
    [sparse.history]
    separator = " "
    table = "movie_id"              # reads the rows of feature movie_id
    max_length = 20                 # keeps the last 20 values

A key the schema does not know is an error naming it (a typo is never ignored; the file's checks are
in ``_schema_toml.py``).  The Criteo
constants below (``N_DENSE``, ``CAT_NAMES``, ``MISSING_IDS`` ...) describe the built-in schema;
``missing_id`` gives the id of an empty cell of sparse feature j of any schema: ``2**32 + j``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = [
    "N_DENSE", "N_CAT", "N_FIELDS", "DENSE_NAMES", "CAT_NAMES", "MISSING_ID_BASE", "MISSING_IDS", "missing_id",
    "field_name", "Schema", "LabelSpec", "DenseSpec", "SparseSpec", "load_schema", "criteo_schema", "FORMATS",
    "TRANSFORMS", "ID_KINDS", "CRITEO_SCHEMA_PATH", "format_of",
]

N_DENSE = 13
N_CAT = 26
N_FIELDS = 1 + N_DENSE + N_CAT
DENSE_NAMES: tuple[str, ...] = tuple(f"I{i}" for i in range(1, N_DENSE + 1))
CAT_NAMES: tuple[str, ...] = tuple(f"C{i}" for i in range(1, N_CAT + 1))
MISSING_ID_BASE = 1 << 32
MISSING_IDS: tuple[int, ...] = tuple(MISSING_ID_BASE + j for j in range(N_CAT))
CRITEO_SCHEMA_PATH = Path(__file__).with_name("criteo.toml")

FORMATS = ("csv", "tsv", "parquet", "criteo")
TRANSFORMS = ("none", "log1p", "standardize")
ID_KINDS = ("hash", "int", "hex")
COMBINERS = ("sum", "mean", "sqrtn")
_EXTENSIONS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet"}


def missing_id(feature: int | str) -> int:
    """The id of an empty cell of sparse feature `feature`: ``2**32 + j`` for the j-th feature of a schema.

    Args:
        feature: a Criteo name ``"C1"`` .. ``"C26"``, or the position j of a feature in its schema.

    Ids parsed from hex are below ``2**32`` and hashed ids have bit 62 set, so a missing id is
    never a real one; it differs per feature, so features sharing a table keep their "missing" apart.

    Example::

        >>> missing_id("C1"), missing_id(25)
        (4294967296, 4294967321)
    """
    if isinstance(feature, str):
        if feature not in CAT_NAMES:
            raise KeyError(f"no categorical feature {feature!r}; features are C1..C26")
        return MISSING_IDS[CAT_NAMES.index(feature)]
    if not 0 <= feature < 1 << 31:
        raise IndexError(f"sparse feature position {feature} out of range")
    return MISSING_ID_BASE + feature


def field_name(field: int) -> str:
    """Name of field `field` of a Criteo line: 0 = "label", 1..13 = I1..I13, 14..39 = C1..C26."""
    if field == 0:
        return "label"
    if 1 <= field <= N_DENSE:
        return DENSE_NAMES[field - 1]
    return CAT_NAMES[field - 1 - N_DENSE]


def format_of(path: str | Path) -> str | None:
    """The format a file's extension names (``x.csv.gz`` -> csv), or None."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return _EXTENSIONS.get(suffixes[-1]) if suffixes else None


@dataclass(frozen=True)
class LabelSpec:
    """The label column: values 0/1 or true/false, or `positive` (its value is 1) and optionally
    `negative` (the values that are 0; any other value is an error)."""

    column: str
    positive: str | None = None
    negative: tuple[str, ...] = ()


@dataclass(frozen=True)
class DenseSpec:
    """A numeric column: an empty cell reads `fill`, then `transform` (log1p is ``log(1 + max(x, 0))``;
    standardize is ``(x - mean) / std``, mean and std from the training data unless given)."""

    name: str
    column: str
    transform: str = "none"
    fill: float = 0.0
    mean: float | None = None
    std: float | None = None


@dataclass(frozen=True)
class SparseSpec:
    """A categorical column: one value per cell, or a bag (`separator`), its last `max_length` values kept;
    ids hashed from the text (``hash``), the integer itself (``int``) or the hex value (``hex``)."""

    name: str
    column: str
    ids: str = "hash"
    separator: str | None = None
    combiner: str = "sum"
    table: str | None = None
    max_length: int | None = None

    @property
    def is_bag(self) -> bool:
        return self.separator is not None


@dataclass(frozen=True)
class Schema:
    """A validated schema (build it with :func:`load_schema` or :meth:`from_dict`).

    ``dense`` and ``sparse`` keep the file's order: a batch's dense matrix has the dense columns in
    that order, its SparseFeatures the sparse features.  ``table_of(name)`` is the table a feature
    reads (its own name, or the feature its `table` names).
    """

    format: str | None = None
    header: bool = True
    columns: tuple[str, ...] | None = None
    delimiter: str | None = None
    label: LabelSpec | None = None
    dense: tuple[DenseSpec, ...] = ()
    sparse: tuple[SparseSpec, ...] = ()

    def __post_init__(self) -> None:
        names = [d.name for d in self.dense] + [s.name for s in self.sparse]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"schema: {dup} named both as dense and as sparse")
        if not self.sparse and not self.dense:
            raise ConfigError("schema: names no dense and no sparse column: a model needs input")
        sparse = {s.name: s for s in self.sparse}
        for s in self.sparse:
            if s.table is None:
                continue
            owner = sparse.get(s.table)
            if owner is None:
                raise ConfigError(f"schema: sparse.{s.name}.table = {s.table!r} names no sparse feature; "
                                  f"features: {sorted(sparse)}")
            if owner.table is not None:
                raise ConfigError(f"schema: sparse.{s.name}.table = {s.table!r}, which itself reads table "
                                  f"{owner.table!r}: name {owner.table!r} directly")
        for owner, members in self.tables().items():
            combiners = {sparse[m].combiner for m in members if sparse[m].is_bag}
            if len(combiners) > 1:
                raise ConfigError(f"schema: features {list(members)} share table {owner!r} but pool their bags "
                                  f"differently ({sorted(combiners)}): give them one combiner")
        if self.columns is not None:
            known = set(self.columns)
            needed = self.needed_columns()
            lacking = [c for c in needed if c not in known]
            if lacking:
                raise ConfigError(f"schema: columns {lacking} are not in columns = {list(self.columns)}")

    # -- what the schema says -------------------------------------------------------------------

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    @property
    def sparse_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sparse)

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dense)

    def table_of(self, feature: str) -> str:
        spec = next(s for s in self.sparse if s.name == feature)
        return spec.table or spec.name

    def tables(self) -> dict[str, tuple[str, ...]]:
        """Table name -> the features that read it, in schema order."""
        out: dict[str, list[str]] = {}
        for s in self.sparse:
            out.setdefault(s.table or s.name, []).append(s.name)
        return {k: tuple(v) for k, v in out.items()}

    def table_combiner(self, table: str) -> str:
        """How a table's bags pool: its bag features' combiner (single values pool the same either way)."""
        members = self.tables()[table]
        bags = [s.combiner for s in self.sparse if s.name in members and s.is_bag]
        return bags[0] if bags else next(s.combiner for s in self.sparse if s.name == members[0])

    def needed_columns(self) -> list[str]:
        cols = ([self.label.column] if self.label else []) + [d.column for d in self.dense] + \
            [s.column for s in self.sparse]
        return list(dict.fromkeys(cols))

    def resolved_format(self, path: str | Path) -> str:
        """The schema's format, or the one `path`'s extension names; ConfigError when neither says."""
        if self.format is not None:
            return self.format
        fmt = format_of(path)
        if fmt is None:
            raise ConfigError(f"{path}: cannot tell the format from the file name; set format = "
                              f"\"csv\", \"tsv\", \"parquet\" or \"criteo\" in the schema")
        return fmt

    def needs_stats(self) -> bool:
        """True while a standardize column lacks its mean and std (fit them on the training data)."""
        return any(d.transform == "standardize" and (d.mean is None or d.std is None) for d in self.dense)

    def with_stats(self, stats: Mapping[str, tuple[float, float]]) -> "Schema":
        """The schema with (mean, std) of its standardize columns set from `stats` (by dense name)."""
        dense = tuple(dataclasses.replace(d, mean=float(stats[d.name][0]), std=float(stats[d.name][1]))
                      if d.transform == "standardize" and d.name in stats else d for d in self.dense)
        return dataclasses.replace(self, dense=dense)

    def without_stats(self) -> "Schema":
        dense = tuple(dataclasses.replace(d, mean=None, std=None) if d.transform == "standardize" else d
                      for d in self.dense)
        return dataclasses.replace(self, dense=dense)

    def fingerprint(self) -> str:
        """sha256 of the schema without fitted statistics: two runs read data alike iff they agree."""
        text = json.dumps(self.without_stats().to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def is_criteo(self) -> bool:
        """True when this is the built-in Criteo layout, which the native Criteo parser reads."""
        return self.without_stats() == criteo_schema()

    def describe(self) -> list[str]:
        """A few lines for people: label, dense columns, sparse features (bags, tables they share)."""
        lines = []
        if self.label is not None:
            lab = self.label
            lines.append(f"label   {lab.column}" + (f" (1 = {lab.positive!r})" if lab.positive is not None else ""))
        if self.dense:
            lines.append("dense   " + ", ".join(d.name + ("" if d.transform == "none" else f" ({d.transform})")
                                                for d in self.dense))
        parts = []
        for sp in self.sparse:
            notes = [] if sp.ids == "hash" else [f"ids {sp.ids}"]
            if sp.is_bag:
                notes.append(f"bag {sp.separator!r}, {sp.combiner}"
                             + (f", last {sp.max_length}" if sp.max_length else ""))
            if sp.table:
                notes.append(f"table {sp.table}")
            parts.append(sp.name + (f" ({'; '.join(notes)})" if notes else ""))
        lines.append("sparse  " + ", ".join(parts))
        return lines

    # -- (de)serialising ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"header": self.header}
        if self.format is not None:
            out["format"] = self.format
        if self.columns is not None:
            out["columns"] = list(self.columns)
        if self.delimiter is not None:
            out["delimiter"] = self.delimiter
        if self.label is not None:
            lab: dict[str, Any] = {"column": self.label.column}
            if self.label.positive is not None:
                lab["positive"] = self.label.positive
            if self.label.negative:
                lab["negative"] = list(self.label.negative)
            out["label"] = lab
        # lists, not tables: the order is the model's (a JSON writer may sort a table's keys)
        out["dense"] = [{k: v for k, v in (("name", d.name), ("column", d.column), ("transform", d.transform),
                                           ("fill", d.fill), ("mean", d.mean), ("std", d.std)) if v is not None}
                        for d in self.dense]
        out["sparse"] = [{k: v for k, v in (("name", s.name), ("column", s.column), ("ids", s.ids),
                                            ("separator", s.separator), ("combiner", s.combiner), ("table", s.table),
                                            ("max_length", s.max_length)) if v is not None}
                         for s in self.sparse]
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "schema") -> "Schema":
        """A schema from its TOML/JSON form; ConfigError naming `source` and the key for anything wrong."""
        from ._schema_toml import schema_from_dict  # the checks of the file build this module's classes

        return schema_from_dict(data, source)


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The TOML file `path` as a dict; ConfigError naming the `what` file ("schema", "config") otherwise."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} file {path} is a directory, not a TOML file") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} file {path} is not valid TOML: {e}") from None


def load_schema(path: str | Path) -> Schema:
    """The schema in TOML file `path`; ConfigError naming the file and the key for anything wrong."""
    return Schema.from_dict(read_toml(path, "schema"), source=f"schema {path}")


@lru_cache(maxsize=1)
def criteo_schema() -> Schema:
    """The built-in schema (``hugeembed/data/criteo.toml``): Criteo's 40 tab-separated fields."""
    return load_schema(CRITEO_SCHEMA_PATH)
