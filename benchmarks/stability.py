"""Stability suite: does K-FAC train nine small models untuned?

Every model of `stability_problems` is trained for a few hundred steps with
each configuration of `CONFIGS` (keywords passed straight to
``kfac_optax.kfac``) and with Adam at each of `ADAM_LRS`, once for each of
`SEEDS` (its own initial params, batches and keys). The best Adam (by final
smoothed loss) sets each seed's target. Per model and configuration the
results give the median over the seeds of the final smoothed loss (and its
range), whether and where the loss first went non-finite in any seed, the
median steps and seconds to the best Adam's final loss, the median mean
ms/step, and the extremes of ``kfac_optax.stats`` over the runs (learning
rate, momentum, damping, ρ: what the automatic mode chose). These models
are small and their 300-step losses chaotic: one seed's ranking of two
contenders can reverse on the next, so a single seed is not a verdict.

Fairness as in `harness`: one set of initial params per model, the same
batches and per-step keys for every contender, compilation in a discarded
one-step warm-up (six steps when kfac-jax races), steps interleaved
round-robin and each timed to ``block_until_ready``, one OpenBLAS thread. A
contender stops at its first non-finite loss.

From the repository root::

  python benchmarks/stability.py                  # full suite (~13 min on 2 cores)
  python benchmarks/stability.py --quick          # smoke test, one seed (~1 min)
  python benchmarks/stability.py --models self_attention --configs kfac_auto --steps 100

A full run (all models, default steps) writes ``benchmarks/results/stability.json``
and ``benchmarks/STABILITY.md``; other runs only print their table unless
``--out-dir``/``--markdown`` are given.

Against kfac-jax (optional: needs ``pip install kfac-jax==0.0.8``; without it
the contender is skipped with a note): the contender ``kfac_jax_auto`` is
kfac-jax's automatic mode as its README's quick start sets it up
(`KFAC_JAX_AUTO`), on the same params, batches and per-step keys. The
comparison run::

  python benchmarks/stability.py --configs kfac_auto,kfac_jax_auto,adam

over all models writes ``benchmarks/results/stability_kfac_jax.json`` and the
section "Against kfac-jax's automatic mode" of STABILITY.md (each run leaves
the other's section in place). Models kfac-jax cannot run are listed with
its error.
"""

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # pylint: disable=wrong-import-position
from benchmarks import stability_problems  # pylint: disable=wrong-import-position

LR = 0.03  # the README's recommended learning rate
CONFIGS = {
    # (a) the defaults, with only a learning rate given.
    "kfac_default": dict(learning_rate=LR),
    # (b) the automatic mode: nothing given.
    "kfac_auto": dict(),
    # (c) the README's recipe for wall-clock speed.
    "kfac_recipe": dict(harness.RECIPE),
}
# kfac-jax's automatic mode as in its README's quick start: adaptive learning
# rate, momentum and damping from initial damping 1, everything else at
# kfac_jax.Optimizer's defaults (damping in [1e-8, inf), adapted every 5
# steps by factors of 0.9; curvature EMA 0.95, inverses every 5 steps, its
# default estimator). No L2 term and no burn-in, like every contender here.
KFAC_JAX = "kfac_jax_auto"
KFAC_JAX_AUTO = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                     use_adaptive_damping=True, initial_damping=1.0)
COMPARISON = ("kfac_auto", KFAC_JAX, "adam")
ADAM_LRS = (1e-3, 3e-3, 1e-2)
QUICK_ADAM_LR = 3e-3
STEPS, QUICK_STEPS = 300, 10
SEEDS = (0, 1, 2)
TRACKED_STATS = ("learning_rate", "momentum", "requested_damping", "rho")
STABILITY_MD = os.path.join(harness.REPO_ROOT, "benchmarks", "STABILITY.md")
SCRIPT = "benchmarks/stability.py"


