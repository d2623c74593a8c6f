"""MetricSet: AUC, log loss, CTR, PCTR and COPC accumulated together in one pass."""

from __future__ import annotations

import torch

from ._auc import AUC
from ._check import check_labels, check_probabilities
from ._ctr import DEFAULT_EPS, _Sums

__all__ = ["MetricSet"]


class MetricSet:
    """Accumulates every evaluation metric of a CTR model over many batches (and ranks).

    ``compute()`` returns ``{"auc", "logloss", "ctr", "pctr", "copc", "count"}``; a value
    that is undefined for the data seen (AUC with one class, anything with no samples,
    COPC with no predicted clicks) is NaN.

    Example::

        metrics = MetricSet()
        with torch.no_grad():
            for batch in loader:
                metrics.update(torch.sigmoid(model(batch.dense, batch.sparse)), batch.labels)
        metrics.compute()   # {'auc': 0.79, 'logloss': 0.45, 'ctr': 0.25, 'pctr': 0.26, 'copc': 0.96, 'count': 2048000}
    """

    def __init__(self, eps: float = DEFAULT_EPS) -> None:
        self.auc = AUC()
        self.sums = _Sums(eps)
        self.sums.metric = "MetricSet"

    def update(self, preds: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds a batch of predicted probabilities ``[n]`` and 0/1 labels ``[n]``."""
        p = check_probabilities(preds, "MetricSet")
        check_labels(labels, p.numel(), "MetricSet")
        self.sums.update(p, labels)
        self.auc.update(p, labels)

    def merge(self, other: "MetricSet") -> "MetricSet":
        """Adds everything `other` has seen (e.g. another rank's MetricSet); returns self."""
        self.auc.merge(other.auc)
        self.sums.merge(other.sums)
        return self

    def reset(self) -> None:
        self.auc.reset()
        self.sums.reset()

    @property
    def count(self) -> int:
        return self.sums.n

    def compute(self) -> dict[str, float]:
        s = self.sums
        return {"auc": self.auc.compute(), "logloss": s.logloss(), "ctr": s.ctr(), "pctr": s.pctr(),
                "copc": s.copc(), "count": s.n}
