"""Smoke test: the MLP example trains both optimizers and saves its plot."""

import math

from examples import mlp_classifier


def test_mlp_classifier_quick_run(tmp_path):
  plot = tmp_path / "p.png"
  metrics = mlp_classifier.main(["--quick", "--plot", str(plot)])
  assert plot.is_file() and plot.stat().st_size > 0
  assert set(metrics) == {"kfac", "adam"}
  for name, values in metrics.items():
    for key, value in values.items():
      assert math.isfinite(value), (name, key, value)
    assert 0.0 <= values["test_accuracy"] <= 1.0
