"""A plain NumPy implementation of TF's safe_embedding_lookup_sparse, written for the tests.

Follows the documented semantics (tf.nn.safe_embedding_lookup_sparse and
tf.nn.embedding_lookup_sparse): prune ids < 0 and weights <= 0, fill empty rows with
default_id (weight 1) or zeros, clip rows with clip_by_norm when max_norm is set,
combine with sum / mean / sqrtn.  Loops over Python lists: slow and obvious.
"""

from __future__ import annotations

import numpy as np


class OracleIdError(ValueError):
    pass


def clip_by_norm(row: np.ndarray, max_norm: float | None) -> np.ndarray:
    if max_norm is None:
        return row
    norm = np.sqrt(np.sum(row * row))
    return row * max_norm / max(norm, max_norm)


def clean_bag(bag, num_rows, *, out_of_range="error", default_id=None, prune_negative=True):
    """bag: list of (id, weight).  Returns the kept (id, weight) list."""
    kept = []
    for i, w in bag:
        if not w > 0:
            continue
        if i < 0 and prune_negative:
            continue
        if num_rows is not None and (i < 0 or i >= num_rows):
            if out_of_range == "error":
                raise OracleIdError(i)
            if out_of_range == "prune":
                continue
            i = default_id
        kept.append((i, w))
    return kept


def safe_lookup(table: np.ndarray, bags, combiner="mean", default_id=None, max_norm=None, out_of_range="error",
                prune_negative=True) -> np.ndarray:
    """table [R, D] float64; bags: list over samples of list of (id, weight)."""
    D = table.shape[1]
    out = np.zeros((len(bags), D), dtype=np.float64)
    for b, bag in enumerate(bags):
        kept = clean_bag(bag, table.shape[0], out_of_range=out_of_range, default_id=default_id,
                         prune_negative=prune_negative)
        if not kept:
            if default_id is None:
                continue
            kept = [(default_id, 1.0)]
        acc = np.zeros(D)
        wsum = w2sum = 0.0
        for i, w in kept:
            acc += w * clip_by_norm(table[i].astype(np.float64), max_norm)
            wsum += w
            w2sum += w * w
        if combiner == "mean":
            acc /= wsum
        elif combiner == "sqrtn":
            acc /= np.sqrt(w2sum)
        out[b] = acc
    return out


def unpooled_lookup(table, bags, max_norm=None, out_of_range="error", prune_negative=True):
    """Rows of kept ids (times weight), as a list per sample."""
    res = []
    for bag in bags:
        kept = clean_bag(bag, table.shape[0], out_of_range=out_of_range, prune_negative=prune_negative)
        res.append([w * clip_by_norm(table[i].astype(np.float64), max_norm) for i, w in kept])
    return res