def kfac_contender(problem, name, settings, extremes):
  """A kfac_optax contender that also keeps the min/max of its `stats`.

  The extremes are not donated with the training state, so the latest ones
  stay readable in ``extremes[name]`` (``{stat: (min, max)}``) after the run.
  """
  tx = problem.kfac(**settings)
  train_step = problem.train_step(tx)

  @jax.jit
  def track(extremes, opt_state):
    now = kfac_optax.stats(opt_state)
    return {k: (jnp.fmin(low, now[k]), jnp.fmax(high, now[k]))
            for k, (low, high) in extremes.items()}

  def start(params):
    unset = (jnp.float32(jnp.inf), jnp.float32(-jnp.inf))
    return problem.init_state(tx, params), {k: unset for k in TRACKED_STATS}

  def step(carry, batch, rng, i):
    del i
    state, loss = train_step(carry[0], batch, rng)
    extremes[name] = track(carry[1], state.opt_state)
    return (state, extremes[name]), loss

  return harness.Contender(name, "kfac_optax", settings, start, step)


def adam_contender(problem, lr):
  tx = optax.adam(lr)
  train_step = problem.train_step(tx)
  return harness.Contender(
      f"adam lr={lr:g}", "adam", dict(learning_rate=lr),
      lambda params: problem.init_state(tx, params),
      lambda state, batch, rng, i: train_step(state, batch, rng))


def kfac_jax_contender(problem, kfac_jax, seed):
  """kfac-jax's automatic mode (`KFAC_JAX_AUTO`) on ``problem``.

  The model's other collections (BatchNorm statistics) are kfac-jax's
  function state; its dropout key is the one kfac-jax hands the loss.
  """
  return harness.kfac_jax_contender(
      KFAC_JAX, kfac_jax, problem.kfac_jax_loss(kfac_jax), problem.example_batch,
      seed, settings=KFAC_JAX_AUTO, optimizer_kwargs=KFAC_JAX_AUTO,
      step_kwargs={}, func_state=problem.variables)


def run_model(problem, configs, adam_lrs, steps, seed, log_every, load,
              kfac_jax=None):
  """Races every contender on ``problem``; returns its results entry.

  ``kfac_jax``: the module, to race its automatic mode too, or None.
  """
  extremes = {}
  contenders = ([kfac_contender(problem, n, s, extremes)
                 for n, s in configs.items()]
                + [adam_contender(problem, lr) for lr in adam_lrs]
                + ([kfac_jax_contender(problem, kfac_jax, seed)]
                   if kfac_jax else []))
  # kfac-jax compiles its damping-adaptation step on first use (its fifth).
  warm_up_steps = harness.WARMUP_STEPS if kfac_jax else 1
  batches = harness.Batches(problem, seed)
  compile_s, failed = harness.warm_up(contenders, problem.params, batches,
                                      warm_up_steps)
  contenders = [c for c in contenders if c.name not in failed]
  record = harness.race(contenders, problem.params, batches, steps, log_every,
                        load)
  rows = {}
  for c in contenders:
    losses, step_s = record[c.name]["loss"], record[c.name]["step_s"]
    finite = np.isfinite(losses)
    rows[c.name] = dict(
        family=c.family, settings=c.settings, steps=len(losses),
        final_loss=float(harness.trailing_mean(losses)[-1]),
        diverged=not finite.all(),
        first_nonfinite_step=None if finite.all() else int(np.argmin(finite)) + 1,
        mean_ms=1e3 * float(np.mean(step_s)), compile_s=compile_s[c.name],
        losses=losses, step_s=step_s)
    if c.family == "kfac_optax":
      rows[c.name]["stats"] = {
          k: dict(min=float(low), max=float(high))
          for k, (low, high) in jax.device_get(extremes[c.name]).items()}
  adams = {n: r["final_loss"] for n, r in rows.items()
           if r["family"] == "adam" and math.isfinite(r["final_loss"])}
  best_adam = min(adams, key=adams.get) if adams else None
  for row in rows.values():
    steps_to, seconds_to = (None, None) if best_adam is None else harness.first_reach(
        harness.trailing_mean(row["losses"]), row["step_s"], adams[best_adam])
    row.update(steps_to_adam=steps_to, seconds_to_adam=seconds_to,
               vs_adam=harness.ratio(row["final_loss"], adams.get(best_adam)))
  return dict(description=problem.description, batch_size=problem.batch_size,
              num_examples=problem.num_examples,
              num_params=sum(p.size for p in jax.tree.leaves(problem.params)),
              best_adam=best_adam, failed=failed, rows=rows)


