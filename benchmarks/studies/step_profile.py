"""Where kfac_optax's training step spends its time, on each benchmark workload.

Two views of the benchmark's kfac_optax step (same settings):

1. Variants, timed interleaved as in the benchmarks (`harness.race`), each
   switching one more part on: the gradient with an SGD-momentum update; +
   preconditioning (statistics and inverses computed once, at step 0); +
   statistics every step (capture pass and factor products); + an inverse
   refresh every step. Differences of median step times give each part's
   cost; the default step (the benchmarks' kfac_optax) refreshes the
   inverses every 5 steps.
2. An XLA profile (``jax.profiler``) of the statistics-every-step variant:
   the time of every executed HLO op, grouped by the JAX name stack of the op
   (its ``op_name``): the forward pass (shared with K-FAC's capture, see
   `forward_sharing`), the backward passes (the user's and the capture
   pass's vjp of the sampled targets: with one sample both are named
   ``transpose(jvp(...))`` and XLA shares what they compute alike), K-FAC's
   other matmuls (factor products, preconditioning) and everything else
   (elementwise work, pooling, EMA, sampling, and ops without a JAX name such
   as iota and layout copies). Op times are summed over XLA's threads, so
   shares are shares of CPU time; the most expensive ops are listed.
   XLA:CPU runs convolutions asynchronously in Eigen's thread pool, outside
   the profiled op events, so the convnet's convolutions (forward and both
   backward passes) are all but missing from this view; view 1 includes them.
   Plain ``dot`` ops (Eigen's matmuls: weight gradients, factor Grams) are
   undercounted the same way (on the autoencoder a 1.57-GFLOP weight
   gradient showed 1.0 ms, four times the 2 cores' peak); the ``ynn_fusion``
   matmuls (YNNPACK) are timed in full.
   On a GPU the view sums the kernel times on the device (cuBLAS, cuDNN and
   Triton matmuls count as matmuls, cuSOLVER as the inverses); the step time
   of view 1 also holds the host's dispatch and any idle device time. Run
   it there with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=``: by default
   XLA replays runs of kernels as CUDA graphs, which the profile names only
   ``command_buffer_N``, not by op.
   Results on an accelerator go to their own JSON and RESULTS.md section
   (``step_profile_gpu``).

From the repository root::

  python benchmarks/studies/step_profile.py          # every workload, writes RESULTS.md
  python benchmarks/studies/step_profile.py --quick  # a small autoencoder, prints only
  python benchmarks/studies/step_profile.py --workload autoencoder \
      --settings "norm_constraint=None,factor_rank=32,curvature_batch_size=250"
                                             # other settings, prints only
"""

import argparse
import collections
import datetime
import glob
import os
import re
import sys
import tempfile

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import autoencoder  # pylint: disable=wrong-import-position
from benchmarks import convnet  # pylint: disable=wrong-import-position
from benchmarks import harness  # pylint: disable=wrong-import-position
from benchmarks import resnet  # pylint: disable=wrong-import-position
from benchmarks import transformer_lm  # pylint: disable=wrong-import-position

NAME = "step_profile"
TOP_OPS = 8
PARTS = ("forward (shared with the capture)",
         "backward passes (user's and capture's)",
         "other K-FAC matmuls (factors, preconditioning)",
         "LAPACK or cuSOLVER (inverses)",
         "elementwise, pooling, iota/copies and other")


def variants(workload, settings, inverse_period, model_state):
  """The step variants of view 1, cheapest first; ``model_state``: the
  initial `harness.Workload.mutable` collections (BatchNorm's statistics)."""
  example_batch = workload.batch(np.arange(workload.batch_size))
  step = harness.train_step(workload)

  def kfac(name, **overrides):
    tx = harness.kfac_optax_tx(workload, example_batch, **{**settings, **overrides})
    return harness.optax_contender(name, "kfac_optax", tx, overrides, workload, step,
                                   model_state)

  sgd = optax.sgd(settings["learning_rate"], momentum=settings["momentum"])
  return [
      harness.optax_contender("gradient + SGD-momentum", "sgd", sgd, {},
                              workload, step, model_state),
      kfac("+ preconditioning", stats_update_period=harness.NEVER,
           inverse_update_period=harness.NEVER),
      kfac("+ statistics every step", inverse_update_period=harness.NEVER),
      kfac("+ inverses every step", inverse_update_period=1),
      kfac(f"default (inverses every {inverse_period})",
           inverse_update_period=inverse_period),
  ]


