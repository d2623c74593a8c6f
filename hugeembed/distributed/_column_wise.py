"""Column-wise sharding (TorchRec's COLUMN_WISE): each rank of a table's placement holds one
contiguous block of its columns, for every row.

A table of dim D on n ranks: rank ``ranks[i]`` holds columns ``[i*D/n, (i+1)*D/n)`` of every
row, with the optimizer state of those columns.  Every block sees every id of the table, so
each block owner pools its columns for every rank exactly as a table-wise owner pools the
whole table (_table_wise.py carries one entry per block); a rank's pooled output is the
concatenation of the blocks in column order.  What lets the blocks stay one table:

* sum / mean / sqrtn pool per column (sqrtn's 1/sqrt(bag length) is per bag, not per row);
* the rules whose state is per element (SGD, momentum, Adagrad, Adam, FTRL) update each
  column on its own; Adam's per-row counter is the same in every block (same ids, same steps);
* admission, hit counts, last steps, eviction by count or age and the shared row decide by
  ids and counts only, which every block sees alike, so the blocks keep the same keys;
* rows start as the columns of the unsharded table's initial rows (ColumnBlockInit).

Refused, naming the table: ``max_norm`` and ``evict_norm_below`` (they need the whole row's
norm), row-wise Adagrad (its state is per row: the whole row's mean squared gradient),
stochastic rounding (its draws are per column of the whole row), 16-bit packed rows, disk
tiers, sequence tables (combiner "none"), and a dim the ranks do not divide.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import _native
from ..errors import ConfigError, ShardingError
from ..nn import TableConfig
from ..optim import FTRL, SGD, Adagrad, Adam, MomentumSGD, SparseOptimizer
from ..store import Initializer
from ..store._init import default_initializer, init_rows_native
from ..types import Combiner
from ._wire import Packer, padded, readers

__all__ = ["ColumnBlockInit", "column_block", "check_column_wise", "block_config", "join_blocks", "slice_block",
           "COLUMN_WISE_RULES", "column_wise_fits", "gather_tables", "ColumnBlockShard", "stores_to_save",
           "join_columns"]

# per-element state (plus Adam's per-row counter, equal in every block)
COLUMN_WISE_RULES = (SGD, MomentumSGD, Adagrad, Adam, FTRL)


def column_block(dim: int, ranks: tuple[int, ...], rank: int) -> tuple[int, int]:
    """Columns ``[lo, hi)`` of a table of `dim` that `rank` holds (it must be one of `ranks`)."""
    width = dim // len(ranks)
    i = ranks.index(rank)
    return i * width, (i + 1) * width


def check_column_wise(cfg: TableConfig, rule: SparseOptimizer | None, ranks: tuple[int, ...]) -> None:
    """ConfigError naming the table and what column-wise sharding cannot give it."""
    who = f"table {cfg.name!r}: column_wise over ranks {list(ranks)}"
    n = len(ranks)
    if cfg.dim % n:
        raise ConfigError(f"{who}: dim {cfg.dim} is not divisible by {n} ranks; use a dim divisible by the "
                          f"number of ranks, or list fewer ranks (e.g. 'column_wise@0,1')")
    if Combiner(cfg.combiner) is Combiner.NONE:
        raise ConfigError(f"{who}: a sequence table (combiner 'none') cannot be split by columns; use row_wise")
    if cfg.max_norm is not None:
        raise ConfigError(f"{who}: max_norm clips by the whole row's norm, which no block holds; drop max_norm or "
                          f"use row_wise / table_wise")
    if cfg.evict_norm_below is not None:
        raise ConfigError(f"{who}: evict_norm_below evicts by the whole row's norm, which no block holds; use "
                          f"row_wise / table_wise")
    if cfg.stochastic_rounding:
        raise ConfigError(f"{who}: stochastic rounding draws per column of the whole row; use row_wise / table_wise")
    if cfg.tiered:
        raise ConfigError(f"{who}: disk-tiered tables (storage_dir) are not split by columns; use row_wise")
    layout = cfg.row_layout(rule)
    if layout.packed:
        raise ConfigError(f"{who}: 16-bit weights with float32 state (packed rows) are not split by columns; use "
                          f"dtype float32 or row_wise")
    if rule is not None and not isinstance(rule, COLUMN_WISE_RULES):
        raise ConfigError(f"{who}: optimizer {type(rule).__name__} keeps state per row (it needs the whole row's "
                          f"gradient); column_wise supports {[r.__name__ for r in COLUMN_WISE_RULES]}")


def column_wise_fits(cfg: TableConfig, default_rule: SparseOptimizer | None, ranks: tuple[int, ...]) -> bool:
    """Whether column-wise sharding over `ranks` supports table `cfg` (for the planner)."""
    rule = cfg.optimizer if cfg.optimizer is not None else (default_rule if cfg.trainable else None)
    try:
        check_column_wise(cfg, rule, ranks)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class ColumnBlockInit(Initializer):
    """Columns ``[first, first + dim)`` of the rows `inner` makes at `full_dim`: a block starts
    exactly as its columns of the unsharded table (the same path: native kernel or torch)."""

    inner: Initializer
    full_dim: int
    first: int
    native: bool

    def generate(self, keys, dim, seed):
        full = torch.empty(keys.numel(), self.full_dim, dtype=torch.float32, device=keys.device)
        if not (self.native and init_rows_native(self.inner, keys, self.full_dim, seed, full, None)):
            full = self.inner.generate(keys, self.full_dim, seed)
        return full[:, self.first : self.first + dim].contiguous()


def block_config(cfg: TableConfig, ranks: tuple[int, ...], rank: int) -> TableConfig:
    """The table `rank` holds: `cfg` with its block's dim, starting as the block's columns."""
    lo, hi = column_block(cfg.dim, ranks, rank)
    inner = cfg.initializer if cfg.initializer is not None else default_initializer(cfg.dim)
    # the unsharded table initialises float32 rows with the native kernel where it runs
    native = cfg.dtype == torch.float32 and _native.available()
    return dataclasses.replace(cfg, dim=hi - lo, initializer=ColumnBlockInit(inner, cfg.dim, lo, native))


def _state_parts(rule: SparseOptimizer | None, dim: int) -> tuple[int, int]:
    """(k, s): a row's state is k per-element parts of `dim` values each, then s per-row values."""
    if rule is None:
        return 0, 0
    k = rule.state_width(2) - rule.state_width(1)
    return k, rule.state_width(dim) - k * dim


