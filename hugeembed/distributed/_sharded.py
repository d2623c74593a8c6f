"""ShardedEmbeddingCollection: the EmbeddingCollection API with tables spread over a process group.

Each rank calls it with its LOCAL batch and gets the pooled embeddings of that batch,
exactly as one process would compute them for the same samples.  One training step::

    prepare   : clean + dedup the local batch per table (the fused lookup's prepare)
    input_dist: header (sizes, step) all-to-all, then ONE byte all-to-all with every
                table's unique keys / bags for their owners (_row_wise, _table_wise,
                _data_parallel say what each kind sends)
    compute   : owners find-or-insert the union of the keys they got, gather rows or pool
    output_dist: ONE all-to-all with rows (row-wise) and pooled vectors (table-wise) back
    pool      : the local fused lookup pools from the received rows / the local replica
    backward  : ONE all-to-all with every table's per-key (or pooled) gradients; owners sum
                them over the ranks and apply the optimizer once per key, in place

All collectives run on a dedicated process group (never interleaving with DDP's
gradient all-reduce on the default group) through :class:`Comm`, with a timeout.
"""

from __future__ import annotations

import datetime
import os
from typing import Sequence

import torch

from .._device import canonical_device
from ..errors import ConfigError, ShardingError
from ..nn import EmbeddingCollection, TableConfig
from ..nn._placement import table_settings
from ..optim import SparseOptimizer
from ..types import ShardKind
from ._column_wise import block_config, check_column_wise, column_block, gather_tables, slice_block, stores_to_save
from ._comm import DEFAULT_TIMEOUT_S, Comm, new_embedding_group
from ._pipeline import PipelinedExchanges, StalePipeline
from ._plan import ShardingPlan, propose_plan
from ._routes import build_routes
from ._row_wise import owner_index
from ._sharded_step import ShardedStep
from ._stores import AbsentShard

__all__ = ["ShardedEmbeddingCollection"]


