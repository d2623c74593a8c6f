"""Embedding tables spread over the ranks of a torch.distributed process group.

* :class:`ShardingPlan` / :class:`TablePlacement`: where each table lives (plain data);
  :func:`propose_plan` proposes one from sizes, dims, optimizer state and a memory budget.
* :class:`ShardedEmbeddingCollection`: the EmbeddingCollection API over a process group
  (row-wise = HugeCTR's "distributed", table-wise = "localized", data-parallel replicas).
* :class:`Comm`: the collectives, each with a timeout that turns a dead peer into a
  :class:`~hugeembed.errors.ShardingError` naming the step and the stage.
* ``ShardedEmbeddingCollection(staleness=K)`` + :class:`DelayedDenseGrads`: bounded staleness
  (exchanges K steps ahead on a thread; dense gradients applied K steps later).
* ``ShardedEmbeddingCollection(servers=M)`` / ``propose_plan(..., servers=M)``: the last M ranks hold
  every shard and feed empty batches (parameter servers).

See docs/distributed.md.
"""

from ._comm import DEFAULT_TIMEOUT_S, Comm, ExchangeStats, new_embedding_group
from ._dense import DelayedDenseGrads
from ._env import DistEnv, init_from_env, launch_command
from ._estimate import TableEstimate, estimate_table
from ._plan import ShardingPlan, TablePlacement, propose_plan
from ._sharded import ShardedEmbeddingCollection
from ._stores import AbsentShard, ShardArrayStore

__all__ = [
    "ShardingPlan",
    "TablePlacement",
    "TableEstimate",
    "estimate_table",
    "propose_plan",
    "ShardedEmbeddingCollection",
    "Comm",
    "ExchangeStats",
    "new_embedding_group",
    "DEFAULT_TIMEOUT_S",
    "DistEnv",
    "init_from_env",
    "launch_command",
    "ShardArrayStore",
    "AbsentShard",
    "DelayedDenseGrads",
]
