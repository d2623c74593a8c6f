"""Validation of metric inputs: one clear InputError naming the metric and the bad value."""

from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["check_labels", "check_scores", "check_probabilities"]


def _flat(t: torch.Tensor, metric: str, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{metric}: {what} must be a torch.Tensor, got {type(t).__name__}")
    return t.detach().reshape(-1)


def check_labels(labels: torch.Tensor, n: int, metric: str) -> torch.Tensor:
    """Labels flattened to int64 0/1; InputError on length mismatch or another value."""
    y = _flat(labels, metric, "labels")
    if y.numel() != n:
        raise InputError(f"{metric}: {n} predictions but {y.numel()} labels")
    if y.dtype == torch.bool:
        return y.to(torch.int64)
    bad = (y != 0) & (y != 1)
    if bool(bad.any()):
        value = y[bad][0].item()
        raise InputError(f"{metric}: labels must be 0 or 1, got {value!r}")
    return y.to(torch.int64)


def check_scores(scores: torch.Tensor, metric: str) -> torch.Tensor:
    """Scores flattened to float64; InputError on NaN."""
    s = _flat(scores, metric, "scores")
    if not (s.is_floating_point() or s.dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)):
        raise InputError(f"{metric}: scores must be a real tensor, got {s.dtype}")
    s = s.to(torch.float64)
    if bool(torch.isnan(s).any()):
        raise InputError(f"{metric}: scores contain NaN")
    return s


def check_probabilities(preds: torch.Tensor, metric: str) -> torch.Tensor:
    """Predicted probabilities flattened to float64; InputError outside [0, 1] or NaN."""
    p = check_scores(preds, metric)
    bad = (p < 0) | (p > 1)
    if bool(bad.any()):
        raise InputError(f"{metric}: predictions must be probabilities in [0, 1], got {p[bad][0].item()!r} "
                         f"(apply torch.sigmoid to logits first)")
    return p
