"""How long each workload's training step takes to compile, K-FAC against Adam.

Issue 40 asks for K-FAC's first-step compile within twice Adam's. The races
report each contender's first step (compile and one step, after whatever
the process compiled before); this study isolates XLA's part: for every
workload it lowers and compiles the harness's training step
(`harness.train_step`) with Adam (the workload's middle learning rate) and
with the README recipe, alternately, ``--repeats`` times, and reports the
median seconds of ``compile()`` (``lower()`` apart), the ratio to Adam's
and the size of each program (lines of its StableHLO). With ``--parts``
the recipe's step is also compiled with each of `Curvature.update`'s two
scheduled branches (the statistics, the inverse refresh) replaced by
"keep the state", and with both: what each branch adds to the compile.
Writes ``benchmarks/results/compile_time.json`` (``_gpu`` on an
accelerator) and prints a Markdown table.

From the repository root::

  python benchmarks/studies/compile_time.py                  # ~5 min on 2 CPU cores
  python benchmarks/studies/compile_time.py --quick          # the quick sizes, writes nothing
  python benchmarks/studies/compile_time.py --parts --repeats 2   # and each branch's share
"""

import argparse
import contextlib
import datetime
import importlib
import os
import statistics
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import harness  # pylint: disable=wrong-import-position
from kfac_optax._src.curvature import curvature  # pylint: disable=wrong-import-position

WORKLOADS = ("autoencoder", "transformer_lm", "convnet", "resnet")
# `Curvature.update` schedules two branches, in this order.
BRANCHES = ("statistics", "refresh")
PARTS = {"without the refresh": {"refresh"}, "without the statistics": {"statistics"},
         "without both": set(BRANCHES)}


@contextlib.contextmanager
def without(dropped):
  """`curvature.on_schedule` keeping the state for the ``dropped`` branches
  (names of `BRANCHES`) of every `Curvature.update` traced meanwhile."""
  scheduled, calls = curvature.on_schedule, []

  def on_schedule(period, warmup, count, step, carry):
    calls.append(None)
    if BRANCHES[(len(calls) - 1) % len(BRANCHES)] in dropped:
      return carry
    return scheduled(period, warmup, count, step, carry)
  curvature.on_schedule = on_schedule
  try:
    yield
  finally:
    curvature.on_schedule = scheduled
  if len(calls) % len(BRANCHES):
    raise RuntimeError(f"{len(calls)} scheduled branches traced: not "
                       f"{BRANCHES} per update; update this study")


def compile_seconds(workload, tx, params, model_state, batch):
  """``(lower seconds, compile seconds, StableHLO lines)`` of one training
  step on ``batch`` (a fresh jit: nothing cached from an earlier compile)."""
  state = harness.ModelTrainState.create(apply_fn=workload.model.apply,
                                         params=params, tx=tx,
                                         model_state=model_state)
  step = harness.train_step(workload)
  started = time.perf_counter()
  lowered = step.lower(state, batch, jax.random.key(0))
  lowered_at = time.perf_counter()
  lowered.compile()
  return (lowered_at - started, time.perf_counter() - lowered_at,
          lowered.as_text().count("\n"))


def measure(name, quick, repeats, parts=False):
  """The medians of every optimizer's `compile_seconds` on workload ``name``
  (``parts``: and the recipe's without each branch, `PARTS`)."""
  module = importlib.import_module(f"benchmarks.{name}")
  workload = module.workload(quick=quick)
  params, model_state = harness.initial_variables(workload, seed=0)
  batch = workload.batch(np.arange(workload.batch_size))
  adam_lrs = module.DEFAULTS["adam_lrs"]
  optimizers = {
      f"adam lr={adam_lrs[len(adam_lrs) // 2]:g}":
          lambda: optax.adam(adam_lrs[len(adam_lrs) // 2]),
      harness.RECIPE_NAME: lambda: harness.kfac_optax_tx(workload, batch,
                                                         **harness.RECIPE),
  }
  variants = {label: (make, set()) for label, make in optimizers.items()}
  if parts:
    variants.update({f"{harness.RECIPE_NAME} {part}": (optimizers[harness.RECIPE_NAME], dropped)
                     for part, dropped in PARTS.items()})
  runs = {label: [] for label in variants}
  for _ in range(repeats):
    for label, (make, dropped) in variants.items():
      with without(dropped):
        runs[label].append(compile_seconds(workload, make(), params, model_state,
                                           batch))
  rows = {label: dict(lower_s=statistics.median(r[0] for r in measured),
                      compile_s=statistics.median(r[1] for r in measured),
                      stablehlo_lines=measured[0][2])
          for label, measured in runs.items()}
  adam = rows[next(iter(rows))]["compile_s"]
  for row in rows.values():
    row["compile_vs_adam"] = row["compile_s"] / adam
  return rows


def markdown(results):
  lines = ["| workload | optimizer | compile s (median) | / Adam's | lower s | StableHLO lines |",
           "|---|---|---:|---:|---:|---:|"]
  for name, rows in results.items():
    for label, row in rows.items():
      lines.append(f"| {name} | {label} | {row['compile_s']:.2f} | "
                   f"{row['compile_vs_adam']:.2f} | {row['lower_s']:.2f} | "
                   f"{row['stablehlo_lines']} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--quick", action="store_true",
                      help="the workloads' quick sizes, one repeat, nothing written")
  parser.add_argument("--parts", action="store_true", help="also the recipe "
                      "without its statistics, its refresh and both")
  args = parser.parse_args(argv)
  repeats = 1 if args.quick else args.repeats
  results = {name: measure(name, args.quick, repeats, args.parts)
             for name in args.workloads.split(",")}
  print(markdown(results), flush=True)
  if not args.quick:
    harness.write_json(
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "results", f"compile_time{harness.backend_suffix()}.json"),
        dict(command=" ".join(["python benchmarks/studies/compile_time.py",
                               *(sys.argv[1:] if argv is None else argv)]),
             date=datetime.datetime.now(datetime.timezone.utc).strftime(
                 "%Y-%m-%d %H:%M UTC"),
             environment=harness.environment(), repeats=repeats, results=results))
  return results


if __name__ == "__main__":
  main()
