"""Smoke test: the transformer LM example trains both optimizers and plots."""

import math

from examples import transformer_lm


def test_transformer_lm_quick_run(tmp_path):
  plot = tmp_path / "p.png"
  metrics = transformer_lm.main(["--quick", "--plot", str(plot)])
  assert plot.is_file() and plot.stat().st_size > 0
  initial = metrics["initial_loss"]  # log(vocab): the uniform prediction
  assert math.isfinite(initial) and initial > 3.0
  # inf where K-FAC never reaches Adam's final loss in the quick run's 40 steps.
  assert metrics["kfac"].pop("time_to_adam_final_loss_vs_adam") > 0
  for name in ("kfac", "adam"):
    values = metrics[name]
    for key, value in values.items():
      assert math.isfinite(value), (name, key, value)
    for key in ("train_loss", "validation_loss", "last_batch_loss"):
      assert values[key] < initial, (name, key, values[key], initial)
    assert math.isclose(values["train_bpc"], values["train_loss"] / math.log(2))
