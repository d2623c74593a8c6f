"""The README's main job, `hugeembed train` with every default: it finishes in about a minute and
reaches the AUC the README states (about 0.81, the true model 0.85)."""

from __future__ import annotations

import json
import time

import pytest

from hugeembed.cli import main


@pytest.mark.slow
def test_the_readme_main_job_with_defaults(tmp_path):
    t0 = time.perf_counter()
    assert main(["train", "--quiet", "--summary-json", str(tmp_path / "s.json")]) == 0
    wall = time.perf_counter() - t0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == 200 and s["samples"] == 200 * 2048
    assert 0.80 <= s["auc"] <= 0.83 and 0.84 <= s["bayes_auc"] <= 0.86, (s["auc"], s["bayes_auc"])
    assert len(s["history"]["eval_step"]) == 10 and len(s["history"]["copc"]) == 10
    assert wall < 120, f"the main job took {wall:.0f} s; the README says about a minute"
