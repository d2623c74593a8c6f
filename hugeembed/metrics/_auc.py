"""ROC AUC, exact, one-shot or streamed over batches and merged over ranks.

The state is a few sorted runs of (distinct score, positives, negatives): a batch
becomes one run (``torch.unique`` + counts), and runs are merged like a binary
counter (a run is merged into the one before it when that one is not more than twice
its size), so updates cost O(n log n) amortised and the state holds at most
O(log n) runs.  Memory: 24 bytes per distinct score (float64 score, two int64
counts), i.e. at most 24 bytes per sample, usually far less (float32 predictions
repeat a lot).  Ties count one half, as in ``sklearn.metrics.roc_auc_score``.

    AUC = sum over distinct scores s of  pos(s) * (neg(< s) + neg(s) / 2)  /  (P * N)

computed with integers and rounded once; exact while P * N < 2**62.
"""

from __future__ import annotations

import torch

from ._check import check_labels, check_scores

__all__ = ["AUC", "roc_auc"]

_Run = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (scores asc, pos, neg)


def _run(scores: torch.Tensor, labels: torch.Tensor) -> _Run:
    uniq, inv = torch.unique(scores, sorted=True, return_inverse=True)
    pos = torch.zeros(uniq.numel(), dtype=torch.int64, device=uniq.device).index_add_(0, inv, labels)
    tot = torch.bincount(inv, minlength=uniq.numel())
    return uniq, pos, tot - pos


def _merge(a: _Run, b: _Run) -> _Run:
    b = tuple(t.to(a[0].device) for t in b)  # type: ignore[assignment]
    scores = torch.cat((a[0], b[0]))
    uniq, inv = torch.unique(scores, sorted=True, return_inverse=True)
    pos = torch.zeros(uniq.numel(), dtype=torch.int64, device=uniq.device).index_add_(0, inv, torch.cat((a[1], b[1])))
    neg = torch.zeros(uniq.numel(), dtype=torch.int64, device=uniq.device).index_add_(0, inv, torch.cat((a[2], b[2])))
    return uniq, pos, neg


def _auc_of_run(run: _Run) -> float:
    _, pos, neg = run
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    neg_below = torch.cumsum(neg, 0) - neg
    twice = int((pos * (2 * neg_below + neg)).sum())  # 2 * (pairs ranked right + ties / 2)
    return twice / (2 * n_pos * n_neg)


class AUC:
    """Streaming exact ROC AUC: ``update`` per batch, ``merge`` across ranks, ``compute`` at the end.

    ``compute()`` is NaN when no positive or no negative label has been seen (AUC is
    undefined then); merging accumulators equals computing on the concatenated data exactly.

    Example::

        auc = AUC()
        for batch in eval_loader:
            auc.update(torch.sigmoid(model(batch)), batch.labels)
        # distributed: gather every rank's AUC object (torch.distributed.all_gather_object)
        for other in gathered[1:]:
            gathered[0].merge(other)
        gathered[0].compute()
    """

    def __init__(self) -> None:
        self._runs: list[_Run] = []

    def update(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds a batch: `scores` (any real values, e.g. logits or probabilities) and 0/1 `labels`, same length."""
        s = check_scores(scores, "AUC")
        y = check_labels(labels, s.numel(), "AUC").to(s.device)
        if s.numel() == 0:
            return
        self._push(_run(s, y))

    def _push(self, run: _Run) -> None:
        self._runs.append(run)
        while len(self._runs) >= 2 and self._runs[-2][0].numel() <= 2 * self._runs[-1][0].numel():
            b = self._runs.pop()
            self._runs[-1] = _merge(self._runs[-1], b)

    def merge(self, other: "AUC") -> "AUC":
        """Adds everything `other` has seen (its tensors are moved to this one's device); returns self."""
        for run in other._runs:
            self._push(run if not self._runs else tuple(t.to(self._runs[0][0].device) for t in run))  # type: ignore[arg-type]
        return self

    def _collapsed(self) -> _Run | None:
        if not self._runs:
            return None
        while len(self._runs) > 1:
            b = self._runs.pop()
            self._runs[-1] = _merge(self._runs[-1], b)
        return self._runs[0]

    def compute(self) -> float:
        """The AUC of everything seen so far (NaN if only one class or nothing was seen)."""
        run = self._collapsed()
        return float("nan") if run is None else _auc_of_run(run)

    def reset(self) -> None:
        self._runs = []

    @property
    def num_distinct(self) -> int:
        """Distinct scores held (the state takes 24 bytes per distinct score per run)."""
        return sum(r[0].numel() for r in self._runs)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact area under the ROC curve, ties counted one half (= sklearn's roc_auc_score).

    Args:
        scores: ``[n]`` real scores (logits or probabilities; higher = more likely positive).
        labels: ``[n]`` 0/1 (int, float or bool).

    Returns:
        AUC in [0, 1]; NaN when `labels` hold a single class or are empty.

    Example::

        >>> roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        0.75
    """
    acc = AUC()
    acc.update(scores, labels)
    return acc.compute()
