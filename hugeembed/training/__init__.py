"""Training runs: TrainConfig, the Trainer loop (eval, snapshots, resume) and data sources."""

from ._config import TrainConfig
from ._config_checks import DENSE_OPTIMIZERS, MODELS, SPARSE_OPTIMIZERS
from ._evaluate import evaluate, evaluate_snapshot, load_snapshot_model
from ._launch import launch_local, run_local
from ._sources import DataSource, FileSource, SyntheticSource, default_epochs, make_source, run_schema
from ._record import RunRecord, TrainState
from ._build import build_model, make_dense_optimizer, resolve_device
from ._trainer import Trainer
from ._servers import check_server_plan

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
    "run_schema",
    "default_epochs",
    "launch_local",
    "run_local",
    "check_server_plan",
    "DENSE_OPTIMIZERS",
    "SPARSE_OPTIMIZERS",
    "MODELS",
]
