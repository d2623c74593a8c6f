"""A rank that dies is named: the survivors stop within the timeout with an error saying which rank is gone."""

from __future__ import annotations

import pytest

from ._harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # runs of 3 ranks


@pytest.mark.parametrize("staleness", [0, 2])
def test_the_survivors_of_a_killed_rank_name_it(staleness):
    got = run_ranks(3, "tests.dist.workers_stale:die", {"victim": 2, "at": 3, "timeout": 10.0, "broken_group": True,
                                                        "staleness": staleness}, expected_codes={2: 3})
    for rank in (0, 1):
        err = got[rank]["error"]
        assert err is not None, f"rank {rank} kept training after rank 2 died"
        assert f"rank {rank} of 3" in err and "--resume" in err, err
        # rank 2 is named, the other survivor (which fails too, and may exit first) is not blamed
        assert "Who is gone: rank 2 of 3 stopped responding" in err, err
        assert f"rank {1 - rank} " not in err.split("Who is gone:")[1], err
        assert got[rank]["seconds"] < 10.0 + 5.0  # the timeout, plus the heartbeat's 3 s look
