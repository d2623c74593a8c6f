"""How a run's model is built from its config: device, tables (in memory, on disk tiers or sharded),
dense optimizer, admission default, seeds."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from .._device import canonical_device
from ..errors import ConfigError
from ..models import DEFAULT_ADMIT_MIN_COUNT, make_model
from ..nn import EmbeddingCollection
from ..optim import make_optimizer
from ._config import TrainConfig
from ._config_checks import DENSE_OPTIMIZER_CLASSES
from ._distributed import sharded_factory
from ._sources import make_source

__all__ = ["resolve_device", "make_dense_optimizer", "build_model", "admit_min_count", "seed_everything"]


def resolve_device(name: str, *, tiered: bool = False) -> torch.device:
    """The device `name` names; "auto" is CUDA when present, except for a run with disk-tiered
    tables (`tiered`), whose rows live in host memory and files: it runs on the CPU."""
    if name == "auto":
        return canonical_device("cuda" if torch.cuda.is_available() and not tiered else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available here")
    return canonical_device(device)


def make_dense_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """A torch optimizer for the dense parameters, with torch's fused kernel (one pass over
    all parameters instead of ~10 ops per tensor; same update)."""
    params = list(params)
    if name not in DENSE_OPTIMIZER_CLASSES:
        raise ConfigError(f"unknown dense optimizer {name!r}; choose one of {', '.join(DENSE_OPTIMIZER_CLASSES)}")
    kwargs: dict[str, Any] = {"lr": lr}
    if name == "sgd":
        kwargs["momentum"] = 0.9
    if params and all(p.device.type in ("cpu", "cuda") for p in params):
        kwargs["fused"] = True
    return getattr(torch.optim, DENSE_OPTIMIZER_CLASSES[name])(params, **kwargs)


def _tiered_factory(cfg: TrainConfig, world_size: int = 1, schema=None):
    """Builds the collection with every table on disk under cfg.storage_dir, the memory budget split by
    the traffic of the first batches of the data (training/_tiers.py); with several processes the
    budget is each rank's, split over the shards it holds.  The run's checkpoint directory names
    it as the tier's owner, so a resume reuses the directory a crash left."""
    from itertools import islice

    from ._tiers import batch_traffic, shard_traffic, tiered_tables

    owner = os.path.abspath(cfg.checkpoint_dir) if cfg.checkpoint_dir else None

    first: list = []  # the batches read once (fit_replicas may try several plans)

    def tier(tables, optimizer, plan=None):
        # a look at the first global batches that leaves every random state as it was: a tiered
        # run's numbers equal the in-memory run's (the same batches on every rank: the split agrees)
        states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        try:
            readers = world_size - cfg.servers if world_size > 1 else 1  # --servers read no data
            whole = cfg.replace(batch_size=cfg.batch_size * readers, servers=0) if world_size > 1 else cfg
            if not first:
                first.append(list(islice(make_source(whole, schema=schema).train_batches(0), 4)))
            batches = first[0]
        finally:
            torch.set_rng_state(states[0])
            np.random.set_state(states[1])
            random.setstate(states[2])
        row_bytes = {t.name: t.row_layout(t.optimizer or (optimizer if t.trainable else None)).row_bytes
                     for t in tables}
        traffic = batch_traffic(tables, batches) if plan is None else shard_traffic(tables, batches, plan)
        return tiered_tables(tables, cfg.memory_budget, cfg.storage_dir, cfg.cache_policy, traffic, row_bytes,
                             plan), owner

    if world_size > 1:
        return sharded_factory(cfg, world_size, tiers=lambda tables, plan, optimizer: tier(tables, optimizer, plan))

    def factory(tables, **kw):
        tables, _ = tier(tables, kw.get("optimizer"))
        return EmbeddingCollection(tables, storage_owner=owner, **kw)

    return factory


def build_model(cfg: TrainConfig, device: torch.device, world_size: int = 1, schema=None, collection_factory=None):
    """The run's model and its dense parameters (tables and dense weights seeded by cfg.model_seed).

    `schema`: the run's data schema (hugeembed.data.Schema; None or Criteo's: the Criteo tables).
    With ``world_size > 1`` the tables are a ShardedEmbeddingCollection over the default
    process group's ranks (collective: every rank builds its model).  `collection_factory`: builds the
    collection instead (``--servers``' plan check on the meta device).
    """
    rule = make_optimizer(cfg.sparse_optimizer, **cfg.sparse_optimizer_options())
    own = cfg.first_order_optimizer_options()
    biases = None if own is None else make_optimizer(cfg.sparse_optimizer, **own)
    if schema is not None and schema.is_criteo():
        schema = None  # the Criteo tables as they always were
    if collection_factory is not None:
        factory = collection_factory
    elif cfg.memory_budget is not None:
        factory = _tiered_factory(cfg, world_size, schema)
    else:
        factory = sharded_factory(cfg, world_size) if world_size > 1 else None
    return make_model(cfg.model, embedding_dim=cfg.embedding_dim, sparse_optimizer=rule, device=device,
                      seed=cfg.model_seed, capacity=cfg.capacity, initializer=cfg.init,
                      admit_min_count=admit_min_count(cfg), lr_count_scale=cfg.lr_count_scale,
                      first_order=cfg.first_order, first_order_optimizer=biases,
                      first_order_admit_min_count=cfg.first_order_admit_min_count,
                      first_order_lr_count_scale=cfg.first_order_lr_count_scale, dropout=cfg.dropout,
                      click_counts=cfg.click_counts or None,
                      collection_factory=factory, schema=schema)


def admit_min_count(cfg: TrainConfig) -> int:
    """The run's admission threshold: the config's, or by default make_model's (with any number of
    processes: sharded tables keep the shared row of rare ids as one process does)."""
    return cfg.admit_min_count if cfg.admit_min_count is not None else DEFAULT_ADMIT_MIN_COUNT


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)

