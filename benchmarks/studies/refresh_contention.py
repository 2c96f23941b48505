"""The inverse refresh on a busy CPU: eigh, Cholesky and Newton-Schulz.

jaxlib's CPU eigh calls LAPACK in SciPy's OpenBLAS, whose threads contend
with XLA's own (and spin for ~0.1 s after each call); ``inverse="cholesky"``
hands LAPACK only blocks small enough to stay on the calling thread
(`kfac_optax.cholesky`), ``inverse="newton_schulz"`` uses matrix products
only (XLA's threads). In
the default environment (no thread settings), the first two measurements
on a quiet machine and with one extra busy process (``python -c "while
True: pass"``, started and stopped here):

1. One damped inverse of an ``n × n`` factor (n = 128 .. 2048), jitted,
   median of repeats: eigh, cholesky, Newton-Schulz from the scaled
   identity (``cold``, a first refresh) and from the inverse of a nearby
   factor (``warm``: the old factor times 1.01 plus a symmetric rank-4
   perturbation of spectral norm 0.2 times the damping, so the start's
   residual has Frobenius norm below 1, as the example's factors have
   between refreshes: 3 below). The factor is a Gram matrix of ``2n`` rows with a decaying
   spectrum (eigenvalues spread over ~1e2 before damping 1e-2 times the
   mean eigenvalue, as the example's factors: their damped condition
   numbers are 4 to 120).
2. The README's main example (`examples/mlp_classifier.py`: MLP
   784-256-128-10, batch 256, K-FAC at the example's settings, the README's
   recipe: lr 1e-3, damping 1e-3, momentum 0.9, statistics every 10 steps,
   inverses every 50; Adam 3e-3): K-FAC with each inverse method, K-FAC as
   the example runs it (``inverse="auto"``, ``factor_rank=32``) and Adam,
   each contender's steps alone and back to back (`harness.race` of one),
   contenders in turn, as the example runs them: interleaved, the threads
   that one contender's LAPACK calls leave spinning would slow the others'
   steps. Mean ms per step (refreshes included).
3. Newton-Schulz iterations on the README example's own factors: K-FAC
   (Cholesky) trains it for ``--iteration-steps`` steps; at every 50th step
   each damped factor is inverted from the scaled identity and from the
   previous refresh's inverse (at the example's period, 50 steps before).

Writes ``benchmarks/results/refresh_contention.json`` and a RESULTS.md section.

From the repository root::

  python benchmarks/studies/refresh_contention.py            # ~12 min on 2 CPU cores
  python benchmarks/studies/refresh_contention.py --quick    # smoke test, writes nothing
"""

import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))  # the repository root
from benchmarks import harness  # pylint: disable=wrong-import-position
from examples import datasets  # pylint: disable=wrong-import-position
from examples import models  # pylint: disable=wrong-import-position
import kfac_optax  # pylint: disable=wrong-import-position,wrong-import-order
from kfac_optax._src import linalg  # pylint: disable=wrong-import-position
from kfac_optax._src.linalg import damped  # pylint: disable=wrong-import-position
from kfac_optax._src.linalg import newton_schulz  # pylint: disable=wrong-import-position

SIZES = (128, 256, 512, 1024, 2048)
METHODS = ("eigh", "cholesky", "newton_schulz cold", "newton_schulz warm")
KFAC_INVERSES = ("eigh", "cholesky", "newton_schulz")
# The main example's settings (the defaults of examples/mlp_classifier.py's
# flags: the README's recipe, factor_rank 32, Adam at 3e-3).
EXAMPLE_KFAC = dict(learning_rate=1e-3, momentum=0.9, damping=1e-3,
                    stats_update_period=10, inverse_update_period=50)
EXAMPLE_FACTOR_RANK = 32
EXAMPLE_ADAM_LR = 3e-3


@contextlib.contextmanager
def conditions(busy: bool):
  """Runs the block with one extra busy process when ``busy``."""
  if not busy:
    yield
    return
  spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    time.sleep(1.0)
    yield
  finally:
    spinner.kill()
    spinner.wait()


def factors(n: int):
  """``(previous factor, a nearby factor, damping)``."""
  keys = jax.random.split(jax.random.key(n), 2)
  rows = jnp.logspace(0, -1, n)[:, None] * jax.random.normal(keys[0], (n, 2 * n))
  old = rows @ rows.T / (2 * n)  # eigenvalues spread over ~1e2
  damping = 1e-2 * jnp.trace(old) / n
  low_rank = jax.random.normal(keys[1], (n, 4))
  noise = low_rank @ jnp.diag(jnp.array([1.0, -1.0, 0.5, -0.5])) @ low_rank.T
  return old, 1.01 * old + 0.2 * damping * noise / jnp.linalg.norm(noise, 2), damping


