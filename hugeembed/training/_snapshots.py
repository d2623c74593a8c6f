"""The Trainer's snapshots: the checkpoint directory's lock, save (full or delta), resume."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import checkpoint as ckpt
from ..errors import CheckpointError
from ._record import RunRecord

__all__ = ["TrainerSnapshots"]


class TrainerSnapshots:
    """Mixed into Trainer (which holds cfg, state, collection, model, dense_optimizer, ...)."""

    def _claim_checkpoint_dir(self) -> "ckpt.CheckpointLock | None":
        """Rank 0 locks the checkpoint directory and, for a run that does not resume, checks that it
        holds no snapshot (or deletes them: overwrite); every rank learns the outcome and the run's id."""
        if not self.cfg.checkpoint_dir:
            return None
        lock, err, removed = None, None, 0
        self.run_id = ckpt.new_run_id()  # a resume takes the id of the run it continues
        if self.rank == 0:
            try:
                lock = ckpt.CheckpointLock(self.cfg.checkpoint_dir).acquire()
                if not self.cfg.resume:
                    removed = ckpt.claim_for_fresh_run(self.cfg.checkpoint_dir, overwrite=self.cfg.overwrite)
            except (CheckpointError, OSError) as e:
                err = e
        if self.world_size > 1:  # every rank stops if rank 0 could not take it
            msg, self.run_id = self.collection.comm.all_gather_object(
                "checkpoint lock", (str(err) if err else None, self.run_id))[0]
            if msg is not None:
                if lock is not None:
                    lock.release()
                raise CheckpointError(msg)
        if err is not None:
            if lock is not None:
                lock.release()
            raise err
        if removed:
            self.progress("note", {"message": f"--overwrite: deleted {removed} snapshot{'s' if removed > 1 else ''} "
                                              f"of another run from {self.cfg.checkpoint_dir}"})
        return lock

    def save(self):
        self._drain()
        if self.cfg.data_queue is not None:  # the rows not trained yet (collective)
            self.state.data_queue = self.source.position()
        delta = self._next_is_delta()
        path = ckpt.save(self.cfg.checkpoint_dir, self.collection, model=self.model,
                         dense_optimizer=self.dense_optimizer, step=self.state.step, keep=self.cfg.keep_checkpoints,
                         extra=RunRecord(self.cfg, self.state, self.world_size, self.schema).to_dict(), delta=delta,
                         run_id=self.run_id)
        self.progress("checkpoint", {"step": self.state.step, "path": str(path), "kind": "delta" if delta else "full"})
        return path

    def _next_is_delta(self) -> bool:
        """Whether the next snapshot is a delta: with full_checkpoint_every K, a chain holds a full
        snapshot and K - 1 deltas (counted by the parent's depth, so a resumed run keeps the rhythm);
        a snapshot that no delta can follow (the first of a fresh run, say) starts a chain in full."""
        k = self.cfg.full_checkpoint_every
        if k == 1:
            return False
        parent = ckpt.delta_parent(self.cfg.checkpoint_dir, self.collection, self.state.step)
        mine = parent is not None and ckpt.read_manifest(parent).get("depth", 0) + 1 < k
        if self.world_size > 1:  # the save is collective: every rank passes the same delta=
            mine = all(self.collection.comm.all_gather_object("checkpoint kind", mine))
        return mine

    def resume(self) -> bool:
        """Loads the newest snapshot of checkpoint_dir (a delta: with its chain); False (fresh start) if none."""
        root = Path(self.cfg.checkpoint_dir)
        if not root.exists() or ckpt.latest(root) is None:
            return False
        snap = ckpt.latest(root)
        record = RunRecord.from_dict(ckpt.read_extra(snap), str(snap))  # compare runs before reading any table
        saved = record.config
        changed = [k for k in ("model", "embedding_dim", "sparse_optimizer", "seed", "init_seed", "init", "admit_min_count",
                               "lr_count_scale", "average_dense", "click_counts")
                   if getattr(saved, k) != getattr(self.cfg, k)]
        msgs = [f"{k} ({getattr(saved, k)!r} vs {getattr(self.cfg, k)!r}"
                + (f": give --{'' if getattr(saved, k) else 'no-'}{k.replace('_', '-')} as saved)"
                   if k in ("average_dense", "click_counts") else ")") for k in changed]
        # Adam's betas / eps as the runs resolve them (a snapshot of older code: torch's)
        theirs, mine = ({k: v for k, v in c.sparse_optimizer_options().items() if k != "lr"} for c in (saved, self.cfg))
        if "sparse_optimizer" not in changed and theirs != mine:
            msgs.append(f"sparse optimizer settings ({theirs} vs {mine}: give --sparse-betas / --sparse-eps as saved)")
        mid_epoch = record.state.step_in_epoch > 0 or record.state.data_queue is not None
        if (saved.data_queue is None) != (self.cfg.data_queue is None) and mid_epoch:
            msgs.append(f"data queue (--data-queue {saved.data_queue} vs {self.cfg.data_queue}: the position in "
                        f"the epoch is kept {'as rows' if saved.data_queue else 'in global batches'}; give it as saved)")
        # any number of processes may resume; the data position counts global batches (the queue's: rows)
        # (with --servers, the workers' processes: servers read no data)
        saved_workers = record.world_size - (saved.servers if record.world_size > 1 else 0)
        if saved.data_queue is None and saved.batch_size * saved_workers != self.cfg.batch_size * self.workers:
            msgs.append(f"global batch ({saved.batch_size} x {saved_workers} processes reading data vs "
                        f"{self.cfg.batch_size} x {self.workers})")
        if msgs:
            raise CheckpointError(f"{snap} was saved by a run with different " + ", ".join(msgs))
        params = self._dense_params()
        avg = record.state.dense_average
        if avg is not None and (len(avg) != len(params) or any(a.shape != p.shape for a, p in zip(avg, params))):
            raise CheckpointError(f"{snap}: train_state.dense_average holds {len(avg)} tensors of shapes "
                                  f"{[tuple(a.shape) for a in avg][:4]}..., not the model's dense parameters")
        ckpt.load(snap, self.collection, model=self.model, dense_optimizer=self.dense_optimizer)
        # the run goes on under its id (snapshots written before run ids: a new one, so that its
        # pruning never removes the id-less snapshots, which may be another run's)
        self.run_id = ckpt.run_of(snap) or self.run_id
        self.state = record.state
        if self.cfg.data_queue is not None:
            self.source.restore(self.state.data_queue)
        self._resume_dense_average(params)
        return True

    def _resume_dense_average(self, params: list[torch.Tensor]) -> None:
        """Keeps a resumed mean only if it covers this run's decay phase from its first step: a
        resume that changed the run's length or its decay has another phase (the mean restarts
        there), and the mean moves to the parameters' device (snapshots load on the CPU)."""
        st = self.state
        if st.dense_average is None:
            return
        first = st.step - st.dense_average_steps  # the step index the mean started at
        starts_phase = self.lr_factor(first) < 1.0 and (first == 0 or self.lr_factor(first - 1) >= 1.0)
        if not starts_phase:
            if st.step > 0 and self.lr_factor(st.step - 1) < 1.0:  # inside the new phase: part of it is lost
                self.progress("note", {"message": f"the run's length or lr decay changed on resume: the dense "
                                                  f"average restarts at step {st.step + 1}"})
            st.dense_average, st.dense_average_steps = None, 0
            return
        st.dense_average = [a.to(device=p.device, dtype=p.dtype) for a, p in zip(st.dense_average, params)]