def _median(values):
  """The median, a missing (None) or non-finite value counting as the
  worst; None where that worst is the median."""
  worst = [math.inf if v is None or not math.isfinite(v) else v for v in values]
  middle = statistics.median(worst)
  return None if not math.isfinite(middle) else float(middle)


def over_seeds(entries):
  """One model's results over seeds (``{seed: run_model's entry}``): each
  contender's medians and extremes, its runs kept under ``per_seed``."""
  first = next(iter(entries.values()))
  failed = {}
  for entry in entries.values():
    for name, error in entry["failed"].items():
      failed.setdefault(name, error)
  names = [n for n in first["rows"] if n not in failed]
  rows = {}
  for name in names:
    runs = {seed: entry["rows"][name] for seed, entry in entries.items()}
    diverged = {seed: r["first_nonfinite_step"] for seed, r in runs.items()
                if r["diverged"]}
    each = lambda key: [r[key] for r in runs.values()]
    finals, first_run = each("final_loss"), first["rows"][name]
    rows[name] = dict(
        family=first_run["family"], settings=first_run["settings"],
        steps=min(each("steps")),
        final_loss=_median(finals), final_losses=finals,
        diverged=bool(diverged), diverged_at=diverged,
        first_nonfinite_step=min(diverged.values()) if diverged else None,
        mean_ms=statistics.median(each("mean_ms")),
        compile_s=statistics.median(each("compile_s")),
        steps_to_adam=_median(each("steps_to_adam")),
        seconds_to_adam=_median(each("seconds_to_adam")),
        vs_adam=_median(each("vs_adam")))
    if "stats" in first_run:
      rows[name]["stats"] = {
          k: dict(min=min(r["stats"][k]["min"] for r in runs.values()),
                  max=max(r["stats"][k]["max"] for r in runs.values()))
          for k in TRACKED_STATS}
  adams = {n: r["final_loss"] for n, r in rows.items()
           if r["family"] == "adam" and r["final_loss"] is not None}
  return dict(
      {k: first[k] for k in ("description", "batch_size", "num_examples",
                             "num_params")},
      best_adam=min(adams, key=adams.get) if adams else None, failed=failed,
      rows=rows, per_seed=entries)


# --------------------------------------------------------------------------
# Report


def _range(extremes, spec=".3g"):
  low, high = extremes["min"], extremes["max"]
  if not (math.isfinite(low) and math.isfinite(high)):
    return "—"
  return format(low, spec) if low == high else f"{low:{spec}} … {high:{spec}}"


def _preamble(payload):
  """The run's command, machine, versions and steps, as Markdown items."""
  env, load, config = payload["environment"], payload["load_average"], payload["config"]
  return [
      f"- **Command:** `{payload['command']}` ({payload['date']}, "
      f"{payload['wall_s'] / 60:.1f} min)",
      f"- **Machine:** {env['cpu']}, {env['cores']} cores, {env['memory']}; "
      f"load average during the run {load['min']:.1f}-{load['max']:.1f} "
      f"(median {load['median']:.1f}); BLAS: {', '.join(env['blas'])}",
      "- **Versions:** " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
      f"- **Run:** {config['steps']} steps per contender and seed, seeds "
      f"{', '.join(map(str, config['seeds']))}; within a seed every "
      "contender of a model starts from the same params and sees the same "
      "batches and keys."]


