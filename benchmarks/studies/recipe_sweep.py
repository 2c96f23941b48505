"""Recipe sweep: fixed-mode settings against a workload's wall-clock target.

The README's recipe is one set of kfac_optax settings for every workload.
This races candidate settings (learning rate, damping, KL clipping; the
recipe's periods: statistics every 10 steps, inverses every 50) on one of
the four workload races (autoencoder, convnet, transformer LM, ResNet),
interleaved in one run (`harness.interleaved_run`: same init, batches and
keys), and reports how many steps each needs to reach the targets of the
workload's last full run (``benchmarks/results/<name>.json``: T*k* and
B120s, the best peer's loss after 120 s of step time). A setting
meets the workload's time target at B120s when

    steps to B120s × its mean step ≤ limit × that peer's seconds to B120s,

with the mean step of this run and the peer's seconds from the workload's run:
an estimate to choose candidates by; the workload's own run measures the
chosen one. Each candidate runs the steps that the limit allows at the
recipe's mean step in the workload's run, plus a fifth. Writes
``benchmarks/results/recipe_sweep_<name>.json`` and a RESULTS.md section.

From the repository root::

  python benchmarks/studies/recipe_sweep.py --workload resnet
  python benchmarks/studies/recipe_sweep.py --workload convnet --configs \\
      "learning_rate=0.03,damping=0.01;learning_rate=0.003,damping=0.001"
  python benchmarks/studies/recipe_sweep.py --quick    # smoke test, writes nothing
  python benchmarks/studies/recipe_sweep.py --workload transformer_lm --large  # on a
      # GPU, against the targets of accelerator.py's race (<name>_large_gpu)
  python benchmarks/studies/recipe_sweep.py --out-dir /tmp/s --markdown /tmp/s.md  # keeps
      # RESULTS.md's section and JSON as they are
  python benchmarks/studies/recipe_sweep.py --workload transformer_lm --large \
      --reference transformer_lm_large_gpu --steps 230   # on CPU, steps to the
      # targets of the GPU's race
"""

import argparse
import datetime
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import autoencoder  # pylint: disable=wrong-import-position
from benchmarks import convnet  # pylint: disable=wrong-import-position
from benchmarks import harness  # pylint: disable=wrong-import-position
from benchmarks import resnet  # pylint: disable=wrong-import-position
from benchmarks import transformer_lm  # pylint: disable=wrong-import-position

WORKLOADS = {"autoencoder": autoencoder, "convnet": convnet,
             "transformer_lm": transformer_lm, "resnet": resnet}
# The wall-clock target of each workload (its `GOALS`): the limit on
# (seconds to B120s) / (the best peer's).
TIME_LIMITS = {"autoencoder": 0.5, "convnet": 0.5, "transformer_lm": 0.6,
               "resnet": 0.9}
# The first was the recipe before the sweep of 2026-11-23, the fourth is the
# recipe since.
CANDIDATES = (
    "learning_rate=0.03,damping=0.01,norm_constraint=0.001",
    "learning_rate=0.01,damping=0.001,norm_constraint=0.001",
    "learning_rate=0.003,damping=0.001,norm_constraint=0.001",
    "learning_rate=0.001,damping=0.001,norm_constraint=0.001",
    "learning_rate=0.003,damping=0.001,norm_constraint=None",
)
QUICK_STEPS = 3


def candidate_settings(text):
  """The recipe's periods with ``text``'s settings (``"k=v,..."``) on top."""
  periods = ("stats_update_period", "inverse_update_period")
  return {**{k: harness.RECIPE[k] for k in periods}, **harness.parse_settings(text)}


def label(settings):
  short = dict(learning_rate="lr", damping="damping", norm_constraint="clip",
               stats_update_period="stats", inverse_update_period="inverses",
               curvature_warmup="warm-up")
  return " ".join(f"{short.get(k, k)}={v:g}" if isinstance(v, float) else
                  f"{short.get(k, k)}={v}" for k, v in settings.items()
                  if k not in ("stats_update_period", "inverse_update_period")
                  or v != harness.RECIPE[k])


