"""Helpers of the store tests: float comparison in ulps and an independent check of
the hash layout (every key reachable by linear probing from its home bucket)."""

from __future__ import annotations

import numpy as np
import torch

from hugeembed._hashing import mix64_int

EMPTY = -(2**63)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Keys that stress the index: the empty-bucket sentinel, the extremes, neighbours.
SPECIAL_KEYS = [INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1, -1, 0, 1, 2**32, -(2**32), 12345]


def max_ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in float32 ulps between two equally shaped tensors."""
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0
    ia = a.detach().cpu().float().contiguous().view(torch.int32).long()
    ib = b.detach().cpu().float().contiguous().view(torch.int32).long()
    return int((ia - ib).abs().max())


def check_layout(store) -> None:
    """Asserts the bucket arrays of a HashStore form a valid linear-probing table."""
    records = store._buckets.cpu()
    bkeys = records[:, 0].numpy()
    bcodes = ((records[:, 1] << 32) >> 32).numpy()  # low half of word 1
    nb = bkeys.size
    occupied = bkeys != np.int64(EMPTY)
    assert int(occupied.sum()) == store._st_get("entries")
    seen = set()
    for q in np.nonzero(occupied)[0].tolist():
        key = int(bkeys[q])
        assert key not in seen, f"key {key} stored twice"
        seen.add(key)
        h = (((mix64_int(key) & (2**64 - 1)) >> 32) * nb) >> 32
        p = h
        while p != q:  # every bucket between home and the key is occupied
            assert occupied[p], f"key {key} at {q} is unreachable from home {h} (hole at {p})"
            p = (p + 1) % nb
    codes = bcodes[occupied].astype(np.int64)
    rows = codes[codes >= 0].tolist()
    if store._st_get("side_used") and store._side_code() >= 0:
        rows.append(store._side_code())
    assert set(codes[codes < 0].tolist()) <= {-2}, "a key is a row (>= 0) or pending (-2)"
    assert len(rows) == len(set(rows)) == len(store), "row slots must be unique and count the live rows"
