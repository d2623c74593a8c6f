"""The README's main job, `hugeembed train` with every default, gives the figures the README states
(AUC 0.818, COPC 1.02, the true model 0.853).

The run is deterministic on one machine, but its AUC and COPC come through torch's dense kernels
(the MLPs' matmuls), which round differently on other CPU models (AVX2 vs AVX-512 give COPC 1.013
vs 1.02): so they are asserted as the ranges a user can rely on, tight enough that a wrong model
fails (`--sparse-lr 0.02` gives AUC 0.811, `--admit-min-count 1` 0.806, `--no-average-dense`
COPC 1.06).  The best possible AUC is computed from the generator alone and the steps and eval
points are counted, so those are exact.  Its time (about half a minute on 2 free cores) is
measured, not asserted: on a shared machine the same run took 26 s and 151 s."""

from __future__ import annotations

import json

import pytest

from hugeembed.cli import main

README_AUC = 0.818
AUC_TOLERANCE = 0.003  # seen: 0.8183 (AVX2) and 0.818x (AVX-512); a wrong default moves it 0.007+
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