def part_of(hlo_line):
  """Which `PARTS` entry an executed HLO op belongs to (None: a control-flow op,
  whose time is that of the ops it runs)."""
  match = re.match(r"^\s*(?:ROOT )?%(\S+) = .*? ([\w-]+)\(", hlo_line)
  name, opcode = match.groups() if match else ("", "")
  if opcode in ("while", "conditional", "call"):
    return None
  op_name = re.search(r'op_name="([^"]*)"', hlo_line)
  op_name = op_name.group(1) if op_name else ""
  matmul = (opcode in ("dot", "convolution") or name.startswith("ynn_fusion")
            or re.search(r'"__(cublas|cudnn|triton_(nested_)?gemm)', hlo_line) is not None)
  if re.search(r'custom_call_target="(lapack|cusolver|__cublas\$triangularSolve)',
               hlo_line):
    return PARTS[3]
  if re.search(r"\bjvp\(\w+\)/", op_name) and "transpose(" not in op_name:
    return PARTS[0] if matmul else PARTS[4]
  if "transpose(jvp(" in op_name:
    return PARTS[1]
  return PARTS[2] if matmul else PARTS[4]


def op_profile(contender, params, batches, steps):
  """Seconds per HLO op over ``steps`` profiled steps of ``contender`` (on an
  accelerator: its kernels' time on the device)."""
  state = contender.start(params)
  state, _, _ = harness.timed_step(contender, state, 0, batches)  # compiled
  directory = tempfile.mkdtemp(prefix="kfac_profile_")
  with jax.profiler.trace(directory):
    for i in range(1, steps + 1):
      state, _, _ = harness.timed_step(contender, state, i, batches)
  path, = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
  durations = collections.Counter()
  on_device = jax.default_backend() != "cpu"
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if on_device and not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if "hlo_op" in stats and "jit_step" in str(stats.get("hlo_module", "")):
          durations[stats["hlo_op"]] += event.duration_ns * 1e-9
  return durations


def hlo_lines(workload, contender, params, batches):
  """``{instruction name: its HLO line}`` of the contender's compiled step."""
  state = contender.start(params)
  batch, rng = batches(0)
  text = harness.train_step(workload).lower(state, batch, rng).compile().as_text()
  return {m.group(1): line for line in text.splitlines()
          if (m := re.match(r"^\s*(?:ROOT )?%(\S+) = ", line))}


def profile(workload, settings, inverse_period, steps, profile_steps):
  params, model_state = harness.initial_variables(workload, 0)
  batches = harness.Batches(workload, seed=0)
  contenders = variants(workload, settings, inverse_period, model_state)
  with harness.single_threaded_lapack():
    harness.warm_up(contenders, params, batches, 2)
    record = harness.race(contenders, params, batches, steps)
    statistics = contenders[2]
    durations = op_profile(statistics, params, batches, profile_steps)
  median = {c.name: 1e3 * float(np.median(record[c.name]["step_s"][1:]))
            for c in contenders}
  names = list(median)
  parts_ms, top_ops = collections.Counter(), []
  lines = hlo_lines(workload, statistics, params, batches)
  for op, seconds in durations.most_common():
    part = part_of(lines.get(op, ""))
    if part is not None:
      parts_ms[part] += 1e3 * seconds / profile_steps
      if len(top_ops) < TOP_OPS:
        op_name = re.search(r'op_name="([^"]*)"', lines.get(op, ""))
        top_ops.append(dict(op=op, ms=1e3 * seconds / profile_steps, part=part,
                            op_name=op_name.group(1) if op_name else ""))
  return dict(
      median_ms=median,
      differences_ms={
          "preconditioning": median[names[1]] - median[names[0]],
          "statistics (capture + factor products + EMA)":
              median[names[2]] - median[names[1]],
          "one inverse refresh": median[names[3]] - median[names[2]],
          f"inverse refresh, amortised over {inverse_period} steps":
              (median[names[3]] - median[names[2]]) / inverse_period},
      op_ms_per_step={part: parts_ms.get(part, 0.0) for part in PARTS},
      top_ops=top_ops)


