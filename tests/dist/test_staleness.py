"""Bounded staleness (distributed/_pipeline.py) on 2 gloo ranks.

Oracles: the synchronous sharded collection (K = 0 pipelined equals it bit for bit), a second
run of the same K (bit for bit), and, for static SGD tables under a loss linear in the pooled
vectors (row gradients independent of the rows), rows computed here in float64: the outputs of
batch j are the pooled rows after the updates of batches 0 .. j-K-1 exactly, each row's update
scaled by 1 / (1 + the in-flight batches j-K .. j-1 holding its key) (the staleness-aware step),
or, delay-compensated instead, by the gradient g + lambda * g * g * (w_now - w_read) (DC-ASGD)
with w_read the row batch j read and w_now the row when its update lands.
"""

from __future__ import annotations

import pytest
import torch

from hugeembed.nn import EmbeddingCollection

from ._harness import run_ranks
from .common import merge_shards
from .workers_stale import linear_batch, linear_coef, linear_tables

pytestmark = pytest.mark.dist

STEPS = 6
LAMBDA = 2.0
NAMES = ("a", "b", "c")
REPLICATED = ((2, 0), (3, 1))  # (K, R): "b", the data-parallel table, read R steps stale, the others K
COMPENSATED_R = ((2, LAMBDA, 0), (3, LAMBDA, 1), (2, LAMBDA, 2))  # (K, lambda, R): DC-ASGD with "b" read R stale


@pytest.fixture(scope="module")
def runs():
    return run_ranks(2, "tests.dist.workers_stale:main", {"steps": STEPS, "stale": (0, 2, 3),
                                                          "compensated": ((2, LAMBDA), (0, LAMBDA), *COMPENSATED_R),
                                                          "replicated": REPLICATED})


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_collection_bit_for_bit(runs):
    for r in runs:
        sync, k0 = r["full"]["None"][0], r["full"]["0"][0]
        assert sync["step"] == k0["step"] == STEPS
        assert _same(sync, k0)


def test_a_given_staleness_is_reproducible_bit_for_bit_and_differs_from_synchronous(runs):
    for r in runs:
        first, second = r["full"]["2"]
        assert _same(first, second)
        sync = r["full"]["None"][0]
        assert not _same(first["outputs"], sync["outputs"])  # later batches read older rows


