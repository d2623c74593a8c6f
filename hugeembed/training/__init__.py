"""Training runs: TrainConfig, the Trainer loop (eval, snapshots, resume) and data sources."""

from ._config import DENSE_OPTIMIZERS, MODELS, SPARSE_OPTIMIZERS, TrainConfig
from ._evaluate import evaluate_snapshot, load_snapshot_model
from ._launch import launch_local, run_local
from ._sources import DataSource, FileSource, SyntheticSource, make_source
from ._record import RunRecord, TrainState
from ._trainer import Trainer, build_model, evaluate, make_dense_optimizer, resolve_device

__all__ = [
    "TrainConfig",
    "Trainer",
    "TrainState",
    "RunRecord",
    "evaluate",
    "evaluate_snapshot",
    "load_snapshot_model",
    "build_model",
    "make_dense_optimizer",
    "resolve_device",
    "DataSource",
    "SyntheticSource",
    "FileSource",
    "make_source",
    "launch_local",
    "run_local",
    "DENSE_OPTIMIZERS",
    "SPARSE_OPTIMIZERS",
    "MODELS",
]
