"""The automatic mode's step against the fixed mode's, timed interleaved.

Issue 40 asks for the automatic mode's mean step within 1.3 times the
recipe's. For each workload this study trains the fixed mode (the README
recipe's learning rate and damping), the automatic mode (`kfac`'s
defaults: α and μ solved, two tangents), the automatic mode with
``momentum=0`` (α alone, one tangent) and with its quadratic model's
curvature from a quarter of the batch (``quadratic_batch_size``), all at
the same statistics and inverse periods (default: the recipe's, 10 and
50), from the same params on the same batches. After a warm-up it times
``--rounds`` refresh periods of steps, the contenders' steps interleaved
as in the races (`harness.race`), so each holds the same statistics steps
and refreshes, and reports each contender's mean ms per step and its
ratio to the fixed mode's. Prints a Markdown table; writes nothing.

From the repository root::

  python benchmarks/studies/automatic_cost.py                   # ~10 min on 2 CPU cores
  python benchmarks/studies/automatic_cost.py --workloads convnet --rounds 6
  python benchmarks/studies/automatic_cost.py --quick           # smoke test
"""

import argparse
import importlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import harness  # pylint: disable=wrong-import-position

WORKLOADS = ("transformer_lm", "convnet", "autoencoder", "resnet")
FIXED = dict(learning_rate=harness.RECIPE["learning_rate"],
             damping=harness.RECIPE["damping"])
WARMUP_STEPS = 12  # past the first refresh and each program's compile


def contenders(batch_size):
  """Each contender's settings; the last takes the quadratic model's
  curvature term from a quarter of the batch (`quadratic_batch_size`), for
  large batches."""
  return {"fixed": FIXED,
          "automatic": dict(learning_rate=None),
          "automatic, μ = 0": dict(learning_rate=None, momentum=0.0),
          "automatic, model on B/4": dict(
              learning_rate=None, quadratic_batch_size=max(1, batch_size // 4))}


def step_times(workload_name, periods, rounds, quick=False):
  """``{contender: [seconds of each timed step]}`` on one workload: after a
  warm-up, ``rounds`` refresh periods of steps, the contenders' steps
  interleaved (`harness.race`, one LAPACK thread as in the races)."""
  workload = importlib.import_module(f"benchmarks.{workload_name}").workload(quick=quick)
  params, model_state = harness.initial_variables(workload, 0)
  step = harness.train_step(workload)
  batches = harness.Batches(workload, 0)
  racers = [harness.kfac_optax_contender(name, {**each, **periods}, workload,
                                         step, model_state)
            for name, each in contenders(workload.batch_size).items()]
  with harness.single_threaded_lapack():
    harness.warm_up(racers, params, batches, WARMUP_STEPS)
    record = harness.race(racers, params, batches,
                          rounds * periods["inverse_update_period"])
  return {name: run["step_s"] for name, run in record.items()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  parser.add_argument("--stats-period", type=int, default=harness.RECIPE["stats_update_period"])
  parser.add_argument("--inverse-period", type=int,
                      default=harness.RECIPE["inverse_update_period"])
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--quick", action="store_true",
                      help="the small workload, periods 2 and 4, 2 rounds")
  args = parser.parse_args(argv)
  if args.quick:
    args.workloads, args.stats_period, args.inverse_period, args.rounds = (
        "autoencoder", 2, 4, 2)
  periods = dict(stats_update_period=args.stats_period,
                 inverse_update_period=args.inverse_period)
  names = list(contenders(1))
  print(f"| workload | {' | '.join(names)} (mean ms per step / fixed) |")
  print("|---|" + "---:|" * len(names))
  results = {}
  for name in args.workloads.split(","):
    times = step_times(name, periods, args.rounds, args.quick)
    means = {k: 1e3 * statistics.mean(v) for k, v in times.items()}
    results[name] = means
    cells = [f"{m:.1f} ({m / means['fixed']:.2f})" for m in means.values()]
    print(f"| {name} | {' | '.join(cells)} |", flush=True)
  return results


if __name__ == "__main__":
  main()
