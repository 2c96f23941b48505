"""How long one damped factor inverse takes, by size: the basis of `max_factor_dim`.

Times `damped.damped_inverse` of one ``n × n`` float32 factor (a random Gram
matrix ``X Xᵀ / m`` with ``m = 2n`` rows, as a layer's statistics are) with
each inverse method, jitted, after one compiling call; the best of
``--repeats`` runs (one run above 2048: each takes seconds to minutes),
and the first call's time (compile included).
Writes ``benchmarks/results/factor_inverse.json`` (``--output`` names
another stem; ``_gpu`` on an accelerator) and prints a table.

From the repository root::

  python benchmarks/studies/factor_inverse.py                     # 512 .. 8192
  python benchmarks/studies/factor_inverse.py --sizes 512 1024    # a quick look
"""

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from kfac_optax._src import linalg  # pylint: disable=wrong-import-position
from kfac_optax._src.linalg import damped  # pylint: disable=wrong-import-position

SIZES = (512, 1024, 2048, 3072, 4096, 6144, 8192)


def time_inverse(n: int, method: str, repeats: int) -> tuple[float, float]:
  """Seconds for one jitted ``(F + 1e-2 I)⁻¹`` of an ``n × n`` factor, and
  for its first call (compile included)."""
  rows = jax.random.normal(jax.random.key(n), (n, 2 * n), jnp.float32)
  factor = (rows @ rows.T / (2 * n)).block_until_ready()
  invert = jax.jit(lambda m: damped.damped_inverse(m, jnp.float32(1e-2), method))
  start = time.perf_counter()
  invert(factor).block_until_ready()
  first = time.perf_counter() - start
  best = float("inf")
  for _ in range(repeats if n <= 2048 else 1):
    start = time.perf_counter()
    invert(factor).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return best, first


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
  parser.add_argument("--methods", nargs="+", default=linalg.INVERSE_METHODS)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--output", default="factor_inverse",
                      help="the results file's stem, under benchmarks/results")
  parser.add_argument("--max_seconds", type=float, default=120.0,
                      help="skip larger sizes of a method once one took this long")
  args = parser.parse_args()
  device = jax.devices()[0]
  results = {"command": " ".join(["python benchmarks/studies/factor_inverse.py",
                                   *sys.argv[1:]]),
             "device": device.device_kind, "platform": device.platform,
             "cpu_count": os.cpu_count(), "date": datetime.date.today().isoformat(),
             "seconds": {}, "first_call_seconds": {}}
  print(f"{'n':>6} " + " ".join(f"{m:>10}" for m in args.methods), flush=True)
  too_slow = set()
  for n in args.sizes:
    cells = []
    for method in args.methods:
      if method in too_slow:
        cells.append(f"{'-':>10}")
        continue
      seconds, first = time_inverse(n, method, args.repeats)
      results["seconds"].setdefault(method, {})[str(n)] = seconds
      results["first_call_seconds"].setdefault(method, {})[str(n)] = first
      too_slow.update([method] if seconds > args.max_seconds else [])
      cells.append(f"{seconds:10.3f}")
    print(f"{n:>6} " + " ".join(cells), flush=True)
  suffix = "" if device.platform == "cpu" else "_gpu"
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "results", f"{args.output}{suffix}.json")  # benchmarks/results
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
