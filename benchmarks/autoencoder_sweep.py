"""The sweep behind kfac_optax's settings in benchmarks/autoencoder.py.

Trains the deep autoencoder with kfac_optax (momentum 0.9, EMA 0.95, Cholesky
inverses) for each given setting, and with Adam at each given learning rate,
all from the same init on the same batches (interleaved, as in the
benchmark), and records the smoothed training loss at a few steps and the
median step time. Results are merged into results/autoencoder_sweep.json
(keyed by run name), so sweeps add up.

  python benchmarks/autoencoder_sweep.py --kfac 0.03:3,0.03:3:20,0.03:3:20:5 --steps 150
"""

import argparse
import json
import os
import sys

import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import autoencoder  # pylint: disable=wrong-import-position
from benchmarks import harness  # pylint: disable=wrong-import-position

OUT = os.path.join(harness.RESULTS_DIR, "autoencoder_sweep.json")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--kfac", default="0.01:1,0.03:3,0.1:3,0.03:3:20",
                      help="comma-separated lr:damping[:inverse period"
                      "[:statistics period]] (periods default to 5 and 1)")
  parser.add_argument("--adam-lrs", default="1e-3")
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--report-steps", default="30,60,90,120,150,180,240,300")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=OUT)
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  workload = autoencoder.workload()
  params, _ = harness.initial_variables(workload, args.seed)
  step = harness.train_step(workload)
  contenders = []
  for spec in args.kfac.split(","):
    lr, damping, period, stats = (float(v) for v in (spec + ":5:1").split(":")[:4])
    settings = dict(learning_rate=lr, damping=damping, momentum=0.9,
                    inverse_update_period=int(period),
                    stats_update_period=int(stats), inverse="cholesky")
    contenders.append(harness.kfac_optax_contender(
        f"kfac lr={lr:g} damping={damping:g} period={int(period)}"
        + (f" stats every {int(stats)}" if stats != 1 else ""), settings,
        workload, step))
  for lr in (float(v) for v in args.adam_lrs.split(",")):
    contenders.append(harness.optax_contender(
        f"adam lr={lr:g}", "adam", optax.adam(lr), dict(learning_rate=lr),
        workload, step))
  batches = harness.Batches(workload, args.seed)
  with harness.single_threaded_lapack():
    record = harness.race(contenders, params, batches, args.steps, log_every=10)
  report_steps = [int(s) for s in args.report_steps.split(",") if int(s) <= args.steps]
  results = {}
  if os.path.isfile(args.out):
    with open(args.out, encoding="utf-8") as f:
      results = json.load(f).get("results", {})
  for c in contenders:
    smoothed = harness.trailing_mean(record[c.name]["loss"])
    results[c.name] = dict(
        family=c.family, settings=c.settings, steps=len(smoothed),
        at_step={s: float(smoothed[s - 1]) for s in report_steps if s <= len(smoothed)},
        median_ms=1e3 * float(np.median(record[c.name]["step_s"][1:])))
    print(f"{c.name:<38} " + " ".join(
        f"@{s}: {v:7.2f}" for s, v in results[c.name]["at_step"].items())
        + f"  {results[c.name]['median_ms']:.0f} ms/step")
  harness.write_json(args.out, dict(
      note="smoothed (trailing mean of 10) mini-batch loss at step k; "
           "timings are from a shared, possibly busy machine", results=results))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
