"""How long preconditioning one gradient takes, exact and at rank k.

Times jitted `Curvature.precondition_and_count` (what every K-FAC step
applies: ``A⁻¹ V G⁻¹`` per layer and the check that the update fits its
dtype) on the deep autoencoder (`benchmarks/autoencoder.py`, batch 1000), with the
factors and inverses of one step of kfac_optax at the workload's matched
settings (lr 0.03, damping 3) and a random gradient. The settings are timed
interleaved, ``--repeats`` rounds; the median of each is reported.

From the repository root::

  python benchmarks/studies/preconditioning.py               # exact and rank 32
  python benchmarks/studies/preconditioning.py --ranks 16 64
"""

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import autoencoder  # pylint: disable=wrong-import-position
from benchmarks import harness  # pylint: disable=wrong-import-position

from kfac_optax._src.optimizer import inspection  # pylint: disable=wrong-import-position,wrong-import-order


def preconditioner(workload, batch, params, grads, rank):
  """``(jitted precondition_and_count, its curvature state)`` at ``rank``."""
  defaults = autoencoder.DEFAULTS
  tx = harness.kfac_optax_tx(workload, batch, learning_rate=defaults["kfac_lr"],
                             damping=defaults["kfac_damping"], factor_rank=rank)
  curvature, = inspection._curvatures_in(tx, set())  # pylint: disable=protected-access
  update = jax.jit(lambda g, s: tx.update(g, s, params, batch=batch,
                                          rng=jax.random.key(0)))
  _, state = update(grads, tx.init(params))  # statistics and inverses of step 0
  return jax.jit(curvature.precondition_and_count), state.curvature


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ranks", type=int, nargs="+", default=[32])
  parser.add_argument("--repeats", type=int, default=40)
  args = parser.parse_args(argv)
  workload = autoencoder.workload()
  batch = workload.batch(np.arange(workload.batch_size))
  params, _ = harness.initial_variables(workload, 0)
  grads = jax.tree.map(lambda p: 1e-2 * jax.random.normal(jax.random.key(1), p.shape),
                       params)
  timed = {rank: preconditioner(workload, batch, params, grads, rank)
           for rank in [None, *args.ranks]}
  times = {rank: [] for rank in timed}
  for rank, (apply, state) in timed.items():
    jax.block_until_ready(apply(state, grads))  # compiled
  for _ in range(args.repeats):
    for rank, (apply, state) in timed.items():
      start = time.perf_counter()
      jax.block_until_ready(apply(state, grads))
      times[rank].append(time.perf_counter() - start)
  print(f"{'rank':>6} {'median ms':>10}")
  for rank, seconds in times.items():
    print(f"{rank or 'exact':>6} {1e3 * np.median(seconds):10.1f}", flush=True)


if __name__ == "__main__":
  main()