def markdown_section(results, command, date, device=None):
  """The RESULTS.md section; ``device``: the accelerator's name, None on CPU."""
  where, unit, note, ms = (
      (f" on GPU ({device})", "GPU ms/step", "kernel time on the device", ".2f")
      if device else ("", "CPU ms/step", "op time summed over threads; "
                      "convolutions and plain dots run outside the profiled "
                      "events and are missing or undercounted",
                      ".1f"))
  lines = [f"## Where kfac_optax's step time goes{where}", "",
           f"- **Command:** `{command}` ({date}); method: see the docstring of "
           "`benchmarks/studies/step_profile.py`. One OpenBLAS thread.", ""]
  for name, r in results.items():
    step = r["median_ms"][list(r["median_ms"])[2]]
    total = sum(r["op_ms_per_step"].values())
    lines += [f"### {name}", "", "| variant | median ms/step |", "|---|---:|"]
    lines += [f"| {k} | {v:{ms}} |" for k, v in r["median_ms"].items()]
    lines += ["", "| part (from the differences) | ms/step |", "|---|---:|"]
    lines += [f"| {k} | {v:{ms}} |" for k, v in r["differences_ms"].items()]
    lines += ["", f"XLA op profile of the statistics-every-step variant "
              f"(median step {step:{ms}} ms; {note}; {total:{ms}} ms in all):", "",
              f"| part | {unit} | share |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:{ms}} | {v / total:.0%} |"
              for k, v in r["op_ms_per_step"].items()]
    lines += ["", f"The {TOP_OPS} most expensive ops:", "",
              f"| HLO op | {unit} | part | JAX op name |", "|---|---:|---|---|"]
    lines += [f"| `{o['op']}` | {o['ms']:{ms}} | {o['part']} | "
              f"`{o['op_name'] or '(none)'}` |"
              for o in r["top_ops"]]
    lines.append("")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="the small autoencoder only, few steps, no files")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--profile-steps", type=int, default=5)
  parser.add_argument("--markdown", help="RESULTS.md to update (default "
                      "benchmarks/RESULTS.md; none with --quick or --settings)")
  parser.add_argument("--settings", type=harness.parse_settings, default={},
                      help="kfac_optax keywords over the defaults, e.g. "
                      "'factor_rank=32,curvature_batch_size=250' (prints only)")
  workloads = {"autoencoder": autoencoder, "convnet": convnet,
               "transformer_lm": transformer_lm, "resnet": resnet}
  parser.add_argument("--workload", choices=list(workloads), help="only this one")
  parser.add_argument("--large", action="store_true", help="the workloads' "
                      "large (accelerator) sizes; results under step_profile_large")
  args = parser.parse_args(argv)
  if args.settings and args.markdown:
    parser.error("--settings prints only; RESULTS.md holds the defaults' profile")
  if args.quick:
    args.steps, args.profile_steps = 2, 1
    workloads = {"autoencoder": autoencoder}
  elif args.markdown is None and not args.settings:
    args.markdown = harness.RESULTS_MD
  results = {}
  for module in [m for name, m in workloads.items() if args.workload in (None, name)]:
    defaults = module.DEFAULTS
    settings = {**dict(learning_rate=defaults["kfac_lr"], damping=defaults["kfac_damping"],
                       momentum=0.9, inverse="cholesky"), **args.settings}
    workload = module.workload(args.quick, args.large)
    print(f"{workload.title}:", flush=True)
    results[workload.title] = r = profile(workload, settings, 5, args.steps,
                                          args.profile_steps)
    for k, v in {**r["median_ms"], **r["differences_ms"], **r["op_ms_per_step"]}.items():
      print(f"  {k:<52} {v:8.1f} ms")
  if args.markdown:
    flags = os.environ.get("XLA_FLAGS")
    command = " ".join([(f"XLA_FLAGS={flags} " if flags else "")
                        + "python benchmarks/studies/step_profile.py",
                        *(sys.argv[1:] if argv is None else argv)])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = harness.accelerator()
    name = NAME + ("_large" if args.large else "") + harness.backend_suffix()
    harness.write_json(os.path.join(harness.RESULTS_DIR, f"{name}.json"),
                       dict(command=command, date=date, device=device, results=results))
    harness.update_markdown(args.markdown, name,
                            markdown_section(results, command, date, device),
                            f"benchmarks/studies/{NAME}.py")
  return results


if __name__ == "__main__":
  main()
