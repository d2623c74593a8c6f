"""Metrics of click-through-rate models: AUC, log loss, CTR, PCTR, COPC.

Functions compute a metric on one pair of tensors; accumulators (``AUC``, ``LogLoss``,
``CTR``, ``PCTR``, ``COPC``, ``MetricSet``) take batches with ``update(preds, labels)``,
combine ranks with ``merge(other)`` and give the value with ``compute()``.  Results are
exact: streaming, merging and one-shot computation agree bit for bit.  Inputs may live
on any device.  Undefined values (one class for AUC, no samples) are NaN.
"""

from ._auc import AUC, roc_auc
from ._ctr import COPC, CTR, DEFAULT_EPS, PCTR, LogLoss, copc, ctr, log_loss, pctr
from ._exact import ExactSum
from ._metric_set import MetricSet

__all__ = [
    "roc_auc",
    "log_loss",
    "ctr",
    "pctr",
    "copc",
    "AUC",
    "LogLoss",
    "CTR",
    "PCTR",
    "COPC",
    "MetricSet",
    "ExactSum",
    "DEFAULT_EPS",
]
