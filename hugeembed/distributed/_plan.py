"""Sharding plans: where each table lives (plain data), and the planner that proposes one.

A plan maps every table to a :class:`TablePlacement`::

    ShardingPlan(world_size=2)
    table   kind           ranks   rows/rank    bytes/rank   ids/step/rank
    ------  -------------  ------  -----------  -----------  -------------
    C3      row_wise       0,1     5.07 M       1.21 GiB     8192
    C4      table_wise     1       2.20 M       1.05 GiB     16384
    C9      data_parallel  0,1     3            300 B        8192

It is printable, saved in snapshot manifests (``to_dict`` / ``from_dict``) and
overridable per table (``plan.with_placement("C4", "row_wise")``).  The planner is
pure Python: it never touches a process group or a tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import ConfigError, ShardingError
from ..nn import TableConfig
from ..optim import SparseOptimizer
from ..types import ShardKind
from ._column_wise import column_wise_fits
from ._estimate import estimate_table, fmt_bytes, fmt_num, text_table

__all__ = ["TablePlacement", "ShardingPlan", "propose_plan", "DATA_PARALLEL_BELOW"]

DATA_PARALLEL_BELOW = 2 << 20  # bytes: propose_plan replicates a table of known size up to this (2 MiB: the
# hot ~5.7 k-id Criteo tables at dim 16 with Adam, 1.35 MiB, read K stale cost -0.0009 AUC, +0.24% log loss at K = 4)


@dataclass(frozen=True)
class TablePlacement:
    """Where one table lives.

    Args:
        kind: ``table_wise`` (whole table on ``ranks[0]``), ``row_wise`` (rows spread over
            `ranks` by key), ``data_parallel`` (a replica on every rank), ``column_wise``
            (rank ``ranks[i]`` holds the i-th of ``len(ranks)`` equal blocks of columns).
        ranks: the ranks holding the table: one rank for table-wise, every rank of the
            group for data-parallel, any non-empty subset for row-wise and column-wise.
    """

    kind: ShardKind | str
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ShardKind.parse(self.kind, "placement"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        ranks = (self.ranks,) if isinstance(self.ranks, int) else tuple(self.ranks)
        if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise ConfigError(f"{self.kind.value} placement: ranks must be non-negative ints, got {self.ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"{self.kind.value} placement: ranks {ranks} repeat a rank")
        if self.kind is ShardKind.TABLE_WISE and len(ranks) != 1:
            raise ConfigError(f"table_wise placement lives on exactly one rank, got ranks {ranks}")
        object.__setattr__(self, "ranks", ranks)

    @property
    def owner(self) -> int:
        """The rank of a table-wise table."""
        return self.ranks[0]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "ranks": list(self.ranks)}

    def __str__(self) -> str:
        return f"{self.kind.value}@{','.join(map(str, self.ranks))}"


def _parse_placement(value: TablePlacement | ShardKind | str | Mapping[str, Any], world_size: int,
                     who: str) -> TablePlacement:
    """A placement from a TablePlacement, a kind (``"row_wise"``), ``"table_wise@1"`` or a dict,
    on ranks of ``[0, world_size)`` (ConfigError naming `who` otherwise)."""
    try:
        p = _placement_of(value, world_size, who)
    except (ConfigError, ValueError) as e:  # the kind's own parser says what is wrong, not for which table
        msg = str(e)
        raise ConfigError(msg if msg.startswith(who) else f"{who}: {msg}") from None
    outside = [r for r in p.ranks if r >= world_size]
    if outside:
        raise ConfigError(f"{who}: rank {outside[0]} of {p.kind.value} is outside the world of {world_size} "
                          f"ranks [0, {world_size - 1}]")
    return p


def _placement_of(value, world_size: int, who: str) -> TablePlacement:
    if isinstance(value, TablePlacement):
        return value
    if isinstance(value, Mapping):
        if set(value) - {"kind", "ranks"} or "kind" not in value:
            raise ConfigError(f"{who}: a placement dict has 'kind' and 'ranks', got {dict(value)!r}")
        ranks = value.get("ranks")
        return _parse_placement(ShardKind.parse(value["kind"]) if ranks is None else
                                TablePlacement(value["kind"], tuple(ranks)), world_size, who)
    text = value.value if isinstance(value, ShardKind) else str(value)
    kind_text, _, ranks_text = text.partition("@")
    try:
        kind = ShardKind.parse(kind_text, who)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if ranks_text:
        try:
            ranks = tuple(int(r) for r in ranks_text.split(","))
        except ValueError:
            raise ConfigError(f"{who}: ranks in {text!r} must be integers, e.g. 'table_wise@1' or 'row_wise@0,2'") \
                from None
        return TablePlacement(kind, ranks)
    if kind is ShardKind.TABLE_WISE:
        raise ConfigError(f"{who}: table_wise needs its rank, e.g. 'table_wise@1'")
    return TablePlacement(kind, tuple(range(world_size)))


@dataclass(frozen=True)
class ShardingPlan:
    """Placement of every table over a process group of `world_size` ranks (plain data).

    Args:
        world_size: ranks of the embedding process group.
        placements: table name -> :class:`TablePlacement` (or a kind string such as
            ``"row_wise"``, ``"data_parallel"`` or ``"table_wise@1"``).

    Example::

        plan = ShardingPlan(2, {"user": "row_wise", "country": "data_parallel", "item": "table_wise@1"})
        print(plan)                                   # a table of kinds and ranks
        plan = plan.with_placement("item", "row_wise")  # a new plan; plans are immutable
        ShardingPlan.from_dict(plan.to_dict()) == plan
    """

    world_size: int
    placements: Mapping[str, TablePlacement] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError(f"ShardingPlan: world_size must be a positive int, got {self.world_size!r}")
        parsed = {}
        for name, p in dict(self.placements).items():
            pl = _parse_placement(p, self.world_size, f"table {name!r}")
            bad = [r for r in pl.ranks if r >= self.world_size]
            if bad:
                raise ConfigError(f"table {name!r}: rank {bad[0]} of its {pl.kind.value} placement is outside "
                                  f"the world of {self.world_size} ranks")
            if pl.kind is ShardKind.DATA_PARALLEL and sorted(pl.ranks) != list(range(self.world_size)):
                raise ConfigError(f"table {name!r}: a data_parallel table is replicated on every rank "
                                  f"0..{self.world_size - 1}, got ranks {pl.ranks}")
            parsed[name] = pl
        object.__setattr__(self, "placements", parsed)

    # -- access -----------------------------------------------------------------------

    def __getitem__(self, table: str) -> TablePlacement:
        try:
            return self.placements[table]
        except KeyError:
            raise KeyError(f"the plan places no table {table!r}; it places {sorted(self.placements)}") from None

    def __contains__(self, table: object) -> bool:
        return table in self.placements

    def tables(self) -> list[str]:
        return list(self.placements)

    def kind(self, table: str) -> ShardKind:
        return self[table].kind

    def with_placement(self, table: str, placement: TablePlacement | ShardKind | str) -> "ShardingPlan":
        """A copy of this plan with `table` placed as given (the per-table override)."""
        return ShardingPlan(self.world_size, {**self.placements, table: _parse_placement(
            placement, self.world_size, f"table {table!r}")})

    def validate(self, tables: Sequence[TableConfig]) -> None:
        """Raises ShardingError unless the plan places exactly these tables."""
        names = [t.name for t in tables]
        missing = [n for n in names if n not in self.placements]
        extra = sorted(set(self.placements) - set(names))
        if missing:
            raise ShardingError(f"the sharding plan places no table {missing}; it places {sorted(self.placements)}")
        if extra:
            raise ShardingError(f"the sharding plan places tables {extra} that the collection does not have")
        for t in tables:  # the rest of column-wise's checks need the table's optimizer (_column_wise.py)
            p = self.placements[t.name]
            if p.kind is ShardKind.COLUMN_WISE and t.dim % len(p.ranks):
                raise ConfigError(f"table {t.name!r}: column_wise over ranks {list(p.ranks)}: dim {t.dim} is not "
                                  f"divisible by {len(p.ranks)} ranks; use a dim divisible by the number of ranks, "
                                  f"or list fewer ranks (e.g. 'column_wise@0,1')")

    # -- plain data -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "tables": {n: p.to_dict() for n, p in self.placements.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ShardingPlan":
        if not isinstance(data, Mapping) or set(data) != {"world_size", "tables"}:
            raise ConfigError(f"a sharding plan dict has exactly 'world_size' and 'tables', got {data!r}")
        return cls(int(data["world_size"]), {n: _parse_placement(p, int(data["world_size"]), f"table {n!r}")
                                             for n, p in dict(data["tables"]).items()})

    @classmethod
    def uniform(cls, tables: Sequence[TableConfig | str], world_size: int, kind: ShardKind | str) -> "ShardingPlan":
        """Every table placed the same way; table-wise tables go round robin over the ranks."""
        kind = ShardKind.parse(kind)
        names = [t if isinstance(t, str) else t.name for t in tables]
        if kind is ShardKind.TABLE_WISE:
            return cls(world_size, {n: TablePlacement(kind, (i % world_size,)) for i, n in enumerate(names)})
        return cls(world_size, {n: TablePlacement(kind, tuple(range(world_size))) for n in names})

    # -- printing ---------------------------------------------------------------------

    def describe(self, tables: Sequence[TableConfig] | None = None, *, optimizer: SparseOptimizer | None = None,
                 expected_rows: Mapping[str, int] | None = None, ids_per_step: Mapping[str, int] | None = None,
                 batch_size: int = 1024) -> str:
        """The plan as a text table; with `tables`, also rows, bytes and ids per rank (estimates)."""
        head = [f"ShardingPlan(world_size={self.world_size})"]
        if tables is None:
            rows = [[n, p.kind.value, ",".join(map(str, p.ranks))] for n, p in self.placements.items()]
            return "\n".join(head + text_table(["table", "kind", "ranks"], rows))
        rows = []
        per_rank = [0.0] * self.world_size
        for t in tables:
            est = estimate_table(t, optimizer, expected_rows=expected_rows, ids_per_step=ids_per_step,
                                 batch_size=batch_size, world_size=self.world_size)
            p = self[t.name]
            share = est.share(p, self.world_size)
            for r in p.ranks:
                per_rank[r] += share.bytes
            rows.append([t.name, p.kind.value, ",".join(map(str, p.ranks)),
                         fmt_num(share.rows) if est.bounded else "unbounded",
                         fmt_bytes(share.bytes) if est.bounded else "unbounded", fmt_num(share.ids)])
        lines = head + text_table(["table", "kind", "ranks", "rows/rank", "bytes/rank", "ids/step/rank"], rows)
        lines.append("bytes per rank: " + ", ".join(f"{r}: {fmt_bytes(b)}" for r, b in enumerate(per_rank)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def propose_plan(tables: Sequence[TableConfig], world_size: int, memory_budget_per_rank: int | None = None, *,
                 optimizer: SparseOptimizer | None = None, expected_rows: Mapping[str, int] | None = None,
                 ids_per_step: Mapping[str, int] | None = None, batch_size: int = 1024,
                 data_parallel_below: int = DATA_PARALLEL_BELOW, row_wise_above: int | None = None,
                 overrides: Mapping[str, TablePlacement | ShardKind | str] | None = None,
                 servers: int = 0) -> ShardingPlan:
    """Proposes a plan balancing estimated memory and lookup cost over `world_size` ranks.

    Rules, in order:

    1. tables in `overrides` are placed as given;
    2. tables of at most `data_parallel_below` bytes are replicated (``data_parallel``):
       their lookups need no exchange;
    3. tables above `row_wise_above` bytes (default: a quarter of the budget, or without a
       budget half of a rank's fair share of all bytes), and dynamic tables of unknown size,
       are spread over every rank: ``row_wise``, or ``column_wise`` where its column blocks
       fit every rank and its estimated exchange is smaller (``TableEstimate.exchange_bytes``:
       bags of many ids, pooled once per bag) and column-wise supports the table;
    4. the rest are ``table_wise``, largest first, each on the rank where
       ``(bytes + table)/budget + (cost + table cost)/(total cost / world_size)`` is
       smallest (memory and lookup work both balanced); a table that fits no rank is
       spread as in rule 3.

    Finally every rank's estimated bytes are checked against the budget: a plan that
    does not fit raises :class:`ShardingError` naming the rank and the bytes over.

    Args:
        tables: the collection's tables.
        world_size: ranks.
        memory_budget_per_rank: bytes each rank may spend on tables (None: no limit).
        optimizer: default optimizer (state width of tables that name none).
        expected_rows: rows hint per dynamic table (default: its capacity).
        ids_per_step: ids per global step per table (default: global batch x features).
        batch_size: per-rank batch size for the default ids per step.
        data_parallel_below, row_wise_above: the size thresholds of rules 2 and 3, in bytes.
        overrides: table -> placement, kept as given.
        servers: the last `servers` ranks are server-only ranks (they read no data): rules 3 and 4
            place shards on them only (replicas of rule 2 stay on every rank; `overrides` may name
            any rank), so the workers hold no shard of their own.

    Example::

        plan = propose_plan(criteo_tables, world_size=4, memory_budget_per_rank=8 << 30,
                            optimizer=RowWiseAdagrad(lr=0.05), expected_rows={"C3": 10_000_000})
        print(plan.describe(criteo_tables, optimizer=RowWiseAdagrad(lr=0.05)))
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"propose_plan: world_size must be a positive int, got {world_size!r}")
    if memory_budget_per_rank is not None and memory_budget_per_rank <= 0:
        raise ConfigError(f"propose_plan: memory_budget_per_rank must be positive, got {memory_budget_per_rank!r}")
    if isinstance(servers, bool) or not isinstance(servers, int) or not 0 <= servers < world_size:
        raise ConfigError(f"propose_plan: servers must be an int in [0, {world_size - 1}] (at least one rank reads "
                          f"data), got {servers!r}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {t.name for t in tables})
    if unknown:
        raise ConfigError(f"propose_plan: overrides name unknown tables {unknown}")
    est = {t.name: estimate_table(t, optimizer, expected_rows=expected_rows, ids_per_step=ids_per_step,
                                  batch_size=batch_size, world_size=world_size) for t in tables}
    budget = float(memory_budget_per_rank) if memory_budget_per_rank is not None else math.inf
    total_bytes = sum(e.bytes for e in est.values())
    everyone = tuple(range(world_size))
    holders = everyone[world_size - servers:] if servers else everyone  # where shards go (rules 3 and 4)
    if row_wise_above is None:
        row_wise_above = budget / 4 if memory_budget_per_rank is not None else total_bytes / (2 * len(holders))
    placements: dict[str, TablePlacement] = {}
    mem = [0.0] * world_size
    cost = [0.0] * world_size

    def place(name: str, p: TablePlacement) -> None:
        placements[name] = p
        share = est[name].share(p, world_size)
        dim = est[name].dim // len(p.ranks) if p.kind is ShardKind.COLUMN_WISE else est[name].dim
        for r in p.ranks:
            mem[r] += share.bytes
            cost[r] += share.ids * dim

    def spread(t: TableConfig) -> TablePlacement:
        """Rule 3: column-wise where it is supported, fits and exchanges less than row-wise; else row-wise."""
        e, col, n = est[t.name], TablePlacement(ShardKind.COLUMN_WISE, holders), len(holders)
        if e.bounded and n > 1 and column_wise_fits(t, optimizer, holders) and \
                e.exchange_bytes(ShardKind.COLUMN_WISE, n) < e.exchange_bytes(ShardKind.ROW_WISE, n):
            share = e.share(col, world_size)
            if all(mem[r] + share.bytes <= budget for r in holders):
                return col
        return TablePlacement(ShardKind.ROW_WISE, holders)

    pending = []
    for t in tables:
        e = est[t.name]
        if t.name in overrides:
            place(t.name, _parse_placement(overrides[t.name], world_size, f"table {t.name!r}"))
        elif e.bounded and e.bytes <= data_parallel_below:
            place(t.name, TablePlacement(ShardKind.DATA_PARALLEL, everyone))
        elif not e.bounded or e.bytes > row_wise_above or world_size == 1:
            place(t.name, spread(t))
        else:
            pending.append(t.name)
    total_cost = sum(e.cost for e in est.values()) or 1.0
    by_name = {t.name: t for t in tables}
    mem_scale = budget if math.isfinite(budget) else max(total_bytes / len(holders), 1.0)
    for name in sorted(pending, key=lambda n: (-est[n].bytes, n)):
        e = est[name]
        fits = [r for r in holders if mem[r] + e.bytes <= budget]
        if not fits:
            place(name, spread(by_name[name]))
            continue
        best = min(fits, key=lambda r: ((mem[r] + e.bytes) / mem_scale
                                        + (cost[r] + e.cost) / (total_cost / len(holders)), r))
        place(name, TablePlacement(ShardKind.TABLE_WISE, (best,)))
    plan = ShardingPlan(world_size, {t.name: placements[t.name] for t in tables})
    if memory_budget_per_rank is not None:
        worst = max(everyone, key=lambda r: mem[r] - budget)
        if mem[worst] > budget:
            on_rank = [n for n, p in placements.items() if worst in p.ranks]
            raise ShardingError(
                f"no plan fits: rank {worst} needs {fmt_bytes(mem[worst])} ({int(mem[worst])} bytes) for tables "
                f"{on_rank} but its budget is {fmt_bytes(budget)}: over by {int(math.ceil(mem[worst] - budget))} bytes; "
                f"add ranks, raise the budget, or shard these tables row-wise"
                + (f" (the shards live on the server ranks {', '.join(map(str, holders))} only: add servers)"
                   if servers else ""))
    return plan
