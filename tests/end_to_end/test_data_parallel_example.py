"""Smoke test: the data-parallel example on this process's 8 CPU devices.

(The multi-process run is in `tests/scaling/test_multihost.py`.)
"""

import numpy as np

from examples import data_parallel


def test_data_parallel_quick_run_learns():
  result = data_parallel.main(["--quick", "--dataset", "digits",
                               "--axis-type", "auto", "--log-every", "10"])
  assert result["devices"] == 8 and result["processes"] == 1
  assert len(result["losses"]) == data_parallel.QUICK_STEPS
  assert np.all(np.isfinite(result["losses"]))
  assert np.mean(result["losses"][-5:]) < 0.5 * result["losses"][0]
  assert result["test_accuracy"] > 0.8
