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
import torch.distributed as dist
import torch.nn.functional as F

from .. import _native
from .. import checkpoint as ckpt
from ..distributed import Comm
from ..errors import ConfigError, InputError
from ..models import ClickCountUpdater
from ._build import build_model, make_dense_optimizer, resolve_device, seed_everything
from ._config import EVAL_POINTS, TrainConfig
from ._evaluate import evaluate
from ._record import RunRecord, TrainState
from ._distributed import as_sharding_error, check_process_group, empty_batch, merge_metrics, wrap_ddp
from ._sources import DataSource, make_source, run_schema
from ._snapshots import TrainerSnapshots
from ._report import TrainerReport
from ._stale import StaleRun
from ._queue import queue_source
from ._servers import check_servers, run_source, workers_group

__all__ = ["Trainer", "TrainState"]

ProgressFn = Callable[[str, dict[str, Any]], None]


class Trainer(TrainerSnapshots, TrainerReport):
    """Trains a model as a TrainConfig says.

    Args:
        config: the run.
        progress: called with (event, info) for "start", "step", "eval", "checkpoint", "end", and "note"
            (``info["message"]``: something the user should be told, e.g. how a small file was split).
        rank, world_size: this process's place in a distributed run (1 process: 0, 1).  With
            several, torch.distributed must be initialised (``torchrun ... -m hugeembed train``
            or ``hugeembed train --nproc N`` do it): tables are sharded, the dense part runs
            under DistributedDataParallel, each rank reads its slice of every global batch,
            metrics are merged over all ranks' predictions, snapshots hold every rank's shards.  With
            ``config.servers`` M, the last M ranks hold the shards and read no data (_servers.py).

    Example::

        summary = Trainer(TrainConfig(model="dlrm", steps=300)).fit()
        summary["auc"], summary["samples_per_s"]
    """

    def __init__(self, config: TrainConfig, *, progress: ProgressFn | None = None, rank: int = 0,
                 world_size: int = 1, source: DataSource | None = None) -> None:
        self.cfg = config
        self.rank, self.world_size = rank, world_size
        self.progress = progress or (lambda event, info: None)
        self.device = resolve_device(config.device, tiered=config.memory_budget is not None)
        if config.threads:
            torch.set_num_threads(config.threads)
        _native.tune_malloc()
        seed_everything(config.model_seed)
        check_servers(config.servers, world_size)
        # --servers M: the last M ranks hold the tables' shards and train on empty batches (_servers.py)
        self.workers = world_size - config.servers
        self.is_server = rank >= self.workers
        if world_size > 1:
            check_process_group(rank, world_size)
        self.schema = run_schema(config, self._saved_schema())
        self.epoch_choice = None
        if config.choose_epochs is not None:
            self.cfg = config = self._choose_epochs(config)
        self.model, dense_params = build_model(config, self.device, world_size, self.schema)
        self.collection = self.model.embeddings
        self.count_calibration: float | None = None  # the intercept's shift at the run's end (counts.calibrate)
        # the module a step calls: DDP all-reduces the dense gradients; the tables exchange their own
        staleness, dense_staleness = (config.staleness, config.dense_staleness) if world_size > 1 else (0, 0)
        dense_group = workers_group(world_size, config.servers) if world_size > 1 else None
        # (under staleness the dense gradients are all-reduced in the background instead: _stale.py); servers
        # train no dense part: the workers all-reduce among themselves
        self.step_model = wrap_ddp(self.model, self.device, dense_group) \
            if world_size > 1 and not (staleness or dense_staleness or self.is_server) else self.model
        self.dense_optimizer = make_dense_optimizer(config.dense_optimizer, dense_params, config.dense_lr)
        self.stale = StaleRun(self.collection, self._dense_params(), staleness, dense_staleness, config.jitter_spec(),
                              config.seed, rank, config.dist_timeout, dense_group=dense_group,
                              dense=not self.is_server, stale_scale=config.stale_scale)
        # the loop's own small collectives (loss reports): on the default group, apart from the exchange thread
        self._loop_comm = Comm(dist.group.WORLD, config.dist_timeout) if world_size > 1 else None
        # a DLRM's click counts (click_counts), else does nothing; sharded: each rank's pairs reach every rank
        # over the loop's group (the default one: DDP's all-reduce is done by the time a step counts)
        self.counts = ClickCountUpdater(self.model, comm=self._loop_comm)
        self.source: DataSource
        if source is None and config.servers and world_size > 1:  # workers read their slices (or the queue's)
            self.source = run_source(config, rank, world_size, self.schema,
                                     empty_batch(self.collection.feature_names(), self.model.num_dense, self.device))
        else:
            self.source = source if source is not None else make_source(config, rank, world_size, self.schema)
            if config.data_queue is not None:  # ranks take chunks of the epoch from a shared queue instead of slices
                self.source = queue_source(self.source, config.data_queue, config.batch_size, rank, world_size,
                                           config.dist_timeout)
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

    def _choose_epochs(self, config: TrainConfig) -> TrainConfig:
        """The run's config with its passes chosen on a held-out tail (a seeded trial run: _choose.py)."""
        from ._choose import choose_epochs

        if self.world_size > 1:
            raise ConfigError("choose-epochs runs its trial in one process: give --epochs with several processes")
        self.epoch_choice = choose_epochs(config, self.schema)
        self.progress("note", {"message": self.epoch_choice.message()})
        seed_everything(config.model_seed)  # the run starts as one given these passes would
        return config.replace(epochs=self.epoch_choice.epochs)

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
        self.counts.clear_calibration()
        done = total is not None and st.step >= total
        while not done:
            any_batch = False
            for batch in self.stale.batches(self._with_prefetch(self.source.train_batches(
                    st.epoch, skip=st.step_in_epoch)), st.step, self.device, self._drains_after):
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
        self._drain()  # the last steps' dense gradients first
        self._apply_dense_average()
        # click counts: the final model's mean prediction on the training rows made their click rate (_count_fit.py)
        rows = self.source.train_batches(0)
        self.count_calibration = self.counts.calibrate(self._aligned(rows) if self.world_size > 1 else rows,
                                                       self.device)
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

    def _drain(self) -> None:
        """Under staleness: every exchange and dense gradient still in flight lands (counted as training time)."""
        t0 = time.perf_counter()
        self.stale.drain(self.dense_optimizer)
        self.state.train_seconds += time.perf_counter() - t0

    def _drains_after(self, step: int) -> bool:
        """Whether an evaluation, a snapshot or the run's end follows training step `step` (1-based)."""
        cfg, total = self.cfg, self.total_steps()
        return bool((self._eval_every and step % self._eval_every == 0)
                    or (cfg.checkpoint_dir and cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
                    or (total is not None and step >= total))

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
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self.counts.before_step(st.step_in_epoch)
        batch = batch.to(self.device, non_blocking=True)
        try:
            logits = self.step_model(batch.dense, batch.sparse)
            if self.cfg.data_queue is None and not self.is_server:
                loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            else:  # the queue's short (or empty) batches weigh by their rows; a server's are empty
                loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum") / self.cfg.batch_size
            self.dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()  # the embedding tables are updated in here
        except RuntimeError as e:
            err = as_sharding_error(e, self.rank, st.step + 1, "the dense gradient all-reduce (DDP)") \
                if self.world_size > 1 else None
            if err is not None:
                raise err from e
            raise
        if not self.is_server:  # a server's dense layers see no data: they are never stepped
            self.stale.dense_step(st.step + 1, self.dense_optimizer)
        self.collection.optimizer.step()
        # after the batch's forward read the earlier rows' counts; the count weights fitted on the batch first
        self.counts.add(batch.sparse, batch.labels, logits.detach(), f)
        self.stale.straggle(time.thread_time() - cpu0)
        if self.cfg.average_dense and f < 1.0 and not self.is_server:
            self.state.add_to_dense_average(self._dense_params())
        value = float(loss.detach())
        st.train_seconds += time.perf_counter() - t0
        st.step += 1
        st.step_in_epoch += 1
        st.samples += self.source.trained(batch, self.workers)
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss became {value} at step {st.step}: lower the learning rates")
        if self.cfg.data_queue is not None and batch.batch_size:  # the mean over the batch's rows
            value *= self.cfg.batch_size / batch.batch_size
        if batch.batch_size:  # a rank that ran out of the queue's rows trains empty batches: no loss to report
            st.loss_sum += value
            st.loss_count += 1
        if st.step % self._record_every == 0 or st.step == 1:
            self._record_loss()

    def _dense_params(self) -> list[torch.Tensor]:
        return [p for g in self.dense_optimizer.param_groups for p in g["params"]]

    def _apply_dense_average(self) -> None:
        """The end of the run: the dense parameters become their mean over the decay phase."""
        self.state.apply_dense_average(self._dense_params())

    def _record_loss(self) -> None:
        """Appends the mean loss since the last record to the history (and reports it)."""
        st = self.state
        if self.world_size > 1:  # the mean over every rank's local losses (one small collective; on every rank,
            # also one whose batches were all empty: --data-queue's ranks that ran out)
            sums = self._loop_comm.all_gather_object("loss report", (st.loss_sum, st.loss_count))
            st.loss_sum, st.loss_count = sum(s for s, _ in sums), sum(c for _, c in sums)
        if st.loss_count:
            avg = st.loss_sum / st.loss_count
            st.history["step"].append(st.step)
            st.history["loss"].append(avg)
            st.loss_sum, st.loss_count = 0.0, 0
            tiers = self._tier_stats()
            self.progress("step", {"step": st.step, "loss": avg, "samples_per_s": self.samples_per_s(),
                                   "auc": None if st.last_eval is None else st.last_eval["auc"],
                                   "cache_hit_rate": None if tiers is None else tiers["cache_hit_rate"]})

    # -- evaluation ----------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics over the whole held-out set (no id is inserted or counted)."""
        self._drain()
        if self.world_size > 1:  # every rank scores its slice; the accumulators are merged exactly
            metrics = evaluate(self.model, self._aligned(self.source.eval_batches()), self.device,
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