def time_inverses(sizes, repeats):
  """``{method: {n: seconds}}`` and Newton-Schulz's iterations per size."""
  seconds, iterations = {m: {} for m in METHODS}, {}
  for n in sizes:
    old, new, damping = factors(n)
    previous = damped.damped_inverse(old, damping, "cholesky")
    newton = jax.jit(newton_schulz.newton_schulz_inverse)
    calls = {
        "eigh": jax.jit(lambda m, d: damped.damped_inverse(m, d, "eigh")),
        "cholesky": jax.jit(lambda m, d: damped.damped_inverse(m, d, "cholesky")),
        "newton_schulz cold": lambda m, d: newton(m, d).inverse,
        "newton_schulz warm": lambda m, d: newton(m, d, previous).inverse}
    iterations[n] = {start: int(newton(new, damping, *args).iterations)
                     for start, args in (("cold", ()), ("warm", (previous,)))}
    for method, call in calls.items():
      jax.block_until_ready(call(new, damping))  # compile
      runs = []
      for _ in range(repeats if n <= 1024 else 1):
        start = time.perf_counter()
        jax.block_until_ready(call(new, damping))
        runs.append(time.perf_counter() - start)
      seconds[method][n] = float(np.median(runs))
    print(f"  n={n:5d} " + "  ".join(f"{m} {1e3 * seconds[m][n]:8.1f} ms"
                                     for m in METHODS), flush=True)
  return seconds, iterations


def mlp_example(quick: bool):
  """The README example's workload, K-FAC contenders (one per inverse) and Adam."""
  x, y, _, _, description = datasets.load_classification()
  if quick:
    x, y = x[:1024], y[:1024]
  model, loss = models.MLP(num_classes=10), kfac_optax.losses.softmax_cross_entropy()
  workload = harness.Workload(
      name="mlp_classifier", title="README main example", description=description,
      model=model, loss=loss, inputs=lambda batch: batch[0],
      register_kfac_jax_loss=None, data=(x, y), batch_size=256)
  step = harness.train_step(workload)
  racers = [harness.kfac_optax_contender(
      f"K-FAC {inverse}", {**EXAMPLE_KFAC, "inverse": inverse}, workload, step)
            for inverse in KFAC_INVERSES]
  racers.append(harness.kfac_optax_contender(  # the example's own K-FAC
      f"K-FAC auto, rank {EXAMPLE_FACTOR_RANK}",
      {**EXAMPLE_KFAC, "factor_rank": EXAMPLE_FACTOR_RANK}, workload, step))
  racers.append(harness.optax_contender(
      "Adam", "adam", optax.adam(EXAMPLE_ADAM_LR),
      dict(learning_rate=EXAMPLE_ADAM_LR), workload, step))
  return workload, racers


def example_iterations(steps: int, every: int = 50):
  """``{factor: [(cold, warm) iterations at every ``every``-th step]}``."""
  workload, racers = mlp_example(quick=False)
  kfac = next(r for r in racers if r.name == "K-FAC cholesky")
  params, _ = harness.initial_variables(workload, 0)
  batches, state = harness.Batches(workload, 0), kfac.start(params)
  counts, previous = {}, None
  for i in range(steps):
    state, _ = kfac.step(state, *batches(i), i)
    curvature = state.opt_state.curvature
    if i % every == 0 and i:
      for key, factors in curvature.factors.items():
        a_damping, g_damping = linalg.pi_adjusted_damping(
            linalg.mean_eigenvalue(factors.a[0]), linalg.mean_eigenvalue(factors.g[0]),
            curvature.damping)
        for name, damping in (("a", a_damping), ("g", g_damping)):
          matrix, old = getattr(factors, name)[0], getattr(previous[key], name)[0]
          counts.setdefault(f"{key} {name} {matrix.shape[0]}", []).append(tuple(
              int(newton_schulz.newton_schulz_inverse(matrix, damping, *start).iterations)
              for start in ((), (old,))))
    if i % 5 == 0:  # the inverses in use after this step (the state is donated)
      previous = jax.tree.map(jnp.copy, curvature.inverses)
  return counts


def example_race(quick: bool, steps: int):
  """``busy -> ({contender: step times}, load)``: each contender's steps
  alone, contenders in turn, compiled once."""
  workload, racers = mlp_example(quick)
  params, _ = harness.initial_variables(workload, 0)
  batches = harness.Batches(workload, 0)
  _, failed = harness.warm_up(racers, params, batches, harness.WARMUP_STEPS)
  if failed:
    raise RuntimeError(f"contenders failed: {failed}")

  def run(busy: bool):
    with conditions(busy):
      load = harness.LoadSampler()
      alone = {racer.name: harness.race([racer], params, batches, steps, load=load)
               [racer.name]["step_s"] for racer in racers}
    return alone, load.summary()
  return run


