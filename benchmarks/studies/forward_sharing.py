"""Does XLA share K-FAC's capture forward pass with the user's forward pass?

K-FAC's ``update`` re-runs the model on the batch to capture layer inputs and
output gradients. In one jitted training step (``jax.value_and_grad`` of the
user's loss, then ``tx.update``) that re-run computes exactly the matmuls of
the user's forward pass, and XLA's common-subexpression elimination can merge
them. This script checks, on each benchmark workload, by counting the dot
and convolution instructions in XLA's optimized HLO
(``jax.jit(f).lower(...).compile().as_text()``) of three programs: the user's
gradient alone, K-FAC's update alone (given gradients), and the whole step.
With sharing the step has ``user + update - forward`` of them, where
``forward`` are the forward ops (``jvp(Model)/...`` in the op name, not
transposed) of one pass. kfac_optax's default ``stats_update_period=1`` runs
the capture unconditionally; any other period puts it inside a
``lax.cond``, whose branch XLA cannot merge with ops outside it, so the step
recomputes the forward pass on every statistics step. What that costs is
measured as the time of one forward pass.

From the repository root::

  python benchmarks/studies/forward_sharing.py          # full-size models, writes RESULTS.md
  python benchmarks/studies/forward_sharing.py --quick  # a small autoencoder, prints only
"""

import argparse
import collections
import datetime
import os
import re
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import autoencoder  # pylint: disable=wrong-import-position
from benchmarks import convnet  # pylint: disable=wrong-import-position
from benchmarks import harness  # pylint: disable=wrong-import-position

NAME = "forward_sharing"
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = \S+ (dot|convolution)\(")


def matmul_ops(hlo_text):
  """``Counter`` of ``op_name`` over the dot and convolution instructions."""
  ops = collections.Counter()
  for line in hlo_text.splitlines():
    if _OP.match(line):
      name = re.search(r'op_name="([^"]*)"', line)
      ops[name.group(1) if name else ""] += 1
  return ops


def is_forward(op_name):
  return re.search(r"\bjvp\(\w+\)/", op_name) and "transpose(" not in op_name


def programs(workload, stats_update_period):
  """``{name: (function, args)}``: user gradient, K-FAC update, whole step."""
  batch = workload.batch(np.arange(workload.batch_size))
  params, _ = harness.initial_variables(workload, 0)
  tx = harness.kfac_optax_tx(workload, batch, learning_rate=0.1, damping=1.0,
                             stats_update_period=stats_update_period)
  state, rng = tx.init(params), jax.random.key(1)
  grads = jax.grad(workload.loss_fn)(params, batch)

  def update(grads, state, params, batch, rng):
    return tx.update(grads, state, params, batch=batch, rng=rng)

  def step(params, state, batch, rng):
    value, grads = jax.value_and_grad(workload.loss_fn)(params, batch)
    return value, update(grads, state, params, batch, rng)

  return {"user gradient": (jax.value_and_grad(workload.loss_fn), (params, batch)),
          "K-FAC update": (update, (grads, state, params, batch, rng)),
          "training step": (step, (params, state, batch, rng))}


def median_ms(fn, args, repeats=20):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def analyse(workload, timing=True):
  """Op counts for stats_update_period 1 and 2, and the forward pass's cost."""
  result = {}
  for period in (1, 2):
    counts = {}
    for name, (fn, args) in programs(workload, period).items():
      ops = matmul_ops(jax.jit(fn).lower(*args).compile().as_text())
      counts[name] = dict(total=sum(ops.values()),
                          forward=sum(n for op, n in ops.items() if is_forward(op)))
    user, update, step = counts.values()
    result[f"stats_update_period={period}"] = dict(
        counts=counts, shared=step["total"] == user["total"] + update["total"]
        - update["forward"] and step["forward"] == user["forward"])
  if timing:
    fns = programs(workload, 1)
    params, batch = fns["user gradient"][1]
    forward = jax.jit(lambda p, b: workload.model.apply({"params": p},
                                                        workload.inputs(b)))
    with harness.single_threaded_lapack():
      result["forward_ms"] = median_ms(forward, (params, batch))
      result["user_gradient_ms"] = median_ms(jax.jit(fns["user gradient"][0]),
                                             (params, batch))
  return result


def markdown_section(results, command, date):
  lines = [
      "## Forward-pass sharing in one jitted step (HLO evidence)", "",
      f"- **Command:** `{command}` ({date}); method: see the docstring of "
      "`benchmarks/studies/forward_sharing.py`.", "",
      "| workload | stats_update_period | dot+conv ops: user gradient | "
      "K-FAC update | training step | forward ops in the step | shared? |",
      "|---|---:|---:|---:|---:|---:|---|"]
  for name, result in results.items():
    for period, entry in result.items():
      if not period.startswith("stats"):
        continue
      c = entry["counts"]
      lines.append(
          f"| {name} | {period.split('=')[1]} | {c['user gradient']['total']} | "
          f"{c['K-FAC update']['total']} | {c['training step']['total']} | "
          f"{c['training step']['forward']} | {'yes' if entry['shared'] else 'no'} |")
  as_expected = all(r["stats_update_period=1"]["shared"]
                    and not r["stats_update_period=2"]["shared"]
                    for r in results.values())
  lines += ["", ("With the default `stats_update_period=1` XLA merges the "
                 "capture pass's forward matmuls/convolutions with the user's "
                 "(the step has one pass's worth of forward ops). With a longer "
                 "period the capture runs inside `lax.cond` and is not merged: "
                 "each statistics step pays one extra forward pass (and the "
                 "other steps skip the whole capture)." if as_expected else
                 "**Unexpected sharing pattern: see the table.**"),
            "Measured cost of one forward pass (one OpenBLAS thread):", ""]
  lines += [f"- {name}: forward {r['forward_ms']:.1f} ms, user gradient "
            f"{r['user_gradient_ms']:.1f} ms per step" for name, r in results.items()
            if "forward_ms" in r]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="the small autoencoder only, no timing, no files")
  parser.add_argument("--markdown", help="RESULTS.md to update (default "
                      "benchmarks/RESULTS.md; none with --quick)")
  args = parser.parse_args(argv)
  if args.markdown is None and not args.quick:
    args.markdown = harness.RESULTS_MD
  results = {w.name: analyse(w, timing=not args.quick)
             for w in ([autoencoder.workload(True)] if args.quick else
                          [autoencoder.workload(), convnet.workload()])}
  for name, result in results.items():
    for period, entry in result.items():
      if period.startswith("stats"):
        print(f"{name} {period}: " + ", ".join(
            f"{k} {v['total']} ({v['forward']} forward)"
            for k, v in entry["counts"].items())
              + f" -> shared: {entry['shared']}")
  if args.markdown:
    command = "python benchmarks/studies/forward_sharing.py"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    harness.write_json(os.path.join(harness.RESULTS_DIR, f"{NAME}.json"),
                       dict(command=command, date=date, results=results))
    harness.update_markdown(args.markdown, NAME,
                            markdown_section(results, command, date),
                            f"benchmarks/studies/{NAME}.py")
  return results


if __name__ == "__main__":
  main()
