"""Statistics from a sub-batch: step time and loss for ``curvature_batch_size``.

K-FAC's statistics pass (the capture's forward and sampled backward pass,
the factor products) runs on the first n examples of each batch; the
gradient stays the whole batch's. This races kfac_optax at the workload's
benchmark settings with n = B, B/2 and B/4 (B the batch size) against the
workload's best Adam, interleaved in one run (`harness.race`: same
parameters, batches and keys), and reports each one's step time relative to
n = B, its smoothed loss at fixed steps and its time to Adam's loss at the
key step. Writes ``benchmarks/results/curvature_batch_<workload>.json`` and a
RESULTS.md section.

From the repository root::

  python benchmarks/studies/curvature_batch.py                      # autoencoder
  python benchmarks/studies/curvature_batch.py --workload convnet
  python benchmarks/studies/curvature_batch.py --quick              # smoke test
"""

import argparse
import os
import sys
import time

import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import autoencoder  # pylint: disable=wrong-import-position
from benchmarks import convnet  # pylint: disable=wrong-import-position
from benchmarks import harness  # pylint: disable=wrong-import-position

WORKLOADS = {"autoencoder": (autoencoder, 1e-3), "convnet": (convnet, 1e-2)}
FRACTIONS = (1, 2, 4)  # n = B / fraction
LOSS_STEPS = (50, 100, 200)


def contenders(workload, module, adam_lr):
  """kfac_optax at the workload's settings with n = B, B/2, B/4, and Adam."""
  defaults = module.DEFAULTS
  step = harness.train_step(workload)
  kfac = dict(learning_rate=defaults["kfac_lr"], damping=defaults["kfac_damping"],
              momentum=0.9, ema_decay=0.95, inverse_update_period=5,
              estimation="fisher", inverse="cholesky", norm_constraint=None)
  racers = []
  for fraction in FRACTIONS:
    size = workload.batch_size // fraction
    settings = {**kfac, "curvature_batch_size": size}
    racers.append(harness.kfac_optax_contender(
        f"kfac_optax n={size}", settings, workload, step))
  racers.append(harness.optax_contender(
      f"adam lr={adam_lr:g}", "adam", optax.adam(adam_lr),
      dict(learning_rate=adam_lr), workload, step))
  return racers


def markdown(payload) -> str:
  rows, summary = payload["rows"], payload["summary"]
  full = next(iter(rows))
  key = summary["targets"][0] if summary["targets"] else None
  lines = [
      f"## Statistics from a sub-batch: {payload['title']}", "",
      f"- **Command:** `{payload['command']}` ({payload['date']}, "
      f"{payload['wall_s'] / 60:.1f} min); one timed run of "
      f"{payload['config']['steps']} steps, all contenders interleaved.",
      f"- **Machine:** {payload['environment']['cpu']}, {payload['environment']['cores']} cores; load average during the "
      f"run {payload['load_average']['min']:.1f}-{payload['load_average']['max']:.1f}"
      f" (shared machine: compare the ratios, measured side by side).",
      f"- **Workload:** {payload['description']} Batch B = "
      f"{payload['config']['batch_size']}; kfac_optax settings: "
      + ", ".join(f"{k}={v}" for k, v in rows[full]["settings"].items()
                 if k != "curvature_batch_size") + ".", "",
      "| contender | median ms/step | mean ms/step | mean / n=B | mean / Adam | "
      + " | ".join(f"loss @{s}" for s in payload["loss_steps"])
      + (f" | steps / s to Adam's step-{key['step']} loss ({key['loss']:.4g})"
         if key else "") + " |",
      "|---|---:|---:|---:|---:|" + "---:|" * len(payload["loss_steps"])
      + ("---:|" if key else "")]
  for name, row in rows.items():
    losses = " | ".join(harness.fmt(row["smoothed"][s - 1], ".4g")
                        if s <= row["steps"] else "—" for s in payload["loss_steps"])
    reach = row["to_target"][0] if key else None
    lines.append(
        f"| {name} | {harness.fmt(row['median_ms'])} | {harness.fmt(row['mean_ms'])} | "
        f"{harness.fmt(harness.ratio(row['mean_ms'], rows[full]['mean_ms']), '.2f')} | "
        f"{harness.fmt(row['mean_vs_adam'], '.2f')} | {losses}"
        + (f" | {reach['steps'] or '—'} / {harness.fmt(reach['seconds'])}"
           if key else "") + " |")
  lines += ["", "Losses are the trailing mean of 10 mini-batch losses (the "
            "gradient's whole batch). Raw data: "
            f"`benchmarks/results/{payload['name']}.json`."]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", choices=sorted(WORKLOADS), default="autoencoder")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--key-step", type=int, default=120)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true",
                      help="a few steps of the small workload; writes nothing")
  args = parser.parse_args(argv)
  started = time.perf_counter()
  module, adam_lr = WORKLOADS[args.workload]
  workload = module.workload(args.quick)
  steps, key_step = (3, 3) if args.quick else (args.steps, args.key_step)
  racers = contenders(workload, module, adam_lr)
  params, _ = harness.initial_variables(workload, args.seed)
  env, load, compile_s, records = harness.interleaved_run(
      workload, racers, params, steps, args.seed, args.quick)
  rows, summary = harness.summarize(racers, records, compile_s, [key_step], key_step)
  name = f"curvature_batch_{workload.name}{harness.backend_suffix()}"
  payload = dict(
      **harness.payload_header(name, workload, "benchmarks/studies/curvature_batch.py", argv),
      environment=env, load_average=load,
      config=dict(steps=steps, batch_size=workload.batch_size, seed=args.seed,
                  quick=args.quick),
      loss_steps=[s for s in LOSS_STEPS if s <= steps] or [steps],
      rows=rows, summary=summary)
  payload["wall_s"] = time.perf_counter() - started
  harness.publish(name, payload, markdown(payload), "benchmarks/studies/curvature_batch.py",
                  write=not args.quick)
  return payload


if __name__ == "__main__":
  main()
