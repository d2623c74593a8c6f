"""The plan of a fused lookup (which feature reads which table, dim groups) over its specs
(functional/_specs.py), and what a prepared batch carries (`Prepared`).

A plan is built once from table and feature specs and reused for every batch: it
holds the small index arrays the kernels read, so a lookup does no per-feature
Python work beyond dispatching one kernel per stage (and one pool per dim group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import NoReturn, Sequence

import torch

from .._device import canonical_device, host_to_device
from ..errors import ConfigError, InputError
from ..types import Combiner, OutOfRange
from ._specs import FeatureSpec, TableSpec

__all__ = ["LookupPlan", "DimGroup", "Prepared", "raise_offsets_error"]


@dataclass(frozen=True)
class DimGroup:
    """Features of one embedding dim: pooled ones share one output [B, F_g, D]."""

    dim: int
    pooled: tuple[int, ...]  # plan feature indices, plan order
    unpooled: tuple[int, ...]


@dataclass
class Prepared:
    """A batch after clean + dedup: what the fetch and pool stages consume.

    ``inverse[j]`` is the global unique index of kept id j; table t's unique keys
    are ``unique_keys[unique_base[t] : unique_base[t] + unique_count[t]]``.
    Slots are looked up per table and written to a global slots array of
    ``capacity`` entries at the same positions.
    """

    batch_size: int
    offsets: torch.Tensor  # int64 [F*B + 1], cleaned bags in plan order
    inverse: torch.Tensor  # int32 (native) or int64 (torch) [N_kept]
    weights: torch.Tensor | None  # [N_kept]
    unique_keys: torch.Tensor  # int64 [capacity]
    unique_counts: torch.Tensor  # int32/int64 [capacity]
    unique_base: list[int]
    unique_count: list[int]
    capacity: int
    native: bool
    deduplicated: bool = True  # False: one entry per id (forward only: no backward may use it)
    weights_require_grad: bool = False  # the batch's weights did; `weights` carries their graph only if
    #                                      prepared with grad enabled, by the torch path
    feature_starts: list[int] | None = None  # offsets[f * B] for f in 0..F, on the host (the torch path's)
    runs: object | None = None  # the triton prepare's sorted runs (_triton/dedup.Dedup over its entries, by unique
    #                             key; tables: each key's lookup table): the fused update reads them
    bags: torch.Tensor | None = None  # int64 [N_kept]: each kept id's bag f * B + b (the torch prepare's)
    # the native prepare's unique_base then unique_count, int64 [2T] (the backward kernel's buffer)
    native_counts: torch.Tensor | None = None
    # what the prepare proved, per table: its unique keys in [0, n) (n: the table's num_rows; None: a dynamic
    # table's, any key), their counts >= 1; () when unknown.  A static fetch need not check these keys again.
    id_bounds: tuple[int | None, ...] = ()
    # what the torch stages derive from the batch alone, made once for the forward and its backward
    # (functional/_reference.py: a group's id positions and bag divisors)
    derived: dict = field(default_factory=dict, repr=False, compare=False)
    # the tables' unique keys lie end to end from 0 (no gaps: every slot belongs to a table), as the torch and
    # triton prepares lay them out; False: unknown (the native prepare leaves gaps)
    packed: bool = False
    # int64 [n_unique]: each unique key's table (the torch and triton prepares': packed, no gaps), or None
    unique_tables: torch.Tensor | None = None

    def keys_of(self, t: int) -> torch.Tensor:
        b = self.unique_base[t]
        return self.unique_keys[b : b + self.unique_count[t]]

    def counts_of(self, t: int) -> torch.Tensor:
        b = self.unique_base[t]
        return self.unique_counts[b : b + self.unique_count[t]]

    def per_table(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Table t's part ``x[unique_base[t] : unique_base[t] + unique_count[t]]`` of an array laid
        out like `unique_keys` (``capacity`` long), for every table: views made by one split op,
        not one slice per table (each op is a kernel launch on a GPU)."""
        sizes, pos = [], 0
        for b, n in zip(self.unique_base, self.unique_count):
            if b < pos:  # parts out of table order (never made by prepare): slice them one by one
                return [x[b : b + n] for b, n in zip(self.unique_base, self.unique_count)]
            sizes += [b - pos, n]
            pos = b + n
        sizes.append(x.shape[0] - pos)
        return list(x.split(sizes)[1::2])


