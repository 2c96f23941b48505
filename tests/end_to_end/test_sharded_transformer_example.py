"""Smoke test: the sharded transformer example trains K-FAC and AdamW on
its FSDP + tensor-parallel mesh with Explicit axes (the suite's 8 CPU
devices: "data" 4, "model" 2)."""

import math

import pytest

from examples import sharded_transformer


@pytest.mark.parametrize("tiles", [[], ["--factor-block-size", "16"]])
def test_sharded_transformer_quick_run(tmp_path, tiles):
  """Whole factors, and factors tiled with the params' shards."""
  plot = tmp_path / "p.png"
  metrics = sharded_transformer.main(["--quick", "--plot", str(plot), *tiles])
  assert plot.is_file() and plot.stat().st_size > 0
  initial = metrics["initial_loss"]  # log(256): the uniform prediction
  # inf where K-FAC never reaches AdamW's final loss in the quick run.
  assert metrics["kfac"].pop("time_to_adamw_final_loss_vs_adamw") > 0
  for name in ("kfac", "adamw"):
    values = metrics[name]
    assert all(math.isfinite(value) for value in values.values()), values
    assert values["last_loss"] < min(values["first_loss"], initial), values