def _first_cells(model, name, row, best_adam):
  """Model, contender, final loss and its range over the seeds, / best Adam,
  diverged, steps to Adam."""
  fmt = harness.fmt
  finals = [v for v in row["final_losses"] if math.isfinite(v)]
  spread = (f"{min(finals):.4g} … {max(finals):.4g}" if len(finals) > 1
            else "—")
  diverged = "; ".join(f"seed {seed}: {step}"
                       for seed, step in row["diverged_at"].items()) or "—"
  return [model, f"{name} (best)" if name == best_adam else name,
          fmt(row["final_loss"], ".4g"), spread, fmt(row["vs_adam"], ".3g"),
          diverged, fmt(row["steps_to_adam"], ".0f")]


def markdown(payload):
  """STABILITY.md: the command, the machine, the results and the stats tables."""
  config = payload["config"]
  fmt = harness.fmt
  lines = [
      "# Stability suite", "",
      "Written by `benchmarks/stability.py` (see its docstring for the protocol).",
      "", *_preamble(payload),
      "- **Configurations** (keywords of `kfac_optax.kfac`, others at their "
      "defaults): " + "; ".join(
          f"`{name}`: " + (", ".join(f"{k}={v}" for k, v in settings.items()) or "none")
          for name, settings in config["configs"].items())
      + f"; Adam: best of lr {', '.join(f'{lr:g}' for lr in config['adam_lrs'])} "
      "by final smoothed loss.",
      f"- **Columns:** final loss = mean of the last {harness.WINDOW} mini-batch "
      "training losses, the median over the seeds (a diverged run counts as "
      "the worst), then its range; / best Adam = the median of each seed's "
      "ratio to that seed's best Adam; diverged = the seed and first step "
      "with a non-finite loss (the contender stops there); steps / s to "
      "Adam = until the trailing mean first reaches the seed's best Adam's "
      "final loss (compilation excluded), median over the seeds (— where "
      "most did not reach it); mean ms/step, its median, includes K-FAC's "
      "inverse refreshes.",
      "",
      "| model | contender | final loss | over seeds | / best Adam | "
      "diverged at step | steps to Adam | s to Adam | mean ms/step |",
      "|---|---|---:|---|---:|---|---:|---:|---:|",
  ]
  for model, result in payload["models"].items():
    shown = [n for n, r in result["rows"].items() if r["family"] != "adam"]
    shown += [result["best_adam"]] if result["best_adam"] else []
    for name in shown:
      row = result["rows"][name]
      lines.append("| " + " | ".join(
          _first_cells(model, name, row, result["best_adam"])
          + [fmt(row["seconds_to_adam"]), fmt(row["mean_ms"])]) + " |")
    lines += [f"| {model} | {name} | failed: `{error}` | | | | | | |"
              for name, error in result["failed"].items()]
  lines += ["", "## kfac_optax.stats over the run (min … max)", "",
            "Contenders whose coefficients moved, over every seed's run; the "
            "learning rate is the step's `-α`, ρ the last measured reduction "
            "ratio.", "",
            "| model | contender | learning rate | momentum | damping | ρ |",
            "|---|---|---:|---:|---:|---:|"]
  for model, result in payload["models"].items():
    for name, row in result["rows"].items():
      stats = row.get("stats", {})
      if any(s["min"] < s["max"] for s in stats.values()):
        lines.append(f"| {model} | {name} | " + " | ".join(
            _range(stats[k]) for k in TRACKED_STATS) + " |")
  lines += ["", "## Models", ""]
  lines += [f"- **{model}:** {r['description']} {r['num_params']} params, "
            f"batch {r['batch_size']}. Adam finals (medians): " + ", ".join(
                f"{n.split('=')[1]}: {fmt(row['final_loss'], '.4g')}"
                for n, row in r["rows"].items() if row["family"] == "adam") + "."
            for model, r in payload["models"].items()]
  lines += ["", "Raw data (losses, step times, stats): "
            "`benchmarks/results/stability.json`."]
  return "\n".join(lines) + "\n"


