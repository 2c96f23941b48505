"""Smoke tests: the MLP (linen and NNX) and Hugging Face-style GPT-2 examples
train both optimizers."""

import math
import re

import numpy as np
import pytest

from examples import gpt2_hf_style
from examples import mlp_classifier


@pytest.mark.parametrize("api,first_layer", [("linen", "Dense_0"),
                                             ("nnx", "hidden/0")])
def test_mlp_classifier_quick_run(api, first_layer, tmp_path, capsys):
  plot = tmp_path / "p.png"
  metrics = mlp_classifier.main(["--quick", "--api", api, "--plot", str(plot)])
  printed = capsys.readouterr().out
  assert re.search(rf"{first_layer} +kronecker", printed)
  assert "fallback" not in printed
  assert plot.is_file() and plot.stat().st_size > 0
  assert set(metrics) == {"kfac", "adam"}
  for name, values in metrics.items():
    for key, value in values.items():
      assert math.isfinite(value), (name, key, value)
    assert 0.0 <= values["test_accuracy"] <= 1.0
  # 60 steps on 2048 examples: K-FAC fits the training set faster than Adam.
  assert metrics["kfac"]["train_loss"] < metrics["adam"]["train_loss"]


def test_gpt2_hf_style_quick_run(capsys):
  curves, validation = gpt2_hf_style.main(["--quick"])
  printed = capsys.readouterr().out
  assert re.search(r"transformer/h/0/attn/c_attn +kronecker", printed)
  assert re.search(r"transformer/wte +tied embedding", printed)
  assert "fallback" not in printed
  assert set(curves) == set(validation) == {"K-FAC", "Adam"}
  for name, losses in curves.items():
    assert np.all(np.isfinite(losses)), name
    assert losses[-1] < losses[0], (name, losses)
