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
    """Asserts the key index of a dynamic table's group (a HashStore's, or any DynamicGroup) forms a
    valid linear-probing table keyed by (table, key): every record reachable from its home bucket
    (store/_index.py's hash, recomputed here), no pair twice, counts agreeing with the records."""
    group = getattr(store, "group", store)
    records = group.buckets.cpu()
    bkeys, btabs = records[:, 0].numpy(), records[:, 1].numpy()
    bcodes = ((records[:, 2] << 32) >> 32).numpy()  # low half of word 2
    hash_keys = group.tables[:, 4].tolist()
    nb = bkeys.size
    occupied = btabs != -1
    assert int(occupied.sum()) == int(group.scalars[0])
    seen = set()
    for q in np.nonzero(occupied)[0].tolist():
        key, t = int(bkeys[q]), int(btabs[q])
        assert (t, key) not in seen, f"key {key} of table {t} stored twice"
        seen.add((t, key))
        h = (((mix64_int(key ^ hash_keys[t]) & (2**64 - 1)) >> 32) * nb) >> 32
        p = h
        while p != q:  # every bucket between home and the key is occupied
            assert occupied[p], f"key {key} at {q} is unreachable from home {h} (hole at {p})"
            p = (p + 1) % nb
    codes = bcodes[occupied].astype(np.int64)
    tabs = btabs[occupied]
    assert set(codes[codes < 0].tolist()) <= {-2}, "a key is a row (>= 0) or pending (-2)"
    rows = codes[codes >= 0].tolist()
    assert len(rows) == len(set(rows)), "row slots must be unique"
    for t in range(len(hash_keys)):
        assert int(((codes >= 0) & (tabs == t)).sum()) == int(group.tables[t, 0]), f"table {t}: rows counted"
        assert int(((codes == -2) & (tabs == t)).sum()) == int(group.tables[t, 1]), f"table {t}: pending counted"
