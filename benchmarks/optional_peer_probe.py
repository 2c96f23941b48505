"""The child process of `optional_peers.probe`: a few steps of one optional
peer on one workload, apart from the race so that a hang, a crash or the
out-of-memory killer ends only this process.

  python -m benchmarks.optional_peer_probe autoencoder psgd_kron 3e-4
"""

import importlib
import sys

import jax
import numpy as np

from benchmarks import harness
from benchmarks import optional_peers


def run_probe(workload_module, family, learning_rate, large):
  """`optional_peers.PROBE_STEPS` steps of ``family`` on the workload."""
  workload = importlib.import_module(f"benchmarks.{workload_module}").workload(
      False, large=large)
  make, reason = optional_peers.load(family)
  if reason:
    raise RuntimeError(reason)
  params, model_state = harness.initial_variables(workload, 0)
  contender = harness.optax_contender(family, family, make(learning_rate), {},
                                      workload, harness.train_step(workload),
                                      model_state)
  state = contender.start(params)
  batch = workload.batch(np.arange(workload.batch_size))
  for i in range(optional_peers.PROBE_STEPS):
    state, loss = contender.step(state, batch, jax.random.key(i), i)
  jax.block_until_ready(loss)
  print(f"{family} on {workload_module}: loss {float(loss):.4g} after "
        f"{optional_peers.PROBE_STEPS} steps")


if __name__ == "__main__":
  if len(sys.argv) < 4:
    sys.exit(__doc__.splitlines()[-1].strip())
  run_probe(sys.argv[1], sys.argv[2], float(sys.argv[3]), "--large" in sys.argv[4:])