def reference_run(name, race):
  """The last full run ``name`` (a results file's stem), which the command
  ``race`` writes: targets (with the seconds of the peer that set each), the
  recipe's mean step, the run's date."""
  path = os.path.join(harness.RESULTS_DIR, f"{name}.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no {path}: the sweep's targets come from a full "
                            f"race of the workload on this backend; run {race} first")
  with open(path, encoding="utf-8") as f:
    payload = json.load(f)
  targets = payload["summary"]["targets"]
  for target in targets:  # a run from before the peers raced: Adam set them
    target.setdefault("source_seconds", target.get("adam_seconds"))
  recipe = payload["rows"].get(harness.RECIPE_NAME)
  if recipe is None or not payload["config"].get("budget_s"):
    raise ValueError(f"{path} has no wall-clock race with the recipe: run "
                     f"{race} first")
  return targets, recipe["mean_ms"], payload["date"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", choices=sorted(WORKLOADS), default="resnet")
  parser.add_argument("--configs", default=";".join(CANDIDATES),
                      help="';'-separated candidates, each 'key=value,...' "
                      "of kfac_optax.kfac (the recipe's periods unless given)")
  parser.add_argument("--steps", type=int, help="steps per candidate (default: "
                      "what the time limit allows at the recipe's step, +20%%)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", default=harness.RESULTS_DIR,
                      help="where the JSON goes (default benchmarks/results)")
  parser.add_argument("--markdown", default=harness.RESULTS_MD,
                      help="RESULTS.md to update (default benchmarks/RESULTS.md)")
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK_STEPS} steps of the small workload; writes nothing")
  parser.add_argument("--large", action="store_true",
                      help="the workload's large size, against the targets of "
                      "its <name>_large run on this backend (an accelerator's)")
  parser.add_argument("--reference", help="the run whose targets to use, a "
                      "results file's stem (default: the workload's own run on "
                      "this backend); steps to them compare across backends, "
                      "the estimated time ratio does not")
  args = parser.parse_args(argv)
  started = time.perf_counter()
  module, limit = WORKLOADS[args.workload], TIME_LIMITS[args.workload]
  workload = module.workload(args.quick, large=args.large)
  run = harness.run_name(workload, args.large)
  targets, recipe_ms, reference_date = reference_run(
      args.reference or run,
      f"python benchmarks/{args.workload}.py" + (" --large" if args.large else ""))
  budget = targets[-1]
  steps = QUICK_STEPS if args.quick else args.steps or math.ceil(
      1.2 * limit * budget["source_seconds"] / (recipe_ms / 1e3))
  step = harness.train_step(workload)
  params, model_state = harness.initial_variables(workload, args.seed)
  racers = [harness.kfac_optax_contender(label(settings), settings, workload,
                                         step, model_state)
            for settings in map(candidate_settings, args.configs.split(";"))]
  print(f"{workload.title}: {len(racers)} candidates x {steps} steps", flush=True)
  env, load, compile_s, records = harness.interleaved_run(
      workload, racers, params, steps, args.seed, args.quick)
  rows, _ = harness.summarize(racers, records, compile_s, [], 0)
  for row in rows.values():
    row["to_target"] = [harness.first_reach(
        harness.trailing_mean(row["losses"], t["window"]),
        row["step_s"], t["loss"])[0] for t in targets]
    reached = row["to_target"][-1]
    row["estimated_budget_time_vs_peer"] = (
        None if reached is None else reached * row["mean_ms"] / 1e3
        / budget["source_seconds"])
  payload = dict(
      name=f"recipe_sweep_{run}",
      title=harness.run_title(workload, args.large, env),
      workload=workload.name, limit=limit,
      command=" ".join(["python benchmarks/studies/recipe_sweep.py",
                        *(sys.argv[1:] if argv is None else argv)]),
      date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      environment=env, load_average=load, reference_date=reference_date,
      targets=targets, steps=steps, rows=rows,
      wall_s=time.perf_counter() - started)
  harness.publish(payload["name"], payload, markdown(payload),
                  "benchmarks/studies/recipe_sweep.py", write=not args.quick,
                  out_dir=args.out_dir, markdown=args.markdown)
  return payload


def markdown(payload) -> str:
  targets, rows = payload["targets"], payload["rows"]
  budget = targets[-1]
  lines = [
      f"## Recipe sweep: {payload['title']}", "",
      f"- **Command:** `{payload['command']}` ({payload['date']}, "
      f"{payload['wall_s'] / 60:.1f} min); {payload['steps']} steps per "
      "candidate, all interleaved in one run.",
      f"- **Machine:** {payload['environment']['cpu']}, "
      f"{payload['environment']['cores']} cores; load average "
      f"{payload['load_average']['min']:.1f}-{payload['load_average']['max']:.1f}.",
      f"- **Targets** from the workload's run of {payload['reference_date']}: "
      + ", ".join(f"{t['label']} = {t['loss']:.4g}" for t in targets)
      + f"; {budget.get('source', 'the best Adam')} reached {budget['label']} in "
      f"{budget['source_seconds']:.1f} s. Estimated time ratio = steps to "
      f"{budget['label']} × the candidate's mean step here / that peer's seconds "
      f"(target <= {payload['limit']:g}). Every candidate: statistics every "
      "10 steps and inverses every 50 unless its name says otherwise, other "
      "settings at `kfac`'s defaults (with a learning rate, momentum 0.9; "
      "without, the automatic mode's).", "",
      "| candidate | mean ms/step | final loss | "
      + " | ".join(f"steps to {t['label']}" for t in targets)
      + " | estimated time / peer's |",
      "|---|---:|---:|" + "---:|" * (len(targets) + 1)]
  for name, row in rows.items():
    final = harness.fmt(row["final_loss"], ".4g") + (
        " (diverged)" if row["diverged"] else "")
    lines.append(
        f"| {name} | {harness.fmt(row['mean_ms'])} | {final} | "
        + " | ".join(harness.fmt(s, "d") for s in row["to_target"])
        + f" | {harness.fmt(row['estimated_budget_time_vs_peer'], '.2f')} |")
  lines += ["", f"Raw data: `benchmarks/results/{payload['name']}.json`."]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