def markdown(payload) -> str:
  inv, ex = payload["inverse"], payload["example"]
  lines = [
      "## The inverse refresh on a busy CPU", "",
      f"- **Command:** `{payload['command']}` ({payload['date']}, "
      f"{payload['wall_s'] / 60:.1f} min); method: see the docstring of "
      "`benchmarks/studies/refresh_contention.py`.",
      f"- **Machine:** {payload['environment']['cpu']}, "
      f"{payload['environment']['cores']} cores, default environment "
      f"(BLAS: {', '.join(payload['environment']['blas'])}); the machine is "
      "shared, so \"quiet\" means no extra process of ours (load averages below).",
      "", f"One damped inverse, median ms over {payload['rounds']} rounds "
      "(quiet / one busy process):", "",
      "| n | " + " | ".join(METHODS) + " | Newton-Schulz iterations cold / warm |",
      "|---:|" + "---:|" * (len(METHODS) + 1)]
  for n in payload["sizes"]:
    cells = [f"{harness.fmt(1e3 * inv['quiet'][m].get(n, float('nan')))} / "
             f"{harness.fmt(1e3 * inv['busy'][m].get(n, float('nan')))}"
             for m in METHODS]
    its = inv["iterations"][n]
    lines.append(f"| {n} | " + " | ".join(cells)
                 + f" | {its['cold']} / {its['warm']} |")
  lines += ["", f"README main example ({payload['example_steps']} steps per "
            "contender and phase, each alone; mean ms/step including refreshes, "
            f"median over {payload['rounds']} rounds):", "",
            "| contender | quiet | busy | busy / quiet | quiet / Adam | busy / Adam |",
            "|---|---:|---:|---:|---:|---:|"]
  for name in ex["quiet"]:
    quiet, busy = ex["quiet"][name]["mean_ms"], ex["busy"][name]["mean_ms"]
    lines.append(
        f"| {name} | {quiet:.1f} | {busy:.1f} | {busy / quiet:.2f} | "
        f"{quiet / ex['quiet']['Adam']['mean_ms']:.2f} | "
        f"{busy / ex['busy']['Adam']['mean_ms']:.2f} |")
  lines += ["", "Newton-Schulz iterations (from the scaled identity / from the "
            "previous refresh, 50 steps before) on the example's own damped factors, at "
            "steps " + ", ".join(str(50 * (i + 1)) for i in range(
                len(next(iter(payload["iterations"].values()))))) + ":", "",
            "| factor (layer, side, size) | cold | warm |", "|---|---|---|"]
  for factor, counts in payload["iterations"].items():
    lines.append(f"| {factor} | {', '.join(str(c) for c, _ in counts)} | "
                 f"{', '.join(str(w) for _, w in counts)} |")
  loads = payload["load_average"]
  lines += ["", "Load average (1 min) during the example runs: quiet "
            f"{loads['quiet']['min']:.1f}-{loads['quiet']['max']:.1f}, busy "
            f"{loads['busy']['min']:.1f}-{loads['busy']['max']:.1f}. Raw data: "
            "`benchmarks/results/refresh_contention.json`."]
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--steps", type=int, default=300,
                      help="timed steps of each contender of the example")
  parser.add_argument("--iteration-steps", type=int, default=151)
  parser.add_argument("--rounds", type=int, default=2,
                      help="quiet and busy phases, alternated, medians over them")
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  if args.quick:
    args.sizes, args.repeats, args.steps, args.iteration_steps = [64], 1, 6, 51
    args.rounds = 1
  started = time.perf_counter()
  payload = dict(
      command=" ".join(["python benchmarks/studies/refresh_contention.py",
                        *(sys.argv[1:] if argv is None else argv)]),
      date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
      environment=harness.environment(), sizes=args.sizes,
      example_steps=args.steps, rounds=args.rounds, inverse={}, example={},
      load_average={})
  race = example_race(args.quick, args.steps)
  inverse_runs, example_runs, loads = {}, {}, {}
  for round_ in range(args.rounds):  # quiet, busy, busy, quiet, ...: drifts cancel
    for label, busy in (("quiet", False), ("busy", True))[::1 - 2 * (round_ % 2)]:
      print(f"round {round_ + 1}, {label}: one damped inverse", flush=True)
      with conditions(busy):
        seconds, payload["inverse"]["iterations"] = time_inverses(
            args.sizes, args.repeats)
      inverse_runs.setdefault(label, []).append(seconds)
      print(f"round {round_ + 1}, {label}: README main example", flush=True)
      step_s, load = race(busy)
      example_runs.setdefault(label, []).append(step_s)
      loads.setdefault(label, []).append(load)
  for label in ("quiet", "busy"):  # medians over the rounds
    payload["inverse"][label] = {
        m: {n: float(np.median([run[m][n] for run in inverse_runs[label]]))
            for n in args.sizes} for m in METHODS}
    payload["example"][label] = {name: dict(
        mean_ms=float(np.median([1e3 * np.mean(r[name]) for r in example_runs[label]])),
        rounds_mean_ms=[1e3 * float(np.mean(r[name])) for r in example_runs[label]])
                                 for name in example_runs[label][0]}
    payload["load_average"][label] = dict(
        min=min(l["min"] for l in loads[label]), max=max(l["max"] for l in loads[label]))
  print("Newton-Schulz iterations on the example's factors", flush=True)
  payload["iterations"] = example_iterations(args.iteration_steps)
  payload["wall_s"] = time.perf_counter() - started
  harness.publish("refresh_contention", payload, markdown(payload),
                  "benchmarks/studies/refresh_contention.py", write=not args.quick)
  return payload


if __name__ == "__main__":
  main()
