"""How long one inverse refresh of a model's factors takes, exact and at rank k.

Times jitted `linalg.invert_all` (as `Curvature` refreshes) of the deep
autoencoder's 16 Kronecker factors (`benchmarks/autoencoder.py`:
784-1000-500-250-30 and back; input factors of width + 1 rows, output
factors of width rows),
each a random PSD matrix of its size with a decaying spectrum (a Gram of
``2d`` Gaussian rows over columns scaled by ``1/i``), damping 1e-2: exact
(Cholesky) and at each ``--ranks`` (``factor_rank``, warm-started from the
previous refresh, as in training). Reports the median of ``--repeats``
refreshes, and the process's CPU time while it sleeps 0.3 s after each:
OpenBLAS's threads spinning after a LAPACK call (see `kfac_optax.cholesky`).

From the repository root::

  python benchmarks/studies/low_rank_refresh.py               # ranks 32 and 64
  python benchmarks/studies/low_rank_refresh.py --ranks 16    # others
"""

import argparse
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import autoencoder  # pylint: disable=wrong-import-position
from kfac_optax._src import linalg  # pylint: disable=wrong-import-position

SLEEP_S = 0.3


def factor_sizes() -> list[int]:
  """The autoencoder's factor sizes: each Dense layer's inputs + 1, outputs."""
  model = autoencoder.Autoencoder()
  widths = [784, *model.hidden, model.code, *model.hidden[::-1], 784]
  return [d + 1 for d in widths[:-1]] + widths[1:]


def factors(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  tree = {}
  for i, d in enumerate(factor_sizes()):
    rows = rng.standard_normal((2 * d, d)) / np.arange(1, d + 1)
    matrix = jnp.asarray(rows.T @ rows / (2 * d), jnp.float32)[None]
    tree[i] = linalg.Damped(matrix, jnp.full((1,), 1e-2, jnp.float32))
  return tree


def cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def time_refresh(tree: dict, rank: int | None, repeats: int) -> tuple[float, float]:
  """``(median ms, median CPU seconds spent while sleeping after it)``."""
  refresh = jax.jit(lambda t, previous: linalg.invert_all(
      t, "cholesky", previous=previous, rank=rank))
  # Compiles the cold first refresh, then the warm-started one timed here.
  inverses = refresh(tree, refresh(tree, None))
  times, spins = [], []
  for _ in range(repeats):
    start = time.perf_counter()
    inverses = jax.block_until_ready(refresh(tree, inverses))
    times.append(time.perf_counter() - start)
    before = cpu_seconds()
    time.sleep(SLEEP_S)
    spins.append(cpu_seconds() - before)
  return 1e3 * float(np.median(times)), float(np.median(spins))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ranks", type=int, nargs="+", default=[32, 64])
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  tree = factors()
  print(f"factor sizes: {factor_sizes()}")
  print(f"{'rank':>6} {'refresh ms':>11} {'CPU s in the 0.3 s after':>25}")
  for rank in [None, *args.ranks]:
    ms, spin = time_refresh(tree, rank, args.repeats)
    print(f"{rank or 'exact':>6} {ms:11.1f} {spin:25.3f}", flush=True)


if __name__ == "__main__":
  main()