class ShardedEmbeddingCollection(ShardedStep, PipelinedExchanges, EmbeddingCollection):
    """An :class:`EmbeddingCollection` whose tables are spread over the ranks of a process group.

    Same configs, same forward (a SparseFeatures of this rank's LOCAL batch -> the
    PooledEmbeddings of that batch), same in-backward training; N ranks fed the slices of
    the same global batches train the same tables as one process on the global batches.

    Args:
        tables: one :class:`TableConfig` per table (the same on every rank).
        optimizer: default sparse optimizer.
        plan: a :class:`ShardingPlan` (None: :func:`propose_plan` with no memory budget).
        process_group: the group carrying embedding traffic (None: a new group of every rank,
            gloo for CPU tables, NCCL for CUDA ones).  Collective: build it on every rank.
        device, seed, backend: as for EmbeddingCollection.
        timeout: seconds any collective may wait before a peer counts as dead (ShardingError).
        gradient_reduction: ``"mean"`` (default): each rank's loss is a mean over its local batch
            and row gradients are divided by the world size, as DistributedDataParallel does
            for dense gradients, so N ranks equal one process on the global batch; ``"sum"``:
            gradients of the ranks' losses add up.
        memory_budget_per_rank: bytes, for the proposed plan when `plan` is None.
        storage_owner: as for EmbeddingCollection (the run's tag in tiered tables' directories).
        staleness: None (default): every exchange runs inside its forward / backward.  K >= 0: the
            exchanges run on a thread K steps ahead (distributed/_pipeline.py): batch t reads rows
            holding the updates of batches up to t-K-1 exactly; hand each training batch over with
            :meth:`enqueue` K steps before its forward, and :meth:`drain` before a snapshot.
        servers: the last `servers` ranks are server-only ranks (TensorNet's parameter servers): they
            hold shards and feed only empty batches, taking part in every exchange; "mean" divides the
            row gradients by the workers (``world_size - servers``); the proposed plan puts the shards
            on the servers.  The dense part's all-reduce is the caller's (over the workers only).
        stale_row_scale: with K >= 1, each row's step is scaled by 1 / (1 + n), n the in-flight
            batches that updated it since its fetch (distributed/_stale_rows.py); False: the plain step.
        stale_compensation: with K >= 1, lambda of the delay-compensated row gradients
            g + lambda * g * g * (w_now - w_read) (DC-ASGD, distributed/_stale_comp.py); 0: off.
        replicated_staleness: R in [0, K] (None: K): data-parallel tables' rows read for batch t hold
            the updates of batches up to t-R-1 exactly (their keys still registered K steps ahead);
            the trainer passes its dense delay D (replicas are the small, hot tables).  With
            ``stale_compensation``, a replicated row's drift counts from that later read.

    Disk-tiered tables (``TableConfig.storage_dir``) shard like the others: every rank holding
    rows of one keeps them under ``<storage_dir>/rank<r>/<table>/`` with its own cache of
    ``memory_budget`` bytes (the budget is per rank and table: a row-wise table over 4 ranks
    caches up to 4 x ``memory_budget`` in all).  ``prefetch`` reads ahead the rows this rank
    owns of its own next batch (the ids other ranks will ask for are not known before the
    exchange).

    Example (launched with ``torchrun --nproc_per_node 2 script.py``)::

        dist.init_process_group("gloo")
        plan = ShardingPlan(2, {"user": "row_wise", "country": "data_parallel", "item": "table_wise@1"})
        ec = ShardedEmbeddingCollection(tables, optimizer=Adagrad(lr=0.05), plan=plan)
        out = ec(local_batch)            # rank r: rows [r*B, (r+1)*B) of the global batch
        loss(out).backward()             # rows updated on their owners

    Every rank must run the same sequence of forwards (and of backwards in training).
    """

    def __init__(self, tables: Sequence[TableConfig], *, optimizer: SparseOptimizer | None = None,
                 plan: ShardingPlan | None = None, process_group=None, device: torch.device | str = "cpu",
                 seed: int = 0, backend: str = "auto", timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S,
                 gradient_reduction: str = "mean", memory_budget_per_rank: int | None = None,
                 storage_owner: str | None = None, staleness: int | None = None, servers: int = 0,
                 stale_row_scale: bool = True, stale_compensation: float = 0.0,
                 replicated_staleness: int | None = None) -> None:
        tables = list(tables)
        device = canonical_device(device)
        if gradient_reduction not in ("mean", "sum"):
            raise ConfigError(f"gradient_reduction must be 'mean' or 'sum', got {gradient_reduction!r}")
        group = process_group if process_group is not None else new_embedding_group(device, timeout)
        comm = Comm(group, timeout)
        if isinstance(servers, bool) or not isinstance(servers, int) or not 0 <= servers < comm.world_size:
            raise ConfigError(f"servers must be an int in [0, {comm.world_size - 1}] (the last ranks of the "
                              f"{comm.world_size}; at least one rank reads data), got {servers!r}")
        if plan is None:
            plan = propose_plan(tables, comm.world_size, memory_budget_per_rank, optimizer=optimizer, servers=servers)
        if not isinstance(plan, ShardingPlan):
            raise ConfigError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
        if plan.world_size != comm.world_size:
            raise ShardingError(f"the plan is for {plan.world_size} ranks, the process group has {comm.world_size}")
        plan.validate(tables)
        self.plan, self.comm = plan, comm
        self.rank, self.world_size = comm.rank, comm.world_size
        # server-only ranks (the last `servers`) hold shards and read no data: "mean" divides by the workers
        self.servers, self.workers = servers, comm.world_size - servers
        self.gradient_reduction = gradient_reduction
        super().__init__(tables, optimizer=optimizer, device=device, seed=seed, backend=backend,
                         storage_owner=storage_owner)
        self._check_ranks_agree()
        self._build_routes()
        self._pipeline = None
        if staleness is not None:
            if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
                raise ConfigError(f"staleness must be an int >= 0 (steps), got {staleness!r}")
            if isinstance(stale_compensation, bool) or not isinstance(stale_compensation, (int, float)) \
                    or not 0 <= stale_compensation < float("inf"):
                raise ConfigError(f"stale_compensation must be a number >= 0 (lambda), got {stale_compensation!r}")
            if replicated_staleness is not None and (isinstance(replicated_staleness, bool) or not isinstance(
                    replicated_staleness, int) or not 0 <= replicated_staleness <= staleness):
                raise ConfigError(f"replicated_staleness must be an int in [0, staleness={staleness}] (steps), got "
                                  f"{replicated_staleness!r}")
            self._pipeline = StalePipeline(self, staleness, row_scale=stale_row_scale,
                                           compensation=float(stale_compensation),
                                           replicated_staleness=replicated_staleness)
        elif replicated_staleness is not None:
            raise ConfigError("replicated_staleness needs staleness=K (a pipelined collection)")

    # -- construction -----------------------------------------------------------------

    def _table_settings(self, t: int):
        """A shard's settings: a row-wise static table's share of the keys, a row-wise dynamic table's
        share of the capacity; None for a table this rank holds no row of."""
        cfg = self.tables[t]
        p = self.plan[cfg.name]
        n = len(p.ranks)
        if self.device.type != "meta" and p.kind is not ShardKind.DATA_PARALLEL and self.rank not in p.ranks:
            return None
        if p.kind is ShardKind.COLUMN_WISE:  # its block of columns, every row (_column_wise.py)
            check_column_wise(cfg, self.rules[t], p.ranks)
            if self.rank not in p.ranks:
                return None
            return table_settings(block_config(cfg, p.ranks, self.rank), self.rules[t], self.seed)
        if p.kind is ShardKind.DATA_PARALLEL or p.kind is ShardKind.TABLE_WISE or n == 1:
            return super()._table_settings(t)
        if cfg.num_rows is not None:
            return table_settings(cfg, self.rules[t], self.seed, shard=p.ranks.index(self.rank), num_shards=n)
        # a dynamic table's capacity is shared out over its shards
        return table_settings(cfg, self.rules[t], self.seed, capacity=None if cfg.capacity is None else
                              -(-cfg.capacity // n))

    def _absent_store(self, t: int):
        cfg, rule = self.tables[t], self.rules[t]
        layout = cfg.row_layout(rule)
        return AbsentShard(cfg.name, cfg.dim, layout.state_width, cfg.dtype, self.device, cfg.resolved_seed(self.seed),
                           cfg.initializer, self.plan[cfg.name].ranks, layout)

    def _tier_dir(self, cfg: TableConfig) -> str:
        # each rank its own directory: ranks on one machine may share the storage_dir
        return os.path.join(cfg.storage_dir, f"rank{self.rank}")

    def _check_ranks_agree(self) -> None:
        # a tiered table's storage_dir is each machine's own path: it may differ between ranks
        tables = [{k: v for k, v in t.describe().items() if k != "storage_dir"} for t in self.tables]
        mine = {"plan": self.plan.to_dict(), "tables": tables, "seed": self.seed,
                "gradient_reduction": self.gradient_reduction, "servers": self.servers}
        for r, theirs in enumerate(self.comm.all_gather_object("construction (config check)", mine)):
            if theirs != mine:
                what = next(k for k in mine if theirs.get(k) != mine[k])
                raise ShardingError(f"rank {r} built its ShardedEmbeddingCollection with a different {what} than "
                                    f"rank {self.rank}: every rank needs the same tables, seed and plan")

    def _build_routes(self) -> None:
        build_routes(self)  # distributed/_routes.py

    # -- ownership ----------------------------------------------------------------------

    def owned_mask(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """True where this rank holds (or should hold) `keys` of `table` under the plan."""
        p, cfg = self.plan[table], self.tables[self._table_index(table)]
        if p.kind is ShardKind.DATA_PARALLEL:
            return torch.ones_like(keys, dtype=torch.bool)
        if self.rank not in p.ranks:
            return torch.zeros_like(keys, dtype=torch.bool)
        if p.kind in (ShardKind.TABLE_WISE, ShardKind.COLUMN_WISE) or len(p.ranks) == 1:
            return torch.ones_like(keys, dtype=torch.bool)
        return owner_index(keys, len(p.ranks), cfg.num_rows is not None) == p.ranks.index(self.rank)

    def _keys_held_here(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        return keys[self.owned_mask(table, keys)]

    @property
    def is_server(self) -> bool:
        """Whether this rank is a server-only rank (``servers=``): it holds shards and feeds empty batches."""
        return self.rank >= self.workers

    def writes_shard(self, table: str) -> bool:
        """Whether this rank saves rows of `table` in a snapshot (a replica is saved by rank 0 only)."""
        p = self.plan[table]
        return self.rank == 0 if p.kind is ShardKind.DATA_PARALLEL else self.rank in p.ranks

    def column_block_of(self, table: str, rows: torch.Tensor) -> torch.Tensor:
        """Whole rows of a column-wise table cut to this rank's block (with its state); other tables'
        rows, and rows of another width (the load reports it), as they are."""
        p, t = self.plan[table], self._table_index(table)
        cfg = self.tables[t]
        if p.kind is not ShardKind.COLUMN_WISE or self.rank not in p.ranks or \
                rows.shape[1] != cfg.row_layout(self.rules[t]).width or len(p.ranks) == 1:
            return rows
        lo, hi = column_block(cfg.dim, p.ranks, self.rank)
        return slice_block(rows, self.rules[t], cfg.dim, lo, hi)

    def stores_to_save(self, delta: bool = False) -> list[tuple]:
        """(config, store) per table for a snapshot writer, a column-wise table as this rank's block."""
        return stores_to_save(self, delta)

    def global_num_rows(self) -> dict[str, int]:
        """Rows per table over all ranks (collective: call it on every rank)."""
        everyone = self.comm.all_gather_object("row count", self.num_rows())
        one = {t.name: self.plan[t.name].ranks[0] for t in self.tables
               if self.plan[t.name].kind in (ShardKind.DATA_PARALLEL, ShardKind.COLUMN_WISE)}
        return {t.name: everyone[one[t.name]][t.name] if t.name in one
                else sum(e[t.name] for e in everyone) for t in self.tables}

    def extra_repr(self) -> str:
        return f"rank {self.rank} of {self.world_size}\n{super().extra_repr()}\n{self.plan.describe()}"

    # -- state_dict ---------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._tables_in_state_dict:  # column-wise tables whole (a collective when there are some)
            gather_tables(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # rows of any layout (one process, another plan or world size) load: keep the keys this rank owns
        state = dict(state_dict)
        for cfg in self.tables:
            k = f"{prefix}tables.{cfg.name}."
            for group in (("keys", "rows", "counts", "last_step"),
                          ("pending_keys", "pending_counts", "pending_last_step")):
                if all(k + f in state for f in group):
                    keep = self.owned_mask(cfg.name, state[k + group[0]])
                    for f in group:
                        state[k + f] = state[k + f][keep]
            if k + "rows" in state:
                state[k + "rows"] = self.column_block_of(cfg.name, state[k + "rows"])
        super()._load_from_state_dict(state, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