class LookupPlan:
    """Tables and features of a fused lookup, validated and indexed for the kernels.

    Args:
        tables: the tables, in order (table index = position).
        features: the outputs, in order.
    """

    def __init__(self, tables: Sequence[TableSpec], features: Sequence[FeatureSpec]) -> None:
        self.tables = tuple(tables)
        self.features = tuple(features)
        self.table_index = {t.name: i for i, t in enumerate(self.tables)}
        if len(self.table_index) != len(self.tables):
            raise ConfigError(f"duplicate table names in {[t.name for t in self.tables]}")
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"duplicate feature output names {dup}: give each a distinct name (use source=)")
        for f in self.features:
            if f.table not in self.table_index:
                raise ConfigError(f"feature {f.name!r} reads unknown table {f.table!r}; tables: {list(self.table_index)}")
            t = self.tables[self.table_index[f.table]]
            if f.default_id is not None and t.num_rows is not None and not 0 <= f.default_id < t.num_rows:
                raise ConfigError(
                    f"feature {f.name!r}: default_id {f.default_id} is outside table {t.name!r} of {t.num_rows} rows"
                )
        self.feature_index = {f.name: i for i, f in enumerate(self.features)}
        self.id_bounds = tuple(t.num_rows for t in self.tables)  # what a prepare proves of each table's ids
        self.feature_table = [self.table_index[f.table] for f in self.features]
        # what the torch prepare must do at all (functional/_reference.py): prune negative ids, give
        # empty pooled bags their default id, and what ids out of a static table's range do
        self.prunes_negative = any(f.prune_negative for f in self.features)
        self.fills_empty = any(f.default_id is not None and f.combiner is not Combiner.NONE for f in self.features)
        self.range_policies = frozenset(f.out_of_range for f, t in zip(self.features, self.feature_table)
                                        if self.tables[t].num_rows is not None)
        # dim groups, in order of first appearance
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for i, f in enumerate(self.features):
            d = self.tables[self.feature_table[i]].dim
            pooled, unpooled = groups.setdefault(d, ([], []))
            (unpooled if f.combiner is Combiner.NONE else pooled).append(i)
        self.groups = tuple(DimGroup(d, tuple(p), tuple(u)) for d, (p, u) in groups.items())
        # dim groups whose pooled features all sum: every bag's divisor is 1, known without a pass
        self.summed_groups = frozenset(g for g in self.groups if all(self.features[f].combiner is Combiner.SUM
                                                                     for f in g.pooled))
        # features of each table, CSR
        by_table: list[list[int]] = [[] for _ in self.tables]
        for i, t in enumerate(self.feature_table):
            by_table[t].append(i)
        self.table_features = tuple(tuple(x) for x in by_table)
        self._pooled_names = tuple(f.name for f in self.features if f.combiner is not Combiner.NONE)
        by_dim: dict[int, list[int]] = {}
        for t, spec in enumerate(self.tables):
            by_dim.setdefault(spec.dim, []).append(t)
        self.tables_by_dim = {d: tuple(ts) for d, ts in by_dim.items()}  # tables of each dim, in order
        self.clipped = tuple(t for t, spec in enumerate(self.tables) if spec.max_norm)  # tables with max_norm
        self._arrays: dict[torch.device, dict[str, torch.Tensor]] = {}
        # a batch's keys -> (each plan feature's input position, the most features reading one input)
        self._sources: dict[tuple[str, ...], tuple[tuple[int, ...], int]] = {}
        self._constants: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
        self._unread_cache: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        self._memo: dict[tuple, object] = {}

    @property
    def num_features(self) -> int:
        return len(self.features)

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    def pooled_names(self) -> tuple[str, ...]:
        return self._pooled_names

    def arrays(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Per-feature and per-table index arrays on `device` (cached)."""
        device = canonical_device(device)
        cached = self._arrays.get(device)
        if cached is not None:
            return cached
        feats, tabs = self.features, self.tables
        i64 = dict(dtype=torch.int64, device=device)
        i8 = dict(dtype=torch.int8, device=device)
        combiner_code = {Combiner.SUM: 0, Combiner.MEAN: 1, Combiner.SQRTN: 2, Combiner.NONE: 3}
        oor_code = {OutOfRange.ERROR: 0, OutOfRange.PRUNE: 1, OutOfRange.DEFAULT: 2}
        order = [i for fs in self.table_features for i in fs]
        ptr = [0]
        for fs in self.table_features:
            ptr.append(ptr[-1] + len(fs))
        a = {
            "table": torch.tensor(self.feature_table, **i64),
            "num_rows": torch.tensor([-1 if t.num_rows is None else t.num_rows for t in tabs], **i64),
            "prune_neg": torch.tensor([int(f.prune_negative) for f in feats], **i8),
            "oor": torch.tensor([oor_code[f.out_of_range] for f in feats], **i8),
            "has_default": torch.tensor([int(f.default_id is not None) for f in feats], **i8),
            "default_id": torch.tensor([f.default_id or 0 for f in feats], **i64),
            "combiner": torch.tensor([combiner_code[f.combiner] for f in feats], **i8),
            "max_norm": torch.tensor([t.max_norm or 0.0 for t in tabs], dtype=torch.float32, device=device),
            "dims": torch.tensor([t.dim for t in tabs], **i64),
            "table_feat_ptr": torch.tensor(ptr, **i64),
            "table_feats": torch.tensor(order, dtype=torch.int64, device=device),
        }
        self._arrays[device] = a
        return a

    def memo(self, key: tuple, make):
        """``make()``, made once per `key` (a constant of the plan that a stage derives from it, e.g. per dim
        group and device): no walk over the features per call."""
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = make()
        return got

    def linear_keys(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int | None]:
        """(each table's first key, the sentinel key past every key) for one sort of linear keys ``base[t] + id``
        when every table is static (its ids, range-checked, in [0, num_rows)); (zeros, None) when a table is
        dynamic (any int64 id: a sort by id, then by table)."""
        return self.memo(("linear keys", canonical_device(device)), lambda: self._linear_keys(device))

    def _linear_keys(self, device) -> tuple[torch.Tensor, int | None]:
        rows = [t.num_rows for t in self.tables]
        if any(r is None for r in rows) or sum(rows) >= 2**62:
            return self.on_device((0,) * len(rows), device), None
        return self.on_device(tuple(accumulate(rows[:-1], initial=0)), device), sum(rows)

    def on_device(self, values: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 `values` (a constant of the plan: a dim group's features, a batch layout's
        source positions) on `device`, made once: no copy to the device per batch."""
        device = canonical_device(device)
        t = self._constants.get((values, device))
        if t is None:
            t = self._constants[(values, device)] = host_to_device(list(values), torch.int64, device)
        return t

    def _source(self, keys: tuple[str, ...]) -> tuple[tuple[int, ...], int]:
        got = self._sources.get(keys)
        if got is None:
            pos = {k: i for i, k in enumerate(keys)}
            missing = [f.source_name for f in self.features if f.source_name not in pos]
            if missing:
                raise InputError(f"batch lacks features {missing} needed by the lookup; batch has {list(keys)}")
            src = tuple(pos[f.source_name] for f in self.features)
            got = self._sources[keys] = (src, max((src.count(i) for i in set(src)), default=0))
        return got

    def source_indices(self, keys: tuple[str, ...], device: torch.device | str = "cpu") -> torch.Tensor:
        """For each plan feature, the position of its input feature in a batch with `keys` (on
        `device`)."""
        return self.on_device(self._source(keys)[0], device)

    def reads_in_order(self, keys: tuple[str, ...]) -> bool:
        """Whether plan feature f reads input feature f of a batch with `keys`, for every f (the usual
        layout: the batch's bags of the plan's features are its first bags, in order)."""
        return self.memo(("in order", keys), lambda: self._source(keys)[0] == tuple(range(self.num_features)))

    def source_reads(self, keys: tuple[str, ...]) -> int:
        """The most plan features that read one input feature of a batch with `keys` (usually 1):
        the plan reads at most that many times the batch's ids."""
        return self._source(keys)[1]

    def check_batch(self, sf, ends: bool = True) -> None:
        """O(1) checks of a batch: dtypes, devices and, on CPU and when `ends`, where its offsets
        start and end (:meth:`check_ends`).

        The per-bag checks (offsets never decreasing, ids in range, finite weights) run inside
        the prepare stage, which walks the bags anyway; the torch prepare folds the offset ends
        into its one read of the device too, so its callers pass ``ends=False``.
        """
        from ..features import SparseFeatures

        if not isinstance(sf, SparseFeatures):
            wanted = sorted({f.source_name for f in self.features})
            raise InputError(f"lookup of features {wanted} needs a SparseFeatures batch, got {type(sf).__name__}")
        keys = list(sf.keys())
        values, offsets = sf.values(), sf.offsets()
        if values.dtype != torch.int64:
            raise InputError(f"features {keys}: ids must be int64, got {values.dtype}")
        if offsets.dtype not in (torch.int32, torch.int64):
            raise InputError(f"features {keys}: offsets must be int32 or int64, got {offsets.dtype}")
        w = sf.weights_or_none()
        if w is not None and not w.dtype.is_floating_point:
            raise InputError(f"features {keys}: weights must be floating point, got {w.dtype}")
        if offsets.device != values.device or (w is not None and w.device != values.device):
            raise InputError(f"features {keys}: ids, offsets and weights must be on one device")
        if values.is_meta:
            raise InputError(f"features {keys}: the batch is on the meta device, which holds no ids to look up "
                             "(only an EmbeddingCollection on the meta device takes such a batch, for shapes)")
        if ends and values.is_cpu:
            self.check_ends(sf)

    def check_ends(self, sf) -> None:
        """A CPU batch's offsets start at 0 and end at len(values), and the bags of its features
        that no plan feature reads never shrink: what the native prepare kernels, which check only
        the bags they read, leave to their caller."""
        # a batch whose offsets start past 0 or stop short of len(values) would be pooled
        # without the ids outside them: two reads of host memory, no sync (through NumPy:
        # a third of the cost of indexing the tensor twice)
        ends = sf.offsets().numpy()
        if ends[0] != 0 or ends[-1] != sf.values().numel():
            raise_offsets_error(sf)
        self.check_unread_bags(sf)

    def check_unread_bags(self, sf) -> None:
        """Offsets of the batch's features that no plan feature reads never decrease.

        The prepare kernels check the bags they read; a batch whose other bags are corrupt
        is corrupt all the same.  Most batches hold only features the plan reads: then this
        is one dict lookup.
        """
        runs = self._unread_cache.get(sf.keys())
        if runs is None:
            read = set(self._source(sf.keys())[0])
            runs, f = [], 0
            while f < sf.num_features:  # runs of consecutive unread input features
                if f in read:
                    f += 1
                    continue
                start = f
                while f < sf.num_features and f not in read:
                    f += 1
                runs.append((start, f))
            self._unread_cache[sf.keys()] = runs
        b = sf.batch_size
        for start, end in runs:
            o = sf.offsets()[start * b : end * b + 1]
            if o.numel() > 1 and bool((o[1:] < o[:-1]).any()):
                raise_offsets_error(sf)

    def describe_id_error(self, code: int, feature: int, position: int, value: int, sf) -> str:
        """Message for an error reported by the clean stage (code 1: an id out of range, 2: a
        weight not finite, 3: a bag's offsets, 4: offsets that do not run from 0 to len(values);
        3 and 4 raise validate()'s error)."""
        if code == 4:
            raise_offsets_error(sf)
        f = self.features[feature]
        t = self.tables[self.feature_table[feature]]
        if code == 3:  # validate() names the feature, sample and offsets
            raise_offsets_error(sf, f"(feature {f.source_name!r} sample {position}, next offset {value})")
        _, sample = sf.id_location(position)
        if code == 1:
            label = f"feature {f.source_name!r}" + (f" (output {f.name!r})" if f.name != f.source_name else "")
            return (
                f"{label}: id {value} at sample {sample} is out of range "
                f"for table {t.name!r} of {t.num_rows} rows; pass out_of_range='prune' or 'default' to accept it"
            )
        w = sf.weights()[position]
        return f"feature {f.source_name!r}: weight {float(w)} of id {value} at sample {sample} is not finite"


def raise_offsets_error(sf, detail: str = "") -> NoReturn:
    """Raises the InputError of validate() for a batch whose offsets a lookup stage refused.

    The lookup's own checks only detect; validate() names the feature, the sample and the
    offsets at fault (error path only: its full pass over the batch costs nothing otherwise).
    """
    from ..features._validate import validate_features

    validate_features(sf)
    # validate() agrees with every lookup check, so this is not reached; if it were, still refuse
    raise InputError(f"features {list(sf.keys())}: offsets are not valid for {sf.values().numel()} ids {detail}")