def join_blocks(blocks: list[torch.Tensor], rule: SparseOptimizer | None, dim: int) -> torch.Tensor:
    """Whole rows ``[N, D + state(D)]`` from each block's rows (column order, keys aligned)."""
    return join_columns(blocks, dim, _state_parts(rule, dim // len(blocks))[0])


def join_columns(blocks: list[torch.Tensor], dim: int, state_parts: int) -> torch.Tensor:
    """Whole rows from equal blocks of a table of `dim` (column order, keys aligned) whose state is
    `state_parts` per-column parts then per-row values (a snapshot's blocks: no rule needed)."""
    d = dim // len(blocks)
    k = state_parts
    parts = [b[:, j * d : (j + 1) * d] for j in range(k + 1) for b in blocks]
    s = blocks[0].shape[1] - (k + 1) * d
    if s:
        parts.append(blocks[0][:, (k + 1) * d :])
    return torch.cat(parts, 1)


def slice_block(rows: torch.Tensor, rule: SparseOptimizer | None, dim: int, lo: int, hi: int) -> torch.Tensor:
    """A block's rows (columns ``[lo, hi)`` with their state) from whole rows ``[N, D + state(D)]``."""
    k, s = _state_parts(rule, dim)
    parts = [rows[:, lo:hi]] + [rows[:, dim + j * dim + lo : dim + j * dim + hi] for j in range(k)]
    if s:
        parts.append(rows[:, dim + k * dim : dim + k * dim + s])
    return torch.cat(parts, 1)


def _gathered(coll, names: list[str], exports: dict[str, dict], stage: str) -> dict[str, dict]:
    """Collective: per column-wise table of `names`, the whole table (blocks joined by columns, keys
    ascending) on every rank of its placement, from each block's
    `exports` (field -> tensor).  Only the blocks' keys and rows travel, each to the ranks joining it."""
    W, me = coll.world_size, coll.rank
    coll.drain()  # an exchange thread (staleness) runs no collective beside this one
    needs = {n: coll.plan[n].ranks for n in names}
    mine = {}
    for n, ex in exports.items():
        order = torch.argsort(ex["keys"])
        mine[n] = {f: v[order] if f in ("keys", "rows", "counts", "last_step") else v for f, v in ex.items()}
    counts = torch.zeros(W, len(names), dtype=torch.int64)
    packer = Packer(W)
    for d in range(W):
        for i, n in enumerate(names):
            if n in mine and d != me and d in needs[n]:
                counts[d, i] = mine[n]["keys"].numel()
                packer.add(d, mine[n]["keys"])
                packer.add(d, mine[n]["rows"].contiguous())
    got = coll.comm.exchange_counts(f"{stage} (sizes)", counts)
    sizes = [0] * W
    for s in range(W):
        for i, n in enumerate(names):
            c = int(got[s, i])
            if c:
                rows = mine[n]["rows"]  # a rank joining a table holds a block of it: the same width and dtype
                sizes[s] += padded(8 * c) + padded(c * rows.shape[1] * rows.element_size())
    rds = readers(coll.comm.all_to_all_bytes(stage, packer.buffer(coll.device), packer.sizes, sizes), sizes, stage)
    received: dict[tuple[str, int], tuple] = {}
    for s in range(W):
        for i, n in enumerate(names):
            c = int(got[s, i])
            if c:
                w, dt = mine[n]["rows"].shape[1], mine[n]["rows"].dtype
                received[n, s] = (rds[s].take(c, torch.int64), rds[s].take(c * w, dt).view(c, w))
        rds[s].finish()
    out = {}
    for n in names:
        if me not in needs[n]:
            continue
        ranks, own = coll.plan[n].ranks, mine[n]
        blocks = []
        for r in ranks:
            keys, rows = (own["keys"], own["rows"]) if r == me else received.get((n, r), (own["keys"][:0], None))
            if not torch.equal(keys, own["keys"]):
                raise ShardingError(f"table {n!r}: the column blocks of ranks {list(ranks)} hold different keys "
                                    "(internal error: the blocks must admit and evict alike)")
            blocks.append(rows if rows is not None else own["rows"][:0])
        t = coll._table_index(n)
        out[n] = {**own, "rows": join_blocks(blocks, coll.rules[t], coll.tables[t].dim)}
    return out


def _column_wise_names(coll) -> list[str]:
    from ..types import ShardKind

    return [cfg.name for cfg in coll.tables if coll.plan[cfg.name].kind is ShardKind.COLUMN_WISE]


class ColumnBlockShard:
    """One rank's block of a column-wise table, seen by a snapshot writer: the table's whole layout
    for the manifest entry, the block's own rows streamed from its storage (no copy, no exchange),
    keys ascending (every block writes its rows in the same order), and ``columns`` for its shard
    record: ``{"lo", "hi", "state_parts"}`` (state_parts: per-column state parts, k of _state_parts)."""

    def __init__(self, cfg: TableConfig, rule: SparseOptimizer | None, block, lo: int, hi: int) -> None:
        self.layout = cfg.row_layout(rule)
        self.width, self.state_width, self.dtype = self.layout.width, self.layout.state_width, cfg.dtype
        self.seed, self.initializer = block.seed, block.initializer.inner
        self.columns = {"lo": lo, "hi": hi, "state_parts": _state_parts(rule, hi - lo)[0]}
        self._block = block

    def export_index(self):
        ex = self._block.export_index()
        order, pend = torch.argsort(ex.keys), torch.argsort(ex.pending_keys)
        return dataclasses.replace(ex, keys=ex.keys[order], slots=ex.slots[order], counts=ex.counts[order],
                                   last_step=ex.last_step[order], pending_keys=ex.pending_keys[pend],
                                   pending_counts=ex.pending_counts[pend],
                                   pending_last_step=ex.pending_last_step[pend])

    def storage(self) -> torch.Tensor:
        return self._block.storage()


def stores_to_save(coll, delta: bool) -> list[tuple]:
    """(config, store) per table for a snapshot writer: each rank of a column-wise table's placement
    writes its own block (ColumnBlockShard; ``writes_shard``), full or delta alike, so no rank holds
    more of a table than its block while saving (the reader joins the blocks: checkpoint/_columns.py)."""
    from ..types import ShardKind

    coll.drain()  # with staleness: every exchange handed over has run, so all blocks hold the same steps
    out = []
    for cfg, store in coll.stores():
        p = coll.plan[cfg.name]
        if p.kind is ShardKind.COLUMN_WISE and coll.rank in p.ranks:
            lo, hi = column_block(cfg.dim, p.ranks, coll.rank)
            store = ColumnBlockShard(cfg, coll.rules[coll._table_index(cfg.name)], store, lo, hi)
        out.append((cfg, store))
    return out


def _fields() -> tuple[str, ...]:
    from ..store import EXPORT_FIELDS

    return EXPORT_FIELDS


def gather_tables(coll, destination: dict, prefix: str) -> None:
    """Collective (every rank of the collection): replaces each column-wise table's block in a
    state_dict `destination` with the whole table, its blocks joined by columns on every rank
    of its placement (the keys and counts every block holds alike)."""
    names = _column_wise_names(coll)
    if not names:
        return
    mine = {n: {f: destination[f"{prefix}tables.{n}.{f}"] for f in _fields()} for n in names
            if coll.rank in coll.plan[n].ranks}
    for name, fields in _gathered(coll, names, mine, "state_dict (column blocks)").items():
        for f, v in fields.items():
            destination[f"{prefix}tables.{name}.{f}"] = v
