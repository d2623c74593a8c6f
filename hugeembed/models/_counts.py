"""Counting inside the model: each id's clicks and hits, kept online, as a smoothed log-odds per feature.

A counting baseline (each value's smoothed click rate on the training data, added as logits) is a strong
model of click logs.  With click counts a DLRM adds the same statistic to its logit, one learned weight
per feature, and its network learns the rest.  The counts are computed from earlier rows only (CatBoost's
ordered target statistics): a training batch reads the counts of the rows before it, then adds its own
labels, and every pass over the data starts from zero counts, so no row ever sees its own label.

The counts live in frozen tables of the collection, ``count_<feature>``, one per sparse feature, of three
columns per id: the smoothed log-odds the model reads, the clicks and the hits (so snapshots, resumes,
exports and served models hold them as any table's rows; a served model reads the log-odds column, as
evaluation does).  The run's rows and clicks counted so far (the prior's click rate) are a buffer of the
model.  :class:`ClickCountUpdater` writes the rows after each training step.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..errors import ConfigError
from ..features import SparseFeatures
from ..nn import EmbeddingCollection, TableConfig
from ..store import Zeros
from ._count_batch import CountWriter, batch_entries, count_pairs, gather_batch
from ._count_fit import LogitHistogram, calibration_shift, count_fit_step

__all__ = ["COUNT_PREFIX", "COUNT_COLUMNS", "DEFAULT_COUNT_PRIOR", "click_count_tables", "count_log_odds",
           "ClickCountUpdater"]

COUNT_PREFIX = "count_"
COUNT_COLUMNS = 3  # per id: the smoothed log-odds (read by the model), clicks, hits
# rows of prior: an id seen n times with c clicks has the rate (c + prior ctr) / (n + prior), as
# bench/_schema_refs.py's counting baseline
DEFAULT_COUNT_PRIOR = 20.0


def click_count_tables(features: Sequence[str]) -> list[TableConfig]:
    """A frozen dynamic table ``count_<feature>`` per feature: every id a row at first sight (zeros), its
    bag pooled by the mean (counting's), unseen ids reading zeros (no evidence: log-odds 0)."""
    return [TableConfig(COUNT_PREFIX + f, COUNT_COLUMNS, features=(f,), combiner="mean", trainable=False,
                        initializer=Zeros()) for f in features]


def count_log_odds(clicks: torch.Tensor, hits: torch.Tensor, rows: float, positives: float,
                   prior: float = DEFAULT_COUNT_PRIOR) -> torch.Tensor:
    """``logit(r) - logit(ctr)``, ``r = (clicks + prior ctr) / (hits + prior)``, ``ctr`` the click rate of the
    rows counted, smoothed by one click in two rows: 0 for an id without hits."""
    p = (positives + 1.0) / (rows + 2.0)
    r = (clicks.double() + prior * p) / (hits.double() + prior)
    return torch.log(r) - torch.log1p(-r) - math.log(p / (1.0 - p))


class ClickCountUpdater:
    """Keeps a model's click-count tables (``model.counts``) current through a training run.

    Args:
        model: a DLRM built with ``counts`` (for a model without them every method does nothing): its
            collection in one process's memory, or sharded over processes (then give `comm`).
        prior: rows of prior (:func:`count_log_odds`).
        comm: sharded tables: a :class:`~hugeembed.distributed.Comm` over every rank of the run (the trainer's
            loop group), through which each rank's (id, label) pairs and fit inputs reach every rank.

    The trainer calls :meth:`before_step` before each step (a pass's first starts from zero counts) and
    :meth:`add` after every training step (the batch's forward has read the counts of the rows before it):
    with the step's logits, it first fits the model's count weights on the batch (_count_fit.py).
    At the run's end the trainer calls :meth:`calibrate` with the training rows.
    A row's log-odds take the click rate of the moment its id was last counted, and stay as they are
    until it is counted again (no rewrite at the run's end: a resumed run, which may go on past the
    end of the run it continues, equals the uninterrupted one; evaluation and a served model read the
    rows as training left them).

    One pass over all count tables per step: the batch's (table, sample, id) triples sorted once, one find,
    gather and scatter per table group (_count_batch.py).  Sharded: every rank gathers the global batch's
    triples, labels and fit inputs (rank order: the one process's sample order), fits the same weights, and
    writes the rows it holds, so N ranks keep the counts one process keeps on the global batches.
    """

    def __init__(self, model, prior: float = DEFAULT_COUNT_PRIOR, comm=None) -> None:
        fields = getattr(model, "counts", None)
        self.tables: list[tuple[str, str]] = []  # (count table, the feature it counts)
        if fields is None:  # a model without click counts: every call does nothing
            return
        if not (isinstance(prior, (int, float)) and math.isfinite(prior) and prior > 0):
            raise ConfigError(f"click counts: prior must be a positive number of rows, got {prior!r}")
        collection: EmbeddingCollection = model.embeddings
        if collection.has_tiered_tables:
            raise ConfigError("click counts need the tables in memory: not with --memory-budget (tiered tables)")
        sharded = type(collection) is not EmbeddingCollection
        if sharded and comm is None:
            raise ConfigError("click counts of sharded tables: give the ClickCountUpdater a comm over every rank")
        cfgs = {t.name: t for t in collection.tables}
        self.tables = [(name, cfgs[name].features[0]) for name in dict.fromkeys(fields.tables)]
        features = [f for _, f in self.tables]
        if len(set(features)) != len(features):
            raise ConfigError(f"click counts: one count table per feature, got tables {self.tables}")
        self.model, self.collection, self.prior = model, collection, float(prior)
        self.comm = comm if sharded else None
        self.writer = CountWriter(collection, [name for name, _ in self.tables], COUNT_COLUMNS)

    def _stats(self) -> tuple[float, float]:
        rows, positives = self.model.count_rows.tolist()
        return rows, positives

    def before_step(self, step_in_epoch: int) -> None:
        """A pass's first step starts from zero counts (no evidence)."""
        if step_in_epoch == 0:
            self.start_pass()

    def start_pass(self) -> None:
        """Every count back to zero (a pass over the data starts from no evidence)."""
        if not self.tables:
            return
        with torch.no_grad():
            self.writer.zero()
            self.model.count_rows.zero_()

    def add(self, sparse: SparseFeatures, labels: torch.Tensor, logits: torch.Tensor | None = None,
            lr_factor: float = 1.0) -> None:
        """Counts a trained batch: each (sample, id) pair once, with the sample's label; then the
        touched ids' log-odds at the new click rate.  With the batch's `logits` (its training forward's), a
        Newton step on the model's count weights first (`lr_factor`: the run's learning-rate factor).
        Sharded: a collective (every rank calls it with its local batch)."""
        if not self.tables:
            return
        with torch.no_grad():
            y = labels.detach().reshape(-1).double()
            if y.numel() != sparse.batch_size:
                raise ConfigError(f"click counts: {y.numel()} labels for a batch of {sparse.batch_size} samples")
            inputs = self.model.count_inputs
            fit = logits is not None and inputs is not None and inputs.shape[0] == y.numel()
            entries = batch_entries(sparse, [f for _, f in self.tables])
            if fit:
                inputs, logits = inputs.double(), logits.detach().double().reshape(-1)
            if self.comm is not None:  # the global batch on every rank, in rank order
                entries, y, fit_in = gather_batch(self.comm, entries, y, (inputs, logits) if fit else None,
                                                  self.model.count_fit.numel() - 1)
                fit = fit_in is not None
                if fit:
                    inputs, logits = fit_in
            if fit:
                count_fit_step(self.model.count_fit, self.model.count_hessian, inputs, logits, y, lr_factor)
            self.model.count_inputs = None
            self.model.count_rows += torch.stack([y.new_tensor(float(y.numel())), y.sum()]).to(self.model.count_rows)
            rows, positives = self._stats()
            if entries[0].numel() == 0:
                return
            ids_t, ids_v, clicks, hits = count_pairs(*entries, y)
            self.writer.add(ids_t, ids_v, clicks, hits,
                            lambda c, n: count_log_odds(c, n, rows, positives, self.prior))

    def calibrate(self, batches, device: torch.device) -> float | None:
        """The run's end: the logit out of training shifted (``count_shift``) so that the model's mean
        prediction on `batches` (the training rows) is their click rate (_count_fit.calibration_shift); eval
        mode: no id is inserted or counted.  Sharded: a collective (each rank scores its slice, every rank the same
        number of batches: training/_distributed.aligned); the rows of all ranks set the shift.  Returns the shift (None for a model without click counts)."""
        if not self.tables:
            return None
        self.clear_calibration()  # the logits without a shift
        hist = LogitHistogram()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for batch in batches:
                    batch = batch.to(device, non_blocking=True)
                    hist.add(self.model(batch.dense, batch.sparse), batch.labels)
        finally:
            self.model.train(was_training)
        if self.comm is not None:  # every rank's slice: the bins' counts summed over ranks (exact: whole numbers)
            mine = torch.cat([hist.counts, torch.tensor([hist.rows, hist.positives], dtype=torch.float64)])
            total = torch.stack(self.comm.all_gather("click counts (calibration)", mine.to(device))).sum(0).cpu()
            hist.counts, hist.rows, hist.positives = total[:-2], float(total[-2]), float(total[-1])
        shift = calibration_shift(hist)
        self.model.count_shift.fill_(shift)
        return shift

    def clear_calibration(self) -> None:
        """Training (again): no shift until the run's end (a resumed run evaluates as the straight one)."""
        if self.tables:
            self.model.count_shift.zero_()
