"""Trainer: the training loop of a CTR model on embedding tables, with eval, snapshots and resume.

One step: batch -> model(dense, sparse) -> BCE loss -> backward (tables update
themselves inside backward) -> dense optimizer step.  Every `eval_every` steps the
held-out set is scored (AUC, log loss, CTR, PCTR, COPC over all of it); every
`checkpoint_every` steps an atomic snapshot is written (tables, dense model,
optimizers, RNG, data position), from which ``resume`` continues bit-identically;
with `full_checkpoint_every` K > 1, every K-th is full and the others are deltas.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import _native
from .. import checkpoint as ckpt
from ..errors import CheckpointError, ConfigError, InputError
from ..metrics import MetricSet
from ._build import build_model, make_dense_optimizer, resolve_device, seed_everything
from ._config import EVAL_POINTS, TrainConfig
from ._record import RunRecord, TrainState
from ._distributed import (aligned, as_sharding_error, check_process_group, empty_batch, merge_metrics,
                           merged_tier_stats, run_info, wrap_ddp)
from ._sources import DataSource, make_source, run_schema

__all__ = ["Trainer", "TrainState", "evaluate"]

ProgressFn = Callable[[str, dict[str, Any]], None]



class Trainer:
    """Trains a model as a TrainConfig says.

    Args:
        config: the run.
        progress: called with (event, info) for "start", "step", "eval", "checkpoint", "end", and "note"
            (``info["message"]``: something the user should be told, e.g. how a small file was split).
        rank, world_size: this process's place in a distributed run (1 process: 0, 1).  With
            several, torch.distributed must be initialised (``torchrun ... -m hugeembed train``
            or ``hugeembed train --nproc N`` do it): tables are sharded, the dense part runs
            under DistributedDataParallel, each rank reads its slice of every global batch,
            metrics are merged over all ranks' predictions, snapshots hold every rank's shards.

    Example::

        summary = Trainer(TrainConfig(model="dlrm", steps=300)).fit()
        summary["auc"], summary["samples_per_s"]
    """

    def __init__(self, config: TrainConfig, *, progress: ProgressFn | None = None, rank: int = 0,
                 world_size: int = 1) -> None:
        self.cfg = config
        self.rank, self.world_size = rank, world_size
        self.progress = progress or (lambda event, info: None)
        self.device = resolve_device(config.device, tiered=config.memory_budget is not None)
        if config.threads:
            torch.set_num_threads(config.threads)
        _native.tune_malloc()
        seed_everything(config.seed)
        if world_size > 1:
            check_process_group(rank, world_size)
        self.schema = run_schema(config, self._saved_schema())
        self.model, dense_params = build_model(config, self.device, world_size, self.schema)
        self.collection = self.model.embeddings
        # the module a step calls: DDP all-reduces the dense gradients; the tables exchange their own
        self.step_model = wrap_ddp(self.model, self.device) if world_size > 1 else self.model
        self.dense_optimizer = make_dense_optimizer(config.dense_optimizer, dense_params, config.dense_lr)
        self.source: DataSource = make_source(config, rank, world_size, self.schema)
        self.state = TrainState()
        self.run_id: str | None = None  # names this run in its snapshots (set when fit claims checkpoint_dir)
        # the loss curve gets a point every log_every steps, more often on short runs (~50 points)
        total = self.total_steps()
        self._record_every = config.log_every if total is None else max(1, min(config.log_every, total // 50))
        expected = total if total is not None else None if self.source.estimated_steps_per_epoch is None else \
            self.source.estimated_steps_per_epoch * config.epochs
        self._expected_steps = expected
        self._eval_every = config.eval_every if config.eval_every is not None else \
            100 if expected is None else max(1, expected // EVAL_POINTS)
        self._base_lrs = [[g["lr"] for g in o.param_groups] for o in (self.dense_optimizer, self.collection.optimizer)]

    def _saved_schema(self):
        """The schema (with its statistics) of the snapshot a resume continues from, if any."""
        if not (self.cfg.resume and self.cfg.checkpoint_dir) or not Path(self.cfg.checkpoint_dir).exists():
            return None
        snap = ckpt.latest(self.cfg.checkpoint_dir)
        if snap is None:
            return None
        return RunRecord.from_dict(ckpt.read_extra(snap), str(snap)).schema

    # -- the loop ------------------------------------------------------------------

    def total_steps(self) -> int | None:
        if self.cfg.steps is not None:
            return self.cfg.steps
        spe = self.source.steps_per_epoch
        return None if spe is None else spe * self.cfg.epochs

    def fit(self) -> dict[str, Any]:
        """Trains (resuming if asked), evaluates, snapshots; returns the summary.

        With a checkpoint_dir the run holds its lock throughout (rank 0 takes it for all
        ranks): a second run writing into the same directory is refused with a CheckpointError,
        and so is a run without resume into a directory holding snapshots (another run's),
        unless `overwrite` (which deletes them first).
        """
        lock = self._claim_checkpoint_dir()
        try:
            return self._fit()
        finally:
            if lock is not None:
                lock.release()

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

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.resume:
            self.resume()
        st = self.state  # after resume(), which replaces it
        total = self.total_steps()
        for note in self.source.notes:
            self.progress("note", {"message": note})
        if cfg.resume and st.step > 0 and (st.step >= total if total is not None else st.epoch >= cfg.epochs):
            if st.dense_average is not None:
                # a snapshot of the last step saved before the run ended (an epoch's last batch), and
                # the process died before the averaged model was saved: finish that now
                return self._finish()
            # finished already: no second evaluation or snapshot of the last step
            self.progress("note", {"message": f"{cfg.checkpoint_dir}: the run is complete (step {st.step}"
                                              + (f" of {total}" if total is not None else f", epoch {st.epoch}")
                                              + "): nothing to do, nothing changed"})
            summary = self.summary()
            self.progress("end", summary)
            return summary
        self.progress("start", {"total_steps": total, "data": self.source.description, "resumed_at": st.step,
                                "device": str(self.device), "model": cfg.model, "world_size": self.world_size})
        self.model.train()
        done = total is not None and st.step >= total
        while not done:
            any_batch = False
            for batch in self._with_prefetch(self.source.train_batches(st.epoch, skip=st.step_in_epoch)):
                any_batch = True
                self._train_step(batch)
                if self._eval_every and st.step % self._eval_every == 0 and (total is None or st.step < total):
                    self.evaluate()
                last = total is not None and st.step >= total
                # the run's last snapshot is saved after the loop, with the averaged dense layers
                if cfg.checkpoint_dir and cfg.checkpoint_every and st.step % cfg.checkpoint_every == 0 and not last:
                    self.save()
                if last:
                    done = True
                    break
            if done:
                break
            if not any_batch and st.step_in_epoch == 0:
                raise ConfigError(f"{self.source.description}: no training batch of {cfg.batch_size} rows")
            st.epoch += 1
            st.step_in_epoch = 0
            if cfg.steps is None and st.epoch >= cfg.epochs:
                break
        self._record_loss()  # the curve ends at the last step
        return self._finish()

    def _finish(self) -> dict[str, Any]:
        """The end of a run: the averaged dense layers, the last evaluation and snapshot, the summary."""
        self._apply_dense_average()
        self.evaluate()
        if self.cfg.checkpoint_dir:
            self.save()
        summary = self.summary()
        self.progress("end", summary)
        return summary

    def _with_prefetch(self, batches):
        """The batches, and before each step the next batch's disk-only rows of tiered tables start
        loading in the background (collection.prefetch): the reads overlap the step's compute."""
        if not self.collection.has_tiered_tables:
            yield from batches
            return
        it = iter(batches)
        cur = next(it, None)
        while cur is not None:
            nxt = next(it, None)
            if nxt is not None:
                self.collection.prefetch(nxt.sparse)
            yield cur
            cur = nxt

    def lr_factor(self, step: int) -> float:
        """The learning rates' multiplier at training step `step` (0-based): 1, then falling
        linearly to 0 over the last `lr_decay` of the expected steps (a pure function of the
        step, so a resumed run decays as the uninterrupted one)."""
        n, frac = self._expected_steps, self.cfg.lr_decay
        if not n or frac <= 0.0:
            return 1.0
        tail = max(1, round(n * frac))
        return min(1.0, max(0.0, (n - step) / tail))

    def _train_step(self, batch) -> None:
        st = self.state
        f = self.lr_factor(st.step)
        for opt, base in zip((self.dense_optimizer, self.collection.optimizer), self._base_lrs):
            for group, lr in zip(opt.param_groups, base):
                group["lr"] = lr * f
        t0 = time.perf_counter()
        batch = batch.to(self.device, non_blocking=True)
        try:
            logits = self.step_model(batch.dense, batch.sparse)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            self.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()  # the embedding tables are updated in here
        except RuntimeError as e:
            err = as_sharding_error(e, self.rank, st.step + 1, "the dense gradient all-reduce (DDP)") \
                if self.world_size > 1 else None
            if err is not None:
                raise err from e
            raise
        self.dense_optimizer.step()
        self.collection.optimizer.step()
        if self.cfg.average_dense and f < 1.0:
            self._add_to_dense_average()
        value = float(loss.detach())
        st.train_seconds += time.perf_counter() - t0
        st.step += 1
        st.step_in_epoch += 1
        st.samples += batch.batch_size * self.world_size
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss became {value} at step {st.step}: lower the learning rates")
        st.loss_sum += value
        st.loss_count += 1
        if st.step % self._record_every == 0 or st.step == 1:
            self._record_loss()

    def _dense_params(self) -> list[torch.Tensor]:
        return [p for g in self.dense_optimizer.param_groups for p in g["params"]]

    @torch.no_grad()
    def _add_to_dense_average(self) -> None:
        """The running mean of the dense parameters over the decay phase's steps so far (kept in
        the train state, so a snapshot mid-phase resumes it exactly)."""
        st = self.state
        params = self._dense_params()
        if st.dense_average is None:
            st.dense_average, st.dense_average_steps = [p.detach().clone() for p in params], 1
            return
        st.dense_average_steps += 1
        w = 1.0 / st.dense_average_steps
        for avg, p in zip(st.dense_average, params):
            avg.lerp_(p.detach(), w)

    @torch.no_grad()
    def _apply_dense_average(self) -> None:
        """The end of the run: the dense parameters become their mean over the decay phase."""
        st = self.state
        if st.dense_average is None:
            return
        for avg, p in zip(st.dense_average, self._dense_params()):
            p.copy_(avg)
        st.dense_average, st.dense_average_steps = None, 0

    def _record_loss(self) -> None:
        """Appends the mean loss since the last record to the history (and reports it)."""
        st = self.state
        if st.loss_count:
            if self.world_size > 1:  # the mean over every rank's local losses (one small collective)
                sums = self.collection.comm.all_gather_object("loss report", (st.loss_sum, st.loss_count))
                st.loss_sum, st.loss_count = sum(s for s, _ in sums), sum(c for _, c in sums)
            avg = st.loss_sum / st.loss_count
            st.history["step"].append(st.step)
            st.history["loss"].append(avg)
            st.loss_sum, st.loss_count = 0.0, 0
            tiers = self._tier_stats()
            self.progress("step", {"step": st.step, "loss": avg, "samples_per_s": self.samples_per_s(),
                                   "auc": None if st.last_eval is None else st.last_eval["auc"],
                                   "cache_hit_rate": None if tiers is None else tiers["cache_hit_rate"]})

    def _tier_stats(self) -> dict | None:
        """The tiers' figures of every rank (collective with several processes)."""
        return merged_tier_stats(self.collection) if self.world_size > 1 else self.collection.tier_stats()

    def samples_per_s(self) -> float:
        return self.state.samples / self.state.train_seconds if self.state.train_seconds else 0.0

    # -- evaluation ----------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole held-out set (no id is inserted or counted)."""
        if self.world_size > 1:  # every rank scores its slice; the accumulators are merged exactly
            empty = empty_batch(self.collection.feature_names(), self.model.num_dense, self.device)
            metrics = evaluate(self.model, aligned(self.source.eval_batches(), self.collection, empty), self.device,
                               merge=lambda ms: merge_metrics(self.collection, ms))
        else:
            metrics = evaluate(self.model, self.source.eval_batches(), self.device)
        if metrics["count"] == 0:  # metrics of nothing would be NaNs reported as results
            where = ", ".join(self.cfg.eval_data) or self.source.description
            raise InputError(f"{where}: no held-out rows to evaluate on")
        st = self.state
        st.last_eval = metrics
        st.history["eval_step"].append(st.step)
        st.history["auc"].append(metrics["auc"])
        st.history["logloss"].append(metrics["logloss"])
        st.history["copc"].append(metrics["copc"])
        self.progress("eval", {"step": st.step, **metrics})
        return metrics

    # -- snapshots -----------------------------------------------------------------

    def save(self):
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
        changed = [k for k in ("model", "embedding_dim", "sparse_optimizer", "seed", "init", "admit_min_count",
                               "lr_count_scale", "average_dense")
                   if getattr(saved, k) != getattr(self.cfg, k)]
        msgs = [f"{k} ({getattr(saved, k)!r} vs {getattr(self.cfg, k)!r}"
                + (f": give --{'' if saved.average_dense else 'no-'}average-dense as saved)" if k == "average_dense"
                   else ")") for k in changed]
        # Adam's betas / eps as the runs resolve them (a snapshot of older code: torch's)
        theirs, mine = ({k: v for k, v in c.sparse_optimizer_options().items() if k != "lr"} for c in (saved, self.cfg))
        if "sparse_optimizer" not in changed and theirs != mine:
            msgs.append(f"sparse optimizer settings ({theirs} vs {mine}: give --sparse-betas / --sparse-eps as saved)")
        # any number of processes may resume, but the data position counts global batches
        if saved.batch_size * record.world_size != self.cfg.batch_size * self.world_size:
            msgs.append(f"global batch ({saved.batch_size} x {record.world_size} processes vs "
                        f"{self.cfg.batch_size} x {self.world_size})")
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

    # -- reporting -------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        st = self.state
        if self.world_size > 1:
            info = run_info(self.collection)
            rows, table_bytes = info["rows"], info["bytes"]
        else:
            rows = self.collection.num_rows()
            table_bytes = sum(self.collection.memory_bytes().values())
        dense_bytes = sum(p.numel() * p.element_size() for p in self.model.dense_parameters())
        out: dict[str, Any] = {
            "model": self.cfg.model, "steps": st.step, "epochs": st.epoch, "samples": st.samples,
            "samples_per_s": self.samples_per_s(), "train_seconds": st.train_seconds,
            "final_train_loss": st.history["loss"][-1] if st.history["loss"] else float("nan"),
            "table_rows": sum(rows.values()), "table_rows_per_table": rows, "table_bytes": table_bytes,
            "dense_bytes": dense_bytes, "device": str(self.device), "world_size": self.world_size,
            "data": self.source.description,
        }
        out.update(st.last_eval or {})
        tiers = self._tier_stats()
        if tiers is not None:
            out.update({k: tiers[k] for k in ("cache_hit_rate", "table_bytes_resident", "table_bytes_stored")})
            out["tiers"] = tiers["tables"]
        bayes = self.source.bayes()
        if bayes is not None:
            out["bayes_auc"], out["bayes_logloss"] = bayes.auc, bayes.logloss
        out["history"] = st.history
        return out


@torch.no_grad()
def evaluate(model, batches, device: torch.device, merge: Callable[[MetricSet], MetricSet] | None = None,
             keep_predictions: list[torch.Tensor] | None = None) -> dict[str, float]:
    """AUC, log loss, CTR, PCTR and COPC of `model` over `batches` (eval mode: nothing inserted).

    `keep_predictions`: a list that receives each batch's probabilities (CPU float32), in order."""
    was_training = model.training
    model.eval()
    ms = MetricSet()
    try:
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            probs = torch.sigmoid(model(batch.dense, batch.sparse))
            ms.update(probs, batch.labels)
            if keep_predictions is not None:
                keep_predictions.append(probs.float().cpu())
    finally:
        model.train(was_training)
    if merge is not None:
        ms = merge(ms)
    return ms.compute()
