"""The automatic mode's controls step by step, on one benchmark workload.

Trains kfac_optax with the given settings (default: the automatic mode,
`kfac`'s defaults) on a workload's batches (`harness.Batches`, seed 0) and
prints, every ``--every`` steps and at every step whose loss exceeds
``--above``, the loss before the step and what `kfac` kept in its state:
the last measured reduction ratio ρ, the damping λ, the step's learning
rate ``-α`` and momentum μ, its squared Fisher norm and the damped model's
predicted change. Prints only (a diagnosis, not a race).

From the repository root::

  python benchmarks/studies/automatic_trace.py --workload convnet --steps 1000
  python benchmarks/studies/automatic_trace.py --workload convnet --settings "momentum=0.0"
  python benchmarks/studies/automatic_trace.py --quick      # smoke test
"""

import argparse
import importlib
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import harness  # pylint: disable=wrong-import-position
from kfac_optax._src.optimizer.kfac_step import KFACState  # pylint: disable=wrong-import-position

WORKLOADS = ("autoencoder", "convnet", "transformer_lm", "resnet")


def kfac_state(train_state):
  """The `KFACState` inside a train state's optimizer state."""
  found = [x for x in jax.tree.leaves(train_state.opt_state,
                                      is_leaf=lambda x: isinstance(x, KFACState))
           if isinstance(x, KFACState)]
  if len(found) != 1:
    raise ValueError(f"expected one KFACState in the optimizer state, found {len(found)}")
  return found[0]


def trace(workload_name, settings, steps, every, above, quick=False):
  """Trains and prints the trace; returns ``[(step, loss, ρ, λ)]`` of every step."""
  workload = importlib.import_module(f"benchmarks.{workload_name}").workload(quick=quick)
  params, model_state = harness.initial_variables(workload, 0)
  step = harness.train_step(workload)
  contender = harness.kfac_optax_contender("automatic", settings, workload, step,
                                           model_state)
  batches, state, rows = harness.Batches(workload, 0), contender.start(params), []
  for i in range(steps):
    batch, rng = batches(i)
    state, loss = step(state, batch, rng)
    k = kfac_state(state)
    rows.append((i, float(loss), float(k.rho), float(k.damping)))
    if i % every == 0 or rows[-1][1] > above:
      print(f"{i:5d} loss {float(loss):<10.4g} rho {float(k.rho):<9.3g} "
            f"damping {float(k.damping):<9.3g} lr {float(k.learning_rate):<9.3g} "
            f"momentum {float(k.momentum):<7.3g} fisher norm {float(k.fisher_norm):<9.3g} "
            f"model change {float(k.qmodel_change):.3g}", flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workload", choices=WORKLOADS, default="convnet")
  parser.add_argument("--settings", type=harness.parse_settings, default={},
                      help="kfac_optax keywords over the automatic mode's, "
                      "e.g. 'min_damping=1e-5'")
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--every", type=int, default=50)
  parser.add_argument("--above", type=float, default=5.0,
                      help="also print every step whose loss exceeds this")
  parser.add_argument("--quick", action="store_true", help="the small workload, 3 steps")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.every = 3, 1
  return trace(args.workload, {"learning_rate": None, **args.settings},
               args.steps, args.every, args.above, args.quick)


if __name__ == "__main__":
  main()
