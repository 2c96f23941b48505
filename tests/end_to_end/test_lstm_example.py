"""Smoke test: the LSTM LM example trains K-FAC (series_option2) and Adam, and plots.

(One K-FAC option keeps it short: each compiles for seconds; tests/blocks/test_series.py
checks every option's preconditioning.)"""

import math

from examples import lstm_lm


def test_lstm_lm_quick_run(tmp_path):
  plot = tmp_path / "p.png"
  metrics = lstm_lm.main(["--quick", "--plot", str(plot)])
  assert plot.is_file() and plot.stat().st_size > 0
  assert set(metrics) == {"series_option2", "adam", "initial_loss"}
  assert metrics["series_option2"].pop("time_to_adam_final_loss_vs_adam") > 0
  for name in ("series_option2", "adam"):
    for key, value in metrics[name].items():
      assert math.isfinite(value), (name, key, value)
    assert metrics[name]["last_batch_loss"] < metrics["initial_loss"], name
  assert metrics["adam"]["learning_rate"] in lstm_lm.ADAM_LRS