def kfac_jax_markdown(payload):
  """STABILITY.md's section "Against kfac-jax's automatic mode"."""
  fmt = harness.fmt
  config, models = payload["config"], payload["models"]
  ran = {m: r for m, r in models.items() if KFAC_JAX in r["rows"]}
  lines = [
      "## Against kfac-jax's automatic mode", "",
      "Written by `benchmarks/stability.py` (protocol as above).", "",
      *_preamble(payload),
      "- **Contenders:** `kfac_auto`: `kfac_optax.kfac()` with nothing given; "
      f"`{KFAC_JAX}`: `kfac_jax.Optimizer(" + ", ".join(
          f"{k}={v}" for k, v in config["kfac_jax"].items())
      + ")` (its README's quick start, without the L2 term; other settings at "
      "its defaults; no burn-in); Adam: best of lr "
      f"{', '.join(f'{lr:g}' for lr in config['adam_lrs'])} by final smoothed "
      "loss.",
      f"- **Columns:** final loss = mean of the last {harness.WINDOW} "
      "mini-batch training losses at equal steps (the comparison), median "
      "over the seeds and range; diverged = seed and first step with a "
      "non-finite loss; steps to Adam = until the trailing mean first "
      "reaches the seed's best Adam's final loss (median); mean ms/step "
      "(inverse refreshes included, steps of all contenders interleaved, on "
      "a shared machine; median) and its ratio to `kfac_auto`'s.",
  ]
  if payload["kfac_jax_unavailable"]:
    lines.append(f"- **kfac-jax not run:** {payload['kfac_jax_unavailable']}")
  lines += ["", "| model | contender | final loss | over seeds | / best Adam | "
            "diverged at step | steps to Adam | mean ms/step | ms/step / kfac_auto |",
            "|---|---|---:|---|---:|---|---:|---:|---:|"]
  for model, result in ran.items():
    rows = result["rows"]
    base_ms = rows.get("kfac_auto", {}).get("mean_ms")
    for name in ("kfac_auto", KFAC_JAX, result["best_adam"]):
      if name in rows:
        ratio = harness.ratio(rows[name]["mean_ms"], base_ms)
        lines.append("| " + " | ".join(
            _first_cells(model, name, rows[name], result["best_adam"])
            + [fmt(rows[name]["mean_ms"]), fmt(ratio, ".2g")]) + " |")
  failed = {m: r["failed"][KFAC_JAX] for m, r in models.items()
            if KFAC_JAX in r["failed"]}
  if failed:
    lines += ["", "kfac-jax could not run (its error at the first step):", ""]
    lines += [f"- **{model}:** `{error}`" for model, error in failed.items()]
  lines += ["", "Raw data: `benchmarks/results/stability_kfac_jax.json`."]
  return "\n".join(lines)


# --------------------------------------------------------------------------
# Entry point


