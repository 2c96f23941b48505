"""The stability suite's quick mode: every model, every contender, ten steps.

A smoke test of the suite's machinery and of the K-FAC configurations; the
full suite's verdict is in benchmarks/STABILITY.md.
"""

import json
import math

import numpy as np
import pytest

from benchmarks import stability
from benchmarks import stability_problems

QUICK_ADAM = f"adam lr={stability.QUICK_ADAM_LR:g}"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """The quick run's results and its output folder (run once, ~1 min)."""
  out = tmp_path_factory.mktemp("stability")
  results = stability.main(["--quick", "--out-dir", str(out),
                            "--markdown", str(out / "STABILITY.md")])
  return results, out


def test_results_hold_every_model_and_contender(quick_run):
  results, out = quick_run
  assert set(results["models"]) == set(stability_problems.PROBLEMS)
  for model, result in results["models"].items():
    assert not result["failed"], model
    assert set(result["rows"]) == {*stability.CONFIGS, QUICK_ADAM}, model
    assert result["best_adam"] == QUICK_ADAM
    for name, row in result["rows"].items():
      assert 0 < row["steps"] <= stability.QUICK_STEPS, (model, name)
      assert row["mean_ms"] > 0 and row["compile_s"] > 0, (model, name)
      assert row["diverged"] == (row["first_nonfinite_step"] is not None)
    for name in stability.CONFIGS:
      stats = result["rows"][name]["stats"]
      assert set(stats) == set(stability.TRACKED_STATS), (model, name)
      assert 0 < stats["requested_damping"]["min"] <= stats["requested_damping"]["max"], (
          model, name)

  saved = json.loads((out / "stability.json").read_text())
  assert set(saved["models"]) == set(stability_problems.PROBLEMS)
  text = (out / "STABILITY.md").read_text()
  assert "`python benchmarks/stability.py --quick" in text
  assert all(f"| {model} | kfac_auto |" in text
             for model in stability_problems.PROBLEMS)


def test_kfac_losses_are_finite(quick_run):
  results, _ = quick_run
  for model, result in results["models"].items():
    for name in stability.CONFIGS:
      row = result["rows"][name]
      assert row["steps"] == stability.QUICK_STEPS, (model, name)
      assert np.all(np.isfinite(row["losses"])), (model, name, row["losses"])
      assert math.isfinite(row["final_loss"]), (model, name)