def _oracle(steps: int, k: int, lam: float | None = None,
            r: int | None = None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs and final rows of the linear run; lam None: staleness-aware steps, else DC-ASGD alone;
    r: the data-parallel table "b" read r steps stale (its in-flight batches j-r .. j-1), the others k."""
    delay = {n: k if r is None or n != "b" else r for n in NAMES}
    ref = EmbeddingCollection(linear_tables())
    rows = {n: s.export().rows[:, :4].double() for n, s in zip(NAMES, (s for _, s in ref.stores()))}
    keys = {n: s.export().keys for n, s in zip(NAMES, (s for _, s in ref.stores()))}
    w = {n: torch.zeros(20, 4, dtype=torch.float64).index_copy(0, keys[n], rows[n]) for n in NAMES}
    states = [w]
    touched = [{n: set(linear_batch(j, 0, 1).feature(n).values.tolist()) for n in NAMES} for j in range(steps)]
    for j in range(steps):
        sf, c = linear_batch(j, 0, 1), linear_coef(j).double()
        new = {n: t.clone() for n, t in w.items()}
        for f, n in enumerate(NAMES):
            feat = sf.feature(n)
            grad = {}
            for i in range(8):
                for idx in feat.values[feat.offsets[i] : feat.offsets[i + 1]].tolist():
                    grad[idx] = grad.get(idx, 0) + c[i, 4 * f : 4 * f + 4] / 8  # the global batch's mean
            for idx, g in grad.items():
                if lam is not None:  # the row read for batch j (after 0 .. j-delay-1) vs the row now (after 0 .. j-1)
                    drift = w[n][idx] - states[max(0, j - delay[n])][n][idx]
                    new[n][idx] -= 0.5 * (g + lam * g * g * drift)  # SGD lr 0.5 on the compensated gradient
                    continue
                d = -0.5 * g
                # the batches in flight between batch j's fetch and its update (j-K .. j-1) that hold
                # the same key: the row's step is scaled by 1 / (1 + their number)
                n_in_flight = sum(idx in touched[s][n] for s in range(max(0, j - delay[n]), j))
                new[n][idx] += d / (1 + n_in_flight)
        w = new
        states.append(w)
    outs = []
    for j in range(steps):
        sf = linear_batch(j, 0, 1)
        out = torch.zeros(8, 12, dtype=torch.float64)
        for f, n in enumerate(NAMES):
            seen, feat = states[max(0, j - delay[n])], sf.feature(n)  # after batches 0 .. j-k-1
            for i in range(8):
                for idx in feat.values[feat.offsets[i] : feat.offsets[i + 1]].tolist():
                    out[i, 4 * f : 4 * f + 4] += seen[n][idx]
        outs.append(out)
    return outs, states[-1]


@pytest.mark.parametrize("k", [0, 2, 3])
def test_batch_j_reads_the_updates_of_batches_up_to_j_minus_k_minus_1_exactly(runs, k):
    want, final = _oracle(STEPS, k)
    for j in range(STEPS):
        got = torch.cat([runs[0]["linear"][k]["outputs"][j], runs[1]["linear"][k]["outputs"][j]]).double()
        torch.testing.assert_close(got, want[j], rtol=1e-5, atol=1e-6, msg=lambda m: f"K={k} batch {j}: {m}")
    merged = merge_shards([r["linear"][k]["tables"] for r in runs], replicated={"b"})
    for n in NAMES:
        rows = torch.zeros(20, 4, dtype=torch.float64).index_copy(0, merged[n]["keys"], merged[n]["rows"][:, :4].double())
        torch.testing.assert_close(rows, final[n], rtol=1e-5, atol=1e-6)  # every update applied once, after drain


@pytest.mark.parametrize("k,r", REPLICATED)
def test_a_data_parallel_table_read_r_steps_stale_while_the_others_read_k(runs, k, r):
    want, final = _oracle(STEPS, k, r=r)
    first = tuple(x["linear"][("R", k, r)][0] for x in runs)
    second = tuple(x["linear"][("R", k, r)][1] for x in runs)
    assert _same(first, second)  # a given (K, R) reproducible bit for bit
    for j in range(STEPS):
        got = torch.cat([first[0]["outputs"][j], first[1]["outputs"][j]]).double()
        torch.testing.assert_close(got, want[j], rtol=1e-5, atol=1e-6, msg=lambda m: f"K={k} R={r} batch {j}: {m}")
    merged = merge_shards([x["tables"] for x in first], replicated={"b"})
    for n in NAMES:
        rows = torch.zeros(20, 4, dtype=torch.float64).index_copy(0, merged[n]["keys"], merged[n]["rows"][:, :4].double())
        torch.testing.assert_close(rows, final[n], rtol=1e-5, atol=1e-6)
    if r == 0:  # the replica's loss term is its own: it follows the synchronous run bit for bit, step by step
        for x, sync in zip(first, (x["linear"][0] for x in runs)):
            for j in range(STEPS):
                assert torch.equal(x["outputs"][j][:, 4:8], sync["outputs"][j][:, 4:8]), j
            # while the row-wise and table-wise tables' reads are K steps stale
            assert not all(torch.equal(x["outputs"][j], sync["outputs"][j]) for j in range(STEPS))


@pytest.mark.parametrize("k", [2, 0])
def test_delay_compensated_rows_step_on_the_gradient_corrected_to_the_current_row(runs, k):
    want, final = _oracle(STEPS, k, lam=LAMBDA)
    plain = _oracle(STEPS, k)[1]
    for j in range(STEPS):
        got = torch.cat([runs[0]["linear"][(k, LAMBDA)]["outputs"][j],
                         runs[1]["linear"][(k, LAMBDA)]["outputs"][j]]).double()
        torch.testing.assert_close(got, want[j], rtol=1e-5, atol=1e-6, msg=lambda m: f"K={k} batch {j}: {m}")
    merged = merge_shards([r["linear"][(k, LAMBDA)]["tables"] for r in runs], replicated={"b"})
    for n in NAMES:
        rows = torch.zeros(20, 4, dtype=torch.float64).index_copy(0, merged[n]["keys"], merged[n]["rows"][:, :4].double())
        torch.testing.assert_close(rows, final[n], rtol=1e-5, atol=1e-6)
        # K = 2: the compensation moved rows (the oracle without it differs); K = 0: nothing is in flight
        assert (k > 0) == (not torch.allclose(final[n], plain[n], rtol=1e-5, atol=1e-6)), n


@pytest.mark.parametrize("k,lam,r", COMPENSATED_R)
def test_delay_compensation_of_a_data_parallel_table_read_r_steps_stale_drifts_from_that_read(runs, k, lam, r):
    """DC-ASGD with the replica "b" read R < K steps stale: its drift is the row now minus the row its late
    read saw (the others' from their fetch, K stale); R = K: the run without replicated_staleness, bit for bit."""
    want, final = _oracle(STEPS, k, lam=lam, r=r)
    for j in range(STEPS):
        got = torch.cat([runs[0]["linear"][(k, lam, r)]["outputs"][j],
                         runs[1]["linear"][(k, lam, r)]["outputs"][j]]).double()
        torch.testing.assert_close(got, want[j], rtol=1e-5, atol=1e-6, msg=lambda m: f"K={k} R={r} batch {j}: {m}")
    merged = merge_shards([x["linear"][(k, lam, r)]["tables"] for x in runs], replicated={"b"})
    for n in NAMES:
        rows = torch.zeros(20, 4, dtype=torch.float64).index_copy(0, merged[n]["keys"], merged[n]["rows"][:, :4].double())
        torch.testing.assert_close(rows, final[n], rtol=1e-5, atol=1e-6)
    if r < k:  # drifting from the fetch instead would differ (row gradients of the linear loss ignore the reads:
        # the final rows differ by the drift alone)
        from_fetch = _oracle(STEPS, k, lam=lam)[1]["b"]
        assert not torch.allclose(final["b"], from_fetch, rtol=1e-5, atol=1e-6)
    else:
        for x in runs:
            assert _same(x["linear"][(k, lam, r)], x["linear"][(k, lam)])


@pytest.mark.slow
def test_a_killed_rank_stops_the_others_with_a_clear_error_under_staleness():
    got = run_ranks(2, "tests.dist.workers_stale:die", {"victim": 1, "at": 3, "timeout": 5.0, "broken_group": True},
                    expected_codes={1: 3})
    err = got[0]["error"]
    assert err is not None and "rank 0 of 2" in err and "a peer process died" in err, err
    assert got[0]["seconds"] < 5.0 + 10.0