def _names(choices):
  """A comma-separated list of names out of ``choices``."""
  def parse(text):
    names = [n for n in text.split(",") if n]
    unknown = sorted(set(names) - set(choices))
    if unknown:
      raise argparse.ArgumentTypeError(
          f"unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    return names
  return parse


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help=f"smoke test: {QUICK_STEPS} steps, a few hundred "
                      f"examples, Adam at lr {QUICK_ADAM_LR:g} only")
  parser.add_argument("--models", type=_names(list(stability_problems.PROBLEMS)),
                      default=list(stability_problems.PROBLEMS),
                      help="comma-separated subset of the models")
  parser.add_argument("--configs", type=_names([*CONFIGS, KFAC_JAX, "adam"]),
                      default=[*CONFIGS, "adam"],
                      help="comma-separated subset of the contenders "
                      f"({', '.join(CONFIGS)}, adam; {KFAC_JAX} on request)")
  parser.add_argument("--steps", type=int, help=f"steps per contender "
                      f"(default {STEPS}, {QUICK_STEPS} with --quick)")
  parser.add_argument("--adam-lrs", type=lambda s: [float(v) for v in s.split(",")])
  parser.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")],
                      help=f"comma-separated seeds (default "
                      f"{','.join(map(str, SEEDS))}, 0 with --quick)")
  parser.add_argument("--log-every", type=int, default=50)
  parser.add_argument("--out-dir", help="where stability.json goes (default: "
                      "benchmarks/results for a full run, nowhere otherwise)")
  parser.add_argument("--markdown", help="the Markdown table's file (default: "
                      "benchmarks/STABILITY.md for a full run, none otherwise)")
  args = parser.parse_args(argv)
  args.steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
  args.seeds = args.seeds or ([0] if args.quick else list(SEEDS))
  if args.adam_lrs is None:
    args.adam_lrs = [QUICK_ADAM_LR] if args.quick else list(ADAM_LRS)
  if "adam" not in args.configs:
    args.adam_lrs = []
  args.comparison = set(args.configs) == set(COMPARISON)
  full = (not args.quick and len(args.models) == len(stability_problems.PROBLEMS)
          and (args.comparison or set(args.configs) == {*CONFIGS, "adam"}))
  if full:
    args.out_dir = args.out_dir or harness.RESULTS_DIR
    args.markdown = args.markdown or STABILITY_MD
  return args


def main(argv=None):
  """Runs the suite; returns the results (the JSON payload).

  Args:
    argv: command-line arguments (default ``sys.argv[1:]``).
  """
  started = time.perf_counter()
  args = parse_args(argv)
  command = " ".join(["python", "benchmarks/stability.py",
                      *(sys.argv[1:] if argv is None else argv)])
  configs = {name: CONFIGS[name] for name in args.configs if name in CONFIGS}
  kfac_jax, unavailable = None, None
  if KFAC_JAX in args.configs:
    kfac_jax, unavailable = harness.import_kfac_jax()
    if unavailable:
      print(f"NOTE: {KFAC_JAX} not run: {unavailable}", flush=True)
  load = harness.LoadSampler()
  results = {}
  with harness.single_threaded_lapack():
    env = harness.environment()
    for name in args.models:
      runs = {}
      for seed in args.seeds:
        problem = stability_problems.make_problem(name, quick=args.quick, seed=seed)
        print(f"{name}, seed {seed}: {problem.description}", flush=True)
        runs[seed] = run_model(problem, configs, args.adam_lrs, args.steps, seed,
                               0 if args.quick else args.log_every, load, kfac_jax)
      results[name] = over_seeds(runs)
  payload = dict(
      command=command, date=datetime.datetime.now(datetime.timezone.utc).strftime(
          "%Y-%m-%d %H:%M UTC"),
      environment=env, load_average=load.summary(),
      config=dict(steps=args.steps, seeds=args.seeds, quick=args.quick,
                  configs=configs, adam_lrs=args.adam_lrs, window=harness.WINDOW,
                  kfac_jax=KFAC_JAX_AUTO if KFAC_JAX in args.configs else None),
      kfac_jax_unavailable=unavailable, models=results,
      wall_s=time.perf_counter() - started)
  # The comparison with kfac-jax has its own results file and section.
  name, text = (("stability_kfac_jax", kfac_jax_markdown(payload))
                if args.comparison else ("stability", markdown(payload)))
  if args.out_dir:
    harness.write_json(os.path.join(args.out_dir, f"{name}.json"), payload)
  if args.markdown:
    harness.update_markdown(args.markdown, name, text, SCRIPT)
  print("\n" + text)
  print(f"done in {payload['wall_s']:.0f} s", flush=True)
  return payload


if __name__ == "__main__":
  main()
