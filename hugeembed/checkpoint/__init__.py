"""Snapshots: atomic, checksummed saves of tables, dense model, optimizers and RNG state."""

from ._snapshot import FORMAT_VERSION, SnapshotInfo, latest, list_snapshots, load, read_manifest, save

__all__ = ["save", "load", "latest", "list_snapshots", "read_manifest", "SnapshotInfo", "FORMAT_VERSION"]
