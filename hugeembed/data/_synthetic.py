"""A synthetic Criteo-like data set with a planted, learnable logistic model.

Rows have the Criteo schema (13 dense counts, 26 categorical 32-bit ids) and labels
drawn from a KNOWN model, so a test can check that training approaches the best
possible AUC::

    logit = bias                                         (calibrated to target_ctr)
          + sum_i  w_i * (dense_i - mean_i)              dense effects
          + sum_j  amp(rank) * scale * u_j(id_j)         per-id effects, 10 features
          + sum_(a,b) s * amp_a * amp_b * <v_a(id_a), v_b(id_b)> / sqrt(r)   pairwise
    label ~ Bernoulli(sigmoid(logit))

Ids of feature j are Zipf(1.05)-distributed over ``cardinality_j`` ranks (Criteo-Kaggle
counts, capped by ``max_cardinality``); rank k becomes id ``(k * A_j + B_j) mod 2**32``
(a bijection, so hot ids are scattered over the id space).  ``u_j`` and ``v_a`` are hashes
of the id (mix64), uniform with unit variance: no table is stored, so generation is
O(batch) whatever the cardinality.  ``amp(k) = (1 + k / hot_ids) ** -0.5`` keeps the hot
ids' effects strong (learnable in a few hundred steps) and fades the tail's.

Every row is a pure function of (seed, row index): rows are generated in internal
chunks of 8192, each from its own random stream, so any batching gives the same rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import ConfigError
from ._batch import Batch
from ._block import CriteoBlock, rebatch
from ._schema import CAT_NAMES, MISSING_IDS, N_CAT, N_DENSE
from ._synthetic_config import SyntheticConfig

__all__ = ["SyntheticCriteo", "BayesMetrics", "RawRows"]

# share of empty fields, roughly as in Criteo Kaggle
_DENSE_MISSING = np.array((0.45, 0.0, 0.21, 0.22, 0.03, 0.23, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22), np.float32)
_CAT_MISSING = np.array(
    (0, 0, .03, .03, 0, .12, 0, 0, 0, .03, 0, .03, 0, 0, 0, .03, 0, 0, .44, .44, .03, .76, 0, .03, .44, .44), np.float32
)
# log-scale location and spread of the dense counts (medians ~ e^mu)
_DENSE_MU = np.array((0.5, 3.0, 2.5, 1.8, 7.5, 4.0, 1.5, 2.3, 3.5, 0.3, 1.0, 0.2, 1.7), np.float32)
_DENSE_SIGMA = np.array((1.2, 1.5, 1.4, 1.0, 1.8, 1.6, 1.4, 1.0, 1.2, 0.8, 1.0, 1.0, 1.1))
_CAT_MISS_COLS = np.flatnonzero(_CAT_MISSING > 0)
# sigma times the factor that scales a standard logistic variable to unit variance
_DENSE_SIGMA_LOGISTIC = (_DENSE_SIGMA * math.sqrt(3.0) / math.pi).astype(np.float32)
_DENSE_PRESENT_INV = (1.0 / (1.0 - _DENSE_MISSING)).astype(np.float32)
_CHUNK = 8192  # rows per random stream
_PIECE = 2048  # rows computed at a time
_MISSING = np.array(MISSING_IDS, np.int64)
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


def _mix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * _M1
    x ^= x >> np.uint64(33)
    x *= _M2
    x ^= x >> np.uint64(33)
    return x


def _lanes(h: np.ndarray) -> np.ndarray:
    """uint64 [n, k] -> its four 16-bit lanes, uint16 [n, k, 4] (in memory order)."""
    h = np.ascontiguousarray(h)
    return h.view(np.uint16).reshape(*h.shape, 4)


def _unit_uniform(h: np.ndarray) -> np.ndarray:
    """Hash bits -> uniform on [-sqrt(3), sqrt(3)) (mean 0, variance 1)."""
    return ((h >> np.uint64(11)).astype(np.float64) * 2.0**-53 * 2.0 - 1.0) * math.sqrt(3.0)


@dataclass(frozen=True)
class BayesMetrics:
    """AUC and log loss of the true probabilities on a sample: the best any model can do."""

    auc: float
    logloss: float
    ctr: float
    rows: int


@dataclass(frozen=True)
class RawRows:
    """Rows before the Criteo transform: raw counts and ids with their missing masks."""

    labels: np.ndarray  # float32 [n]
    ints: np.ndarray  # int64 [n, 13]
    ints_missing: np.ndarray  # bool [n, 13]
    ids: np.ndarray  # int64 [n, 26] (the missing id where missing)
    ids_missing: np.ndarray  # bool [n, 26]


class SyntheticCriteo:
    """Generator of Criteo-like rows with labels from a known logistic model.

    Example::

        gen = SyntheticCriteo(SyntheticConfig(seed=1, max_cardinality=100_000))
        for batch in gen.batches(batch_size=2048, num_batches=300):   # hugeembed.data.Batch
            ...
        best = gen.bayes_metrics(rows=200_000, start=10**9)           # BayesMetrics(auc=..., ...)
    """

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = cfg = config or SyntheticConfig()
        self.cardinalities: tuple[int, ...] = cfg.cardinalities()
        setup = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5EED]))
        self._mult = (setup.integers(1 << 20, 1 << 31, N_CAT) * 2 + 1).astype(np.uint64)  # odd: bijective mod 2^32
        self._add = setup.integers(0, 1 << 32, N_CAT).astype(np.uint64)
        self._inv = np.array([pow(int(a), -1, 1 << 32) for a in self._mult], dtype=np.uint64)
        self._salt = setup.integers(0, 1 << 62, (2, N_CAT)).astype(np.uint64)
        self._dense_w = setup.normal(0.0, 1.0, N_DENSE) * cfg.dense_scale
        a = cfg.zipf_exponent
        self._card = np.array(self.cardinalities, np.float64)
        self._zipf_lo = np.full(N_CAT, 0.5 ** (1 - a))
        self._zipf_span = (self._card + 0.5) ** (1 - a) - self._zipf_lo
        self._effect_idx = [CAT_NAMES.index(f) for f in cfg.effect_features]
        self._pairs = [(CAT_NAMES.index(a), CAT_NAMES.index(b)) for a, b in cfg.interactions]
        self._used_cols = sorted(set(self._effect_idx) | {j for p in self._pairs for j in p})
        # calibration sample (rows far away from any the user is likely to ask for)
        self._dense_mean = np.zeros(N_DENSE)
        self.bias = 0.0
        calib, dense = self._raw(1 << 50, 32768)
        self._dense_mean = dense.astype(np.float64).mean(axis=0)
        z = self.true_logits(dense, calib.ids)
        self.bias = _calibrate(z, cfg.target_ctr)

    # -- sampling -------------------------------------------------------------------

    def _ranks(self, u: np.ndarray) -> np.ndarray:
        """0-based Zipf ranks ``[n, 26]`` from uniforms ``[n, 26]``, all features at once.

        Inverts the integral of ``x ** -a`` over ``[0.5, card + 0.5)`` and rounds: rank k
        gets the mass of ``[k - 0.5, k + 0.5)``, within 2% of ``k ** -a`` from rank 2 on
        (rank 1 gets ~10% more).
        """
        a = self.config.zipf_exponent
        x = u * self._zipf_span  # in place from here on: fresh allocations are slow (page faults)
        x += self._zipf_lo
        np.log(x, out=x)
        x *= 1.0 / (1.0 - a)
        np.exp(x, out=x)
        np.rint(x, out=x)
        np.maximum(x, 1.0, out=x)
        np.minimum(x, self._card, out=x)
        x -= 1.0
        return x.astype(np.int64)

    def _raw(self, start: int, n: int, raw: bool = True) -> tuple[RawRows, np.ndarray]:
        """Rows [start, start + n) before the dense transform, and the transformed dense.

        Work goes in pieces of at most 2048 rows (the temporaries then stay in cache, which
        is ~2x faster on the development machine than whole 8192-row chunks), each filling
        its slice of the preallocated outputs.  Without `raw`, the raw counts and missing
        masks are not kept (their arrays are one reused piece): fresh memory costs here.
        """
        keep = n if raw else min(n, _PIECE)
        out = RawRows(np.empty(n, np.float32), np.empty((keep, N_DENSE), np.int64), np.empty((keep, N_DENSE), bool),
                      np.empty((n, N_CAT), np.int64), np.empty((keep, N_CAT), bool))
        dense = np.empty((n, N_DENSE), np.float32)
        pos = start
        while pos < start + n:
            c = pos // _CHUNK
            stop = min(start + n, (c + 1) * _CHUNK, pos + _PIECE)
            self._piece(c, pos - c * _CHUNK, stop - c * _CHUNK, out, dense, pos - start, raw)
            pos = stop
        return out, dense

    def _piece(self, c: int, a: int, b: int, out: RawRows, dense_out: np.ndarray, at: int, raw: bool) -> None:
        """Rows a..b of chunk c, written to rows at..at + (b - a) of the outputs."""
        # chunk c's stream holds [u_id: CHUNK x 26][u_aux: CHUNK x n_aux][u_label: CHUNK], one
        # 64-bit draw per double; jumping (PCG64.advance) to the rows asked for makes a small
        # request cost only its own rows, yet gives the same values as any other split
        n_aux = N_DENSE + len(_CAT_MISS_COLS) + 1
        bits = np.random.PCG64(np.random.SeedSequence([self.config.seed, c]))
        rng = np.random.Generator(bits)
        bits.advance(a * N_CAT)
        u_id = rng.random((b - a, N_CAT))
        bits.advance((_CHUNK - b) * N_CAT + a * n_aux)
        u_aux = rng.random((b - a, n_aux))  # 13 dense, one per categorical that can be empty, I2's sign
        bits.advance((_CHUNK - b) * n_aux + a)
        u_label = rng.random(b - a)
        rows = slice(at, at + b - a)
        raw_rows = rows if raw else slice(0, b - a)

        ids = ((self._ranks(u_id).astype(np.uint64) * self._mult + self._add) & np.uint64(0xFFFFFFFF)).astype(np.int64)
        ids_missing = out.ids_missing[raw_rows]
        ids_missing[:] = False
        ids_missing[:, _CAT_MISS_COLS] = u_aux[:, N_DENSE : N_DENSE + len(_CAT_MISS_COLS)] < _CAT_MISSING[_CAT_MISS_COLS]
        np.copyto(ids, _MISSING, where=ids_missing)
        out.ids[rows] = ids
        # heavy-tailed counts: floor(exp(mu + sigma * z)), z logistic with unit variance; the
        # same uniform decides "missing" (below the missing rate) so one draw serves both
        u_d = u_aux[:, :N_DENSE].astype(np.float32)
        ints_missing = u_d < _DENSE_MISSING
        v = (u_d - _DENSE_MISSING) * _DENSE_PRESENT_INV  # uniform again on the present part (float32 throughout)
        np.clip(v, np.float32(1e-7), np.float32(1.0 - 1e-7), out=v)
        z = np.log(v / (np.float32(1.0) - v))
        z *= _DENSE_SIGMA_LOGISTIC
        z += _DENSE_MU
        np.minimum(z, np.float32(30.0), out=z)
        np.exp(z, out=z)
        ints = np.floor(z, out=z).astype(np.int64)
        ints[:, 1] -= (u_aux[:, -1] > 0.9) * 3  # I2 has small negative values, as in Criteo (never missing)
        ints[ints_missing] = 0
        out.ints[raw_rows] = ints
        out.ints_missing[raw_rows] = ints_missing
        dense = dense_out[rows]
        dense[:] = _transform(ints)
        p = _sigmoid(self.true_logits(dense, ids))
        out.labels[rows] = u_label < p

    def raw_rows(self, start: int, n: int) -> RawRows:
        """Rows [start, start + n) as raw counts and ids (what a Criteo text line holds)."""
        _check_range(start, n)
        return self._raw(start, n)[0]

    def rows(self, start: int, n: int) -> CriteoBlock:
        """Rows [start, start + n) exactly as the Criteo reader would give them.

        Example::

            >>> gen = SyntheticCriteo(SyntheticConfig(seed=0, max_cardinality=1000))
            >>> gen.rows(0, 4).cats.shape, gen.rows(2, 2).equals(gen.rows(0, 4).slice(2, 4))
            ((4, 26), True)
        """
        _check_range(start, n)
        raw, dense = self._raw(start, n, raw=False)
        return CriteoBlock(dense, raw.ids, raw.labels)

    def batches(self, batch_size: int, num_batches: int | None = None, *, start: int = 0) -> Iterator[Batch]:
        """Batches of `batch_size` consecutive rows from row `start` (endless if num_batches is None).

        Rows are generated in blocks of 8192, whatever the batch size.
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        _check_range(start, 0)
        total = None if num_batches is None else batch_size * num_batches
        step = 4 * _PIECE

        def blocks() -> Iterator[CriteoBlock]:
            pos = start
            while total is None or pos < start + total:
                n = step if total is None else min(step, start + total - pos)
                yield self.rows(pos, n)
                pos += n

        for blk in rebatch(blocks(), batch_size, drop_last=False):
            yield Batch.from_block(blk)

    # -- the true model -------------------------------------------------------------

    def _amp(self, ids: np.ndarray, cols: list[int]) -> np.ndarray:
        """Effect strength of ids ``[n, len(cols)]`` of features `cols`: (1 + rank / hot_ids) ** -0.5.

        The rank is recovered from the id by inverting ``id = rank * A + B (mod 2**32)``;
        missing ids count as hot (rank 0).
        """
        u = ids.astype(np.uint64)
        mask = np.uint64(0xFFFFFFFF)
        rank = (((u - self._add[cols]) & mask) * self._inv[cols]) & mask
        rank = np.where(ids >= MISSING_IDS[0], 0, rank.astype(np.int64))
        return 1.0 / np.sqrt(1.0 + rank * (1.0 / self.config.hot_ids))

    def logit_terms(self, dense: np.ndarray, cats: np.ndarray) -> dict[str, np.ndarray]:
        """The additive terms of the true logit (without the bias), float64 [n] each.

        Keys: ``"dense"``, one per effect feature (``"C1"``...), one per pair (``"C1xC2"``...).
        """
        cfg = self.config
        terms = {"dense": (dense.astype(np.float64) - self._dense_mean) @ self._dense_w}
        used = self._used_cols
        amp = self._amp(cats[:, used], used)  # [n, len(used)]
        col = {j: k for k, j in enumerate(used)}
        e = self._effect_idx
        if e:
            h = _mix64(cats[:, e].astype(np.uint64) ^ self._salt[0, e])
            eff = cfg.effect_scale * amp[:, [col[j] for j in e]] * _unit_uniform(h)
            terms.update((CAT_NAMES[j], eff[:, k]) for k, j in enumerate(e))
        if self._pairs:
            a, b = [p[0] for p in self._pairs], [p[1] for p in self._pairs]
            r = cfg.interaction_rank
            # each 64-bit hash holds four 16-bit latent coordinates, uniform on [-1, 1)
            ha = _lanes(_mix64(cats[:, a].astype(np.uint64) ^ self._salt[1, a]))[..., :r]
            hb = _lanes(_mix64(cats[:, b].astype(np.uint64) ^ self._salt[1, b]))[..., :r]
            va = ha.astype(np.float32) * np.float32(2 / 65536.0) - np.float32(1.0)
            vb = hb.astype(np.float32) * np.float32(2 / 65536.0) - np.float32(1.0)
            dot = (va * vb).sum(axis=2, dtype=np.float64)
            amp_ab = amp[:, [col[j] for j in a]] * amp[:, [col[j] for j in b]]
            inter = (3.0 * cfg.interaction_scale / math.sqrt(r)) * amp_ab * dot
            terms.update((f"{CAT_NAMES[i]}x{CAT_NAMES[j]}", inter[:, k]) for k, (i, j) in enumerate(self._pairs))
        return terms

    def true_logits(self, dense: np.ndarray, cats: np.ndarray) -> np.ndarray:
        """logit of P(click) under the planted model, float64 [n], from reader-format arrays."""
        return self.bias + sum(self.logit_terms(dense, cats).values())

    def true_probabilities(self, block: CriteoBlock) -> np.ndarray:
        return _sigmoid(self.true_logits(block.dense, block.cats))

    def bayes_metrics(self, rows: int = 200_000, start: int = 1 << 40) -> BayesMetrics:
        """AUC and log loss of the true probabilities on rows [start, start + rows).

        No model can beat these on that sample (up to sampling noise): evaluate a trained
        model on the same rows and compare.
        """
        blk = self.rows(start, rows)
        p = self.true_probabilities(blk)
        y = blk.labels.astype(np.float64)
        eps = 1e-7
        pc = np.clip(p, eps, 1 - eps)
        ll = float(-np.mean(y * np.log(pc) + (1 - y) * np.log1p(-pc)))
        return BayesMetrics(auc=_auc(p, y), logloss=ll, ctr=float(y.mean()), rows=rows)


def _check_range(start: int, n: int) -> None:
    if start < 0 or n < 0:
        raise ConfigError(f"row range needs start >= 0 and n >= 0, got start={start}, n={n}")


def _transform(ints: np.ndarray) -> np.ndarray:
    """The Criteo dense transform log(1 + max(x, 0)) in float32 (missing fields hold 0)."""
    return np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _calibrate(z: np.ndarray, target: float) -> float:
    """Bias b with mean(sigmoid(z + b)) == target (bisection; the mean is monotone in b)."""
    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if _sigmoid(z + mid).mean() < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC with ties counted half (Mann-Whitney U on average ranks)."""
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    rank_hi = np.cumsum(counts)
    avg_rank = rank_hi - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    u = avg_rank[inverse][pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))
