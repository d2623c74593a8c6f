"""Runs in a checkpoint directory: which run wrote a snapshot, and a fresh run's claim on the directory.

Every snapshot's manifest names its run (``run_id``, drawn when a run starts and kept by its
resumes).  A run removes only its own snapshots when pruning and never replaces another
run's ``step-N``; a run that does not resume refuses a directory holding snapshots (they are
another run's: its pruning would never touch them, but LATEST, eval and export would mix the
two), unless told to delete them first.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from ..errors import CheckpointError
from ._manifest import LATEST, MANIFEST, is_snapshot_name

__all__ = ["new_run_id", "run_of", "describe_run", "claim_for_fresh_run"]


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def run_of(snap: Path) -> str | None:
    """The run id a snapshot's manifest names (None: none, or an unreadable manifest).  Never raises."""
    try:
        rid = json.loads((Path(snap) / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) else None


def describe_run(run_id: str | None) -> str:
    return f"run {run_id}" if run_id else "a run without a run id"


def claim_for_fresh_run(root: str | Path, *, overwrite: bool) -> int:
    """Prepares `root` for a run that does not resume; returns how many snapshots it deleted.

    CheckpointError naming the run found when `root` holds complete snapshots, unless
    `overwrite`: then every ``step-*`` snapshot directory and LATEST are deleted first.
    The caller holds the directory's lock (CheckpointLock)."""
    from ._restore import list_snapshots

    root = Path(root)
    if not root.is_dir():
        return 0
    snaps = list_snapshots(root)
    if not overwrite:
        if snaps:
            newest = snaps[-1]
            raise CheckpointError(
                f"{root} holds {len(snaps)} snapshot{'s' if len(snaps) > 1 else ''} of another run "
                f"({describe_run(run_of(newest))}, newest {newest.name}): continue that run with --resume, or "
                f"delete them and start afresh with --overwrite")
        return 0
    doomed = [d for d in root.iterdir() if is_snapshot_name(d.name) and d.is_dir() and not d.is_symlink()]
    (root / LATEST).unlink(missing_ok=True)  # first: a crash half-way leaves no pointer to a deleted snapshot
    for d in doomed:
        shutil.rmtree(d)
    return len([d for d in doomed if d in snaps])
