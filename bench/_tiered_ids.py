"""Ids of bench/tiered.py: bounded Zipf ranks and a pseudo-random rank -> id permutation, both in
O(1) memory (a 90 M-row table's CDF or permutation array would be 720 MB in the process whose
peak RSS is measured), and the Criteo-like batches built from them."""

from __future__ import annotations

import numpy as np
import torch

from hugeembed.features import SparseFeatures

class ZipfRanks:
    """Bounded Zipf(a) ranks in [0, n): P(rank k) proportional to (k + 1) ** -a.

    Hörmann & Derflinger's rejection-inversion (as Apache Commons' ZipfSampler): exact, O(1)
    memory, so 90 M rows need no 720 MB CDF array in the process whose RSS is measured.
    """

    def __init__(self, n: int, a: float = 1.05) -> None:
        if a <= 1.0:
            raise ValueError("ZipfRanks needs a > 1")
        self.n, self.a = int(n), float(a)
        self.hx1 = self._H(1.5) - 1.0
        self.hn = self._H(self.n + 0.5)
        self.s = 2.0 - self._Hinv(self._H(2.5) - self._h(2.0))

    def _h(self, x):
        return np.exp(-self.a * np.log(x))

    def _H(self, x):  # integral of h: (x ** (1 - a) - 1) / (1 - a), computed stably
        lx = np.log(x)
        t = (1.0 - self.a) * lx
        return np.expm1(t) / t * lx

    def _Hinv(self, y):
        t = np.maximum(y * (1.0 - self.a), -1.0)
        return np.exp(np.log1p(t) / t * y)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        out = np.empty(size, dtype=np.int64)
        todo = np.arange(size)
        while todo.size:
            u = self.hn + rng.random(todo.size) * (self.hx1 - self.hn)
            x = self._Hinv(u)
            k = np.clip(np.floor(x + 0.5), 1, self.n)
            ok = (k - x <= self.s) | (u >= self._H(k + 0.5) - self._h(k))
            out[todo[ok]] = k[ok].astype(np.int64) - 1
            todo = todo[~ok]
        return out


class IdPermutation:
    """A fixed pseudo-random permutation of [0, n): a 4-round Feistel network over the smallest
    power of 4 >= n, cycle-walked back into [0, n).  No table (90 M rows would take 720 MB)."""

    _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)

    def __init__(self, n: int, seed: int) -> None:
        self.n = int(n)
        bits = max(2, (int(self.n - 1).bit_length() + 1) // 2 * 2)
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = np.random.default_rng([seed, 0x5EED]).integers(0, 2**62, size=4, dtype=np.uint64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            z = (right ^ k) * self._M1
            z ^= z >> np.uint64(31)
            z *= self._M2
            z ^= z >> np.uint64(29)
            left, right = right, left ^ (z & self.mask)
        return (left << self.half) | right

    def __call__(self, ranks: np.ndarray) -> np.ndarray:
        out = self._feistel(ranks.astype(np.uint64))
        bad = np.flatnonzero(out >= self.n)
        while bad.size:
            out[bad] = self._feistel(out[bad])
            bad = bad[out[bad] >= self.n]
        return out.astype(np.int64)


class Workload:
    """Batch i: `batch` samples x `features` features, one id each, from Zipf(alpha) over `rows`."""

    def __init__(self, rows: int, batch: int = 4096, features: int = 26, alpha: float = 1.05, seed: int = 0):
        self.rows, self.batch_size, self.seed = rows, batch, seed
        self.names = tuple(f"C{i + 1}" for i in range(features))
        self.zipf = ZipfRanks(rows, alpha)
        self.perm = IdPermutation(rows, seed)
        self._lengths = torch.ones(features * batch, dtype=torch.int64)

    def batch(self, i: int):
        """(SparseFeatures, labels, ranks) of batch i (a function of the seed and i only)."""
        rng = np.random.default_rng([self.seed, i])
        ranks = self.zipf.sample(rng, len(self.names) * self.batch_size)
        ids = torch.from_numpy(self.perm(ranks))
        labels = torch.from_numpy((rng.random(self.batch_size) < 0.25).astype(np.float32))
        return SparseFeatures(self.names, ids, lengths=self._lengths), labels, ranks

    def empty(self) -> SparseFeatures:
        return SparseFeatures(self.names, torch.zeros(0, dtype=torch.int64),
                              lengths=torch.zeros_like(self._lengths))
