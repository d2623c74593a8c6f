"""The README's main job, `hugeembed train` with every default, gives the figures the README states
(AUC 0.818, COPC 1.02, the true model 0.853).

The run is deterministic on one machine, but its AUC and COPC come through torch's dense kernels
(the MLPs' matmuls), which round differently on other CPU models (an AVX2 EPYC gave AUC 0.8179 and
0.8183, COPC 1.013 and 1.017, where the README's machine gave 0.818 / 1.02): so they are asserted
as the ranges a user can rely on, tight enough that a wrong model fails.  Measured on that AVX2
machine: with the sparse updates skipped (the tables never train) AUC 0.706, out of its range;
with the loss weighting positives 1.3x (a calibration bug) COPC 0.886, out of its range.  The
best possible AUC is computed from the generator alone and the steps and eval points are counted,
so those are exact.  Its time (about half a minute on 2 free cores) is measured, not asserted: on
a shared machine the same run took 26 s and 389 s."""

from __future__ import annotations

import json

import pytest

from hugeembed.cli import main

README_AUC = 0.818
AUC_TOLERANCE = 0.003  # seen: 0.8179 and 0.8183 on AVX2; tables not trained: 0.706
COPC_RANGE = (0.97, 1.05)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 26 s alone; over 300 s once while three other jobs shared the 2 cores
def test_the_readme_main_job_with_defaults(tmp_path):
    assert main(["train", "--quiet", "--summary-json", str(tmp_path / "s.json")]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == 200 and s["samples"] == 200 * 2048
    assert len(s["history"]["eval_step"]) == 10 and len(s["history"]["copc"]) == 10
    assert round(s["bayes_auc"], 3) == 0.853, s["bayes_auc"]
    assert abs(s["auc"] - README_AUC) <= AUC_TOLERANCE, s["auc"]
    assert COPC_RANGE[0] <= s["copc"] <= COPC_RANGE[1], s["copc"]
