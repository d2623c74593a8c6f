"""Snapshots: atomic, checksummed saves of tables, dense model, optimizers and RNG state; full or incremental."""

from ._delta import DeltaParent, delta_parent, resolve_chain, snapshot_chain
from ._files import write_bytes, write_tensor
from ._lock import CheckpointLock
from ._manifest import DELTA_FORMAT_VERSION
from ._runs import claim_for_fresh_run, new_run_id, run_of
from ._restore import SnapshotInfo, latest, list_snapshots, load, read_extra, read_manifest, read_table
from ._snapshot import FORMAT_VERSION, save

__all__ = ["save", "load", "latest", "list_snapshots", "read_manifest", "read_extra", "read_table", "SnapshotInfo",
           "FORMAT_VERSION", "DELTA_FORMAT_VERSION", "CheckpointLock", "delta_parent", "snapshot_chain",
           "new_run_id", "run_of", "claim_for_fresh_run",
           # for other parts that write checksummed files and follow snapshot chains (hugeembed.serving)
           "DeltaParent", "resolve_chain", "write_tensor", "write_bytes"]
