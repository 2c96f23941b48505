"""What one statistics step costs on a conv net, and what made it slow on CPU.

K-FAC's statistics (the capture pass's forward and sampled backward pass,
the factor products) run on a schedule, inside a `lax.cond`. This races, on
the ResNet workload (`benchmarks/resnet.py`) at its tuned settings (statistics from 32
of the 128 examples) with exact inverses, interleaved in one run
(`harness.race`):

1. no statistics (a plain step: gradient and preconditioning);
2. statistics every step (``stats_update_period=1``: no `lax.cond`);
3. statistics every 2nd step, under the `lax.cond`, as the library runs them;
4. the same without `kfac_optax.conv_layout`: the capture's convolutions as
   jax traces them (XLA:CPU compiles the backward ones, inside the cond, as
   plain loops);
5. the same with the convolution Gram in one-example chunks
   (`kronecker._min_chunk_floats` = 1, the bound before it);
6. the same with the Gram of the whole patches, without its translation
   structure (`kfac_optax.conv_gram`).

Variants 4 to 6 patch the library while their step compiles. Reports the
median of the steps with statistics and of those without, and the cost of
a statistics step over a plain one. Inverses are computed once, at step 0.
Writes ``benchmarks/results/statistics_step.json`` and a RESULTS.md section.

From the repository root::

  python benchmarks/studies/statistics_step.py          # ~3 min on 2 CPU cores
  python benchmarks/studies/statistics_step.py --quick  # smoke test, writes nothing
"""

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import harness  # pylint: disable=wrong-import-position
from benchmarks import resnet  # pylint: disable=wrong-import-position

from kfac_optax._src.blocks import conv_gram  # pylint: disable=wrong-import-position,wrong-import-order
from kfac_optax._src.blocks import kronecker  # pylint: disable=wrong-import-position,wrong-import-order
from kfac_optax._src.curvature import canonical_convolutions  # pylint: disable=wrong-import-position,wrong-import-order

NAME = "statistics_step"
SCRIPT = "benchmarks/studies/statistics_step.py"


# (name, statistics period, a patch active while the step compiles)
VARIANTS = (
    ("no statistics", harness.NEVER, contextlib.nullcontext),
    ("statistics every step (no lax.cond)", 1, contextlib.nullcontext),
    ("statistics every 2nd step (lax.cond)", 2, contextlib.nullcontext),
    ("every 2nd, convolutions as traced", 2,
     lambda: mock.patch.object(canonical_convolutions, "canonical_convolutions",
                               lambda fn: fn)),
    ("every 2nd, one-example Gram chunks", 2,
     lambda: mock.patch.object(kronecker, "_min_chunk_floats", lambda: 1)),
    ("every 2nd, Gram of the whole patches", 2,
     lambda: mock.patch.object(conv_gram, "applies", lambda *args: False)),
)
# --quick, a smoke test: the step kinds and one patched step (compiling a
# variant is most of its time).
QUICK_VARIANTS = VARIANTS[:4]


def contenders(workload, model_state, variants=VARIANTS):
  step = harness.train_step(workload)
  racers = []
  for name, period, patch in variants:
    # Exact inverses, as when its section was measured: they are computed
    # once at step 0, and `factor_rank` would only add a refresh to compile.
    settings = {**resnet.DEFAULTS["tuned"], "factor_rank": None,
                "stats_update_period": period, "inverse_update_period": harness.NEVER}
    racer = harness.kfac_optax_contender(name, settings, workload, step, model_state)

    def step_under_patch(state, batch, rng, i, inner=racer.step, patch=patch):
      with patch():  # only the first call traces and compiles
        return inner(state, batch, rng, i)
    racers.append(dataclasses.replace(racer, step=step_under_patch))
  return racers


def summarize(record, variants=VARIANTS):
  """Per variant, the medians of its steps with and without statistics
  (step 0, which also inverts, left out) and their cost over a plain step."""
  rows = {}
  for name, period, _ in variants:
    ms = 1e3 * np.asarray(record[name]["step_s"])[1:]
    has_statistics = np.arange(1, len(ms) + 1) % period == 0
    rows[name] = dict(
        period=period if period < harness.NEVER else None,
        with_statistics_ms=harness.median_or_none(list(ms[has_statistics])),
        without_statistics_ms=harness.median_or_none(list(ms[~has_statistics])))
  plain = rows[variants[0][0]]["without_statistics_ms"]
  for row in rows.values():
    row["statistics_cost_ms"] = (None if row["with_statistics_ms"] is None
                                 else row["with_statistics_ms"] - plain)
  return rows


def markdown(payload) -> str:
  lines = [
      f"## One statistics step on a conv net: {payload['title']}", "",
      f"- **Command:** `{payload['command']}` ({payload['date']}, "
      f"{payload['wall_s'] / 60:.1f} min); one timed run of "
      f"{payload['steps']} steps, the variants interleaved; method: the "
      "docstring of `benchmarks/studies/statistics_step.py`.",
      f"- **Machine:** {payload['environment']['cpu']}, "
      f"{payload['environment']['cores']} cores; load average "
      f"{payload['load_average']['min']:.1f}-{payload['load_average']['max']:.1f}.",
      f"- **Workload:** {payload['description']} Batch "
      f"{payload['batch_size']}; kfac_optax at the benchmark's tuned settings "
      "(`curvature_batch_size=32`), exact inverses once at step 0.", "",
      "| variant | median ms, steps with statistics | median ms, steps "
      "without | statistics step over a plain one, ms |",
      "|---|---:|---:|---:|"]
  for name, row in payload["rows"].items():
    lines.append(f"| {name} | {harness.fmt(row['with_statistics_ms'])} | "
                 f"{harness.fmt(row['without_statistics_ms'])} | "
                 f"{harness.fmt(row['statistics_cost_ms'])} |")
  lines += ["", f"Raw data: `benchmarks/results/{payload['name']}.json`."]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true",
                      help="a few steps of the small workload; writes nothing")
  args = parser.parse_args(argv)
  started = time.perf_counter()
  workload = resnet.workload(args.quick)
  steps = 4 if args.quick else args.steps
  variants = QUICK_VARIANTS if args.quick else VARIANTS
  params, model_state = harness.initial_variables(workload, args.seed)
  racers = contenders(workload, model_state, variants)
  env, load, _, (record,) = harness.interleaved_run(
      workload, racers, params, steps, args.seed, args.quick)
  name = NAME + harness.backend_suffix()
  payload = dict(
      **harness.payload_header(name, workload, SCRIPT, argv),
      environment=env, load_average=load, steps=steps,
      batch_size=workload.batch_size, rows=summarize(record, variants))
  payload["wall_s"] = time.perf_counter() - started
  harness.publish(name, payload, markdown(payload), SCRIPT, write=not args.quick)
  return payload


if __name__ == "__main__":
  main()
