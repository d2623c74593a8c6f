"""Log loss and the CTR family (CTR, PCTR, COPC), as functions and accumulators.

    logloss = mean(-(y log p + (1 - y) log(1 - p))),  p clipped to [eps, 1 - eps]
    CTR     = mean(y)                  observed click-through rate
    PCTR    = mean(p)                  predicted click-through rate
    COPC    = sum(y) / sum(p)          clicks over predicted clicks (1 = calibrated)

Sums are exact (ExactSum), so streaming, merging ranks and one-shot calls agree bit for
bit.  Undefined values are NaN: any metric of no samples, COPC when sum(p) == 0.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ._check import check_labels, check_probabilities
from ._exact import ExactSum

__all__ = ["LogLoss", "CTR", "PCTR", "COPC", "log_loss", "ctr", "pctr", "copc", "DEFAULT_EPS"]

DEFAULT_EPS = 1e-7
_NAN = float("nan")


def _logloss_terms(p: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    p = p.clamp(eps, 1.0 - eps)
    return -torch.where(y.to(torch.bool), torch.log(p), torch.log1p(-p))


class _Sums:
    """Exact sums of labels, predictions and log-loss terms over everything seen."""

    metric = "metric"

    def __init__(self, eps: float = DEFAULT_EPS) -> None:
        if not 0.0 < eps < 0.5:
            raise ConfigError(f"{self.metric}: eps must be in (0, 0.5), got {eps}")
        self.eps = eps
        self.n = 0
        self.clicks = 0
        self.pred_sum = ExactSum()
        self.loss_sum = ExactSum()

    def update(self, preds: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds a batch of predicted probabilities ``[n]`` and 0/1 labels ``[n]``."""
        p = check_probabilities(preds, self.metric)
        y = check_labels(labels, p.numel(), self.metric).to(p.device)
        self.n += p.numel()
        self.clicks += int(y.sum())
        self.pred_sum.add(p)
        self.loss_sum.add(_logloss_terms(p, y, self.eps))

    def merge(self, other: "_Sums") -> "_Sums":
        """Adds everything `other` has seen; returns self."""
        if other.eps != self.eps:
            raise ConfigError(f"{self.metric}: cannot merge accumulators with eps {self.eps} and {other.eps}")
        self.n += other.n
        self.clicks += other.clicks
        self.pred_sum.merge(other.pred_sum)
        self.loss_sum.merge(other.loss_sum)
        return self

    def reset(self) -> None:
        self.n, self.clicks = 0, 0
        self.pred_sum.reset()
        self.loss_sum.reset()

    # Each value is one correctly rounded division of exact integers.
    def logloss(self) -> float:
        return self.loss_sum.exact_scaled() / (ExactSum.SCALE * self.n) if self.n else _NAN

    def ctr(self) -> float:
        return self.clicks / self.n if self.n else _NAN

    def pctr(self) -> float:
        return self.pred_sum.exact_scaled() / (ExactSum.SCALE * self.n) if self.n else _NAN

    def copc(self) -> float:
        scaled = self.pred_sum.exact_scaled()
        return self.clicks * ExactSum.SCALE / scaled if scaled else _NAN


class LogLoss(_Sums):
    """Streaming mean binary cross-entropy of probabilities (clipped to [eps, 1 - eps])."""

    metric = "LogLoss"

    def compute(self) -> float:
        return self.logloss()


class CTR(_Sums):
    """Streaming observed click-through rate, mean(labels)."""

    metric = "CTR"

    def compute(self) -> float:
        return self.ctr()


class PCTR(_Sums):
    """Streaming predicted click-through rate, mean(predictions)."""

    metric = "PCTR"

    def compute(self) -> float:
        return self.pctr()


class COPC(_Sums):
    """Streaming clicks over predicted clicks, sum(labels) / sum(predictions)."""

    metric = "COPC"

    def compute(self) -> float:
        return self.copc()


def log_loss(preds: torch.Tensor, labels: torch.Tensor, *, eps: float = DEFAULT_EPS) -> float:
    """Mean binary cross-entropy; `preds` are probabilities, clipped to [eps, 1 - eps].

    Example::

        >>> round(log_loss(torch.tensor([0.9, 0.2]), torch.tensor([1, 0])), 6)
        0.164252
    """
    acc = LogLoss(eps)
    acc.update(preds, labels)
    return acc.compute()


def ctr(labels: torch.Tensor) -> float:
    """Observed click-through rate: the mean of 0/1 labels (NaN if empty)."""
    acc = CTR()
    y = labels.detach().reshape(-1)
    acc.update(torch.zeros(y.numel(), dtype=torch.float64, device=y.device), y)
    return acc.compute()


def pctr(preds: torch.Tensor) -> float:
    """Predicted click-through rate: the mean of predicted probabilities (NaN if empty)."""
    acc = PCTR()
    p = preds.detach().reshape(-1)
    acc.update(p, torch.zeros(p.numel(), dtype=torch.int64, device=p.device))
    return acc.compute()


def copc(preds: torch.Tensor, labels: torch.Tensor) -> float:
    """Clicks over predicted clicks, ``sum(labels) / sum(preds)`` (1.0 = calibrated; NaN if sum(preds) == 0)."""
    acc = COPC()
    acc.update(preds, labels)
    return acc.compute()
