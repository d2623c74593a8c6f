"""The click counts' weights in DLRM's logit, fitted by Newton's method on each training batch.

A DLRM with click counts adds ``b + sum_f w_f s_f`` to its logit, ``s_f`` feature f's smoothed click
log-odds (hugeembed/models/_counts.py).  Counting's own sum (every ``w_f = 1``) counts the same evidence
several times when features repeat one another (NYC flights: a route is an origin and a destination, a
tail number almost fixes the carrier); a logistic regression on the counts learns how much each adds
(docs/quality.md, eighth round).  The dense optimizer moves ``w`` too slowly for that in the few steps of
a small data set, so the weights are fitted apart, by a second-order step on the batch's log loss with the
rest of the model's logit as an offset: ``w <- w - step * lr_factor * (H + ridge I)^-1 g``, ``g`` the
batch's gradient over ``[1, s]``, ``H`` a running mean of the batch Hessians ``X^T diag(p (1 - p)) X / B``.
The step (below 1) averages the batch noise out; the run's learning-rate factor takes it to 0 in the
decay, as the other weights'.  ``b`` (the intercept) keeps the model's mean prediction on the training
rows at their click rate.

On a log read in time order the step follows the latest rows: on the NYC flights (a day of flights a batch,
days delayed 5% to 60% of the time) the model ends calibrated to its last weeks, not to its training data
(mean prediction 0.141 on training rows delayed 18.0% of the time; docs/quality.md, ninth round), and so
does every part of it trained by steps (without the intercept's step: 0.146).  At the run's end
:func:`calibration_shift` moves ``b`` so that the final model's mean prediction on the training rows is their
click rate: the condition a logistic regression fitted on them meets at its optimum (its log loss's
derivative in the intercept is ``sum(p - y)``), here for the shift alone, the rest of the model fixed.
"""

from __future__ import annotations

import torch

__all__ = ["COUNT_FIT_STEP", "COUNT_FIT_HESSIAN_DECAY", "COUNT_FIT_RIDGE", "CALIBRATION_BINS", "count_fit_step",
           "LogitHistogram", "calibration_shift"]

# share of the Newton step taken per batch: a batch of 2048 rows estimates a weight to ~0.2 on the NYC
# flights; 0.1 averages it over ~20 batches and still reaches the fit within a pass of ~40 batches
COUNT_FIT_STEP = 0.1
# running mean of the batch Hessians (its first batch: that batch's)
COUNT_FIT_HESSIAN_DECAY = 0.9
# added to H's diagonal: a feature whose log-odds are all 0 (nothing counted yet) keeps its weight
COUNT_FIT_RIDGE = 1e-4
# the calibration's logits are counted in bins of 1/64 over [-32, 32] (memory bounded whatever the rows; a
# logit moves by at most 1/128 in its bin, the shift by less)
CALIBRATION_BINS, CALIBRATION_RANGE = 4096, 32.0


def count_fit_step(fit: torch.Tensor, hessian: torch.Tensor, counts: torch.Tensor, logits: torch.Tensor,
                   labels: torch.Tensor, lr_factor: float = 1.0, *, step: float | None = None,
                   decay: float | None = None, ridge: float | None = None) -> None:
    """One damped Newton step on ``fit = [b, w_1 .. w_F]`` in place (and the running Hessian `hessian`).

    Args:
        fit: ``[F + 1]`` the intercept and the weights of the batch's count log-odds.
        hessian: ``[F + 1, F + 1]`` float64, the running mean of the batch Hessians (zeros: none yet).
        counts: ``[B, F]`` the count log-odds the batch's forward read.
        logits: ``[B]`` the batch's logits (with the count term at the current `fit`).
        labels: ``[B]`` 0/1.
        lr_factor: the run's learning-rate factor at this step (1, falling to 0 over the decay).
    """
    step = COUNT_FIT_STEP if step is None else step
    decay = COUNT_FIT_HESSIAN_DECAY if decay is None else decay
    ridge = COUNT_FIT_RIDGE if ridge is None else ridge
    b = counts.shape[0]
    if b == 0 or lr_factor <= 0.0:
        return
    with torch.no_grad():
        x = torch.cat([torch.ones(b, 1, dtype=torch.float64, device=counts.device), counts.double()], 1)
        p = torch.sigmoid(logits.detach().double().reshape(-1))
        y = labels.detach().double().reshape(-1).to(p.device)
        grad = x.T @ (p - y) / b
        h = (x * (p * (1.0 - p)).unsqueeze(1)).T @ x / b
        h = h.to(hessian)
        # the first batch's Hessian, else the running mean; chosen on the device (no read back per step)
        hessian.copy_(torch.where((hessian == 0).all(), h, hessian.mul(decay).add_(h, alpha=1.0 - decay)))
        eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
        delta = torch.linalg.solve(hessian + ridge * eye, grad.to(hessian))
        delta = torch.where(torch.isfinite(delta).all(), delta, 0.0)  # a singular solve leaves the fit as it is
        fit.sub_((step * lr_factor * delta).to(fit))


class LogitHistogram:
    """The logits of many rows, counted in :data:`CALIBRATION_BINS` bins, and their labels' sum."""

    def __init__(self) -> None:
        self.counts = torch.zeros(CALIBRATION_BINS, dtype=torch.float64)
        self.rows, self.positives = 0.0, 0.0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        lo = logits.detach().double().reshape(-1).cpu().clamp(-CALIBRATION_RANGE, CALIBRATION_RANGE)
        k = ((lo + CALIBRATION_RANGE) * (CALIBRATION_BINS / (2 * CALIBRATION_RANGE))).long()
        self.counts += torch.bincount(k.clamp_(max=CALIBRATION_BINS - 1), minlength=CALIBRATION_BINS).double()
        self.rows += lo.numel()
        self.positives += float(labels.detach().double().sum())

    def centers(self) -> torch.Tensor:
        w = 2 * CALIBRATION_RANGE / CALIBRATION_BINS
        return torch.arange(CALIBRATION_BINS, dtype=torch.float64) * w - CALIBRATION_RANGE + w / 2


def calibration_shift(hist: LogitHistogram, tol: float = 1e-9) -> float:
    """The shift ``d`` of every logit after which the mean prediction is the rows' click rate:
    ``sum sigmoid(l + d) = sum y`` (0 without rows; a click rate of 0 or 1 is kept off the ends by half a row)."""
    if hist.rows == 0:
        return 0.0
    target = min(max(hist.positives, 0.5), hist.rows - 0.5)
    c, n = hist.centers(), hist.counts
    lo, hi = -2 * CALIBRATION_RANGE, 2 * CALIBRATION_RANGE
    d = 0.0
    for _ in range(100):  # Newton's steps on a monotone function, kept inside a shrinking bracket
        p = torch.sigmoid(c + d)
        f = float((n * p).sum()) - target
        if f > 0:
            hi = d
        else:
            lo = d
        slope = float((n * p * (1 - p)).sum())
        nxt = d - f / slope if slope > 0 else (lo + hi) / 2
        if not lo < nxt < hi:
            nxt = (lo + hi) / 2
        if abs(nxt - d) < tol:
            return nxt
        d = nxt
    return d
