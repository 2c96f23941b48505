"""Scale benchmark: the inverse refresh and the training step, 1 vs N devices.

The question: what splitting the inverse refresh over the devices of a
data-parallel mesh costs and gains. A 784-512-512-512-512-10 tanh MLP on
Fashion-MNIST (ten Kronecker factors: eight of size 512/513 share one
bucket, plus 785 and 10) at global batch 512.

- Inverse refresh: `linalg.invert_all` over the model's damped factors,
  unsharded on one device against the stacks split over all N devices
  (`sharding.stack_sharding`), the exact code path of a refresh.
- Training step: gradient + `kfac` update + apply (inverses every 5 steps,
  so the mean includes refreshes), one device against the batch sharded
  ``P("data")`` over N devices, at equal global batch.

Repeats are interleaved (unsharded, sharded, unsharded, ...); medians of the
per-call times are quoted. On CPU the N devices are simulated
(``jax_num_cpu_devices``) and share the machine's cores, so sharding cannot
make anything faster there: the figures show its overhead, and the compiled
HLO (each device factorises 1/N of every stack: `tests/scaling/test_distributed_inverses.py`,
recorded here too) stands in for the speed-up that real devices give.

From the repository root::

  python benchmarks/studies/distributed.py           # full run, writes RESULTS.md
  python benchmarks/studies/distributed.py --quick   # smoke test
"""

import argparse
import math
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: a narrow model, 3 repeats, no files")
  parser.add_argument("--cpu-devices", type=int, default=8,
                      help="simulated devices when the backend is CPU")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--width", type=int, default=None)
  parser.add_argument("--batch-size", type=int, default=512)
  parser.add_argument("--inverse", default="eigh", choices=["eigh", "cholesky"])
  parser.add_argument("--markdown", default=None,
                      help="RESULTS.md to update (full mode default: benchmarks/RESULTS.md)")
  args = parser.parse_args(argv)
  args.repeats = args.repeats or (3 if args.quick else 20)
  args.width = args.width or (32 if args.quick else 512)
  if args.markdown is None and not args.quick:
    args.markdown = os.path.join(REPO_ROOT, "benchmarks", "RESULTS.md")
  return args


def main(argv=None):
  args = parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  try:  # CPU only (other backends ignore it); must precede any JAX work
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  except RuntimeError:  # JAX already started (e.g. under pytest): keep its devices
    pass
  return run(args, argv)


def run(args, argv):
  """The measurements (JAX is configured by now)."""
  # pylint: disable=import-outside-toplevel
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  import kfac_optax
  from kfac_optax._src import linalg
  from kfac_optax._src.linalg import stacked_inverses
  if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
  from benchmarks import harness
  from examples import datasets
  from examples.cpu_threads import single_threaded_lapack

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(4):
        x = jnp.tanh(nn.Dense(args.width)(x))
      return nn.Dense(10)(x)

  x, y, _, _, description = datasets.load_classification("auto")
  x, y = np.asarray(x[:args.batch_size], np.float32), np.asarray(y[:args.batch_size])
  batch = (x, y)
  model, loss = MLP(), kfac_optax.losses.softmax_cross_entropy()
  params = model.init(jax.random.key(0), x)["params"]
  mesh = jax.make_mesh((len(jax.devices()),), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  curvature = kfac_optax.Curvature(model.apply, loss, batch, inverse=args.inverse)
  factors = jax.jit(lambda s: curvature.update(
      s, params, batch=batch, rng=jax.random.key(1), damping=1e-3))(
          curvature.init(params)).factors
  plan = curvature._example_plan(params)  # pylint: disable=protected-access
  damped = {key: block.damped(factors[key], jnp.float32(1e-3))
            for key, block in plan.all_blocks().items()}
  sizes = sorted(leaf.matrix.shape[-1] for leaf in jax.tree.leaves(
      damped, is_leaf=lambda v: isinstance(v, linalg.Damped))
                 if isinstance(leaf, linalg.Damped)
                 for _ in range(math.prod(leaf.matrix.shape[:-2])))

  def refresh(stacks):
    return jax.jit(lambda d: linalg.invert_all(d, args.inverse, stacks))
  refreshes = {"1 device": refresh(None),
               f"{mesh.size} devices": refresh(linalg.stack_sharding(mesh))}
  buckets = stacked_inverses.bucket_sizes(sizes)
  per_bucket = {b: sum(buckets[n] == b for n in sizes) for b in set(buckets.values())}
  per_device = {b: f"{-(-n // mesh.size)} of {n}" for b, n in sorted(per_bucket.items())}

  tx = kfac_optax.kfac(model.apply, loss, example_batch=batch, learning_rate=0.01,
                       momentum=0.9, damping=1e-3, inverse=args.inverse)

  def step(state, batch, rng):
    grads = jax.grad(lambda p: loss.value(model.apply({"params": p}, batch[0]), batch))(
        state.params)
    return state.apply_gradients(grads=grads, batch=batch, rng=rng)
  state = kfac_optax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  replicated = NamedSharding(mesh, P())
  state_sharding = kfac_optax.sharding.state_shardings(state, mesh)
  steps = {
      "1 device": (jax.jit(step), lambda: (state, batch)),
      f"{mesh.size} devices": (
          jax.jit(step, in_shardings=(state_sharding, NamedSharding(mesh, P("data")),
                                      replicated),
                  out_shardings=state_sharding),
          lambda: (jax.device_put(state, state_sharding),
                   jax.device_put(batch, NamedSharding(mesh, P("data"))))),
  }

  def timed(fn, *fn_args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*fn_args))
    return time.perf_counter() - start

  with single_threaded_lapack():
    for fn in refreshes.values():
      timed(fn, damped)  # compile
    refresh_ms = {name: [] for name in refreshes}
    for _ in range(args.repeats):
      for name, fn in refreshes.items():
        refresh_ms[name].append(1e3 * timed(fn, damped))
    placed = {name: make() for name, (_, make) in steps.items()}
    step_ms = {name: [] for name in steps}
    for i in range(10 + args.repeats):  # the first ten: compile + warm-up
      for name, (fn, _) in steps.items():
        current, data = placed[name]
        start = time.perf_counter()
        current = jax.block_until_ready(fn(current, data, jax.random.key(i)))
        placed[name] = (current, data)
        if i >= 10:
          step_ms[name].append(1e3 * (time.perf_counter() - start))
    environment = harness.environment()

  summary = {
      "refresh_median_ms": {k: float(np.median(v)) for k, v in refresh_ms.items()},
      "step_median_ms": {k: float(np.median(v)) for k, v in step_ms.items()},
      "step_mean_ms": {k: float(np.mean(v)) for k, v in step_ms.items()},
  }
  command = " ".join(["python benchmarks/studies/distributed.py",
                      *(sys.argv[1:] if argv is None else argv)])
  payload = dict(command=command, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 environment=environment, dataset=description, width=args.width,
                 batch_size=args.batch_size, factor_sizes=sizes,
                 buckets=buckets, per_device=per_device, repeats=args.repeats,
                 refresh_ms=refresh_ms, step_ms=step_ms, summary=summary)
  print(f"factor sizes {sizes} -> buckets {buckets}; each device "
        f"factorises, per bucket: {per_device}")
  for what in ("refresh_median_ms", "step_median_ms", "step_mean_ms"):
    print(what, {k: round(v, 2) for k, v in summary[what].items()})
  if args.markdown:
    harness.write_json(os.path.join(REPO_ROOT, "benchmarks", "results",
                                    "distributed.json"), payload)
    harness.update_markdown(args.markdown, "distributed", markdown(payload),
                            "benchmarks/studies/distributed.py")
  return payload


def markdown(payload):
  """The RESULTS.md section."""
  env, summary = payload["environment"], payload["summary"]
  names = list(summary["refresh_median_ms"])
  one, many = names
  lines = [
      "## Scale: inverse refresh and step time, 1 vs N devices", "",
      f"`{payload['command']}` on {payload['date']}: {env['cpu']}, "
      f"{env['cores']} cores, devices {len(env['devices'])} "
      f"({env['devices'][0]}, ...), jax {env['versions']['jax']}.", "",
      f"Model: 784-{payload['width']}x4-10 tanh MLP, {payload['dataset']}, "
      f"global batch {payload['batch_size']}. Factor sizes "
      f"{payload['factor_sizes']}; buckets (size -> padded size) "
      f"{payload['buckets']}. Sharded, each device factorises (bucket: "
      f"its share) {payload['per_device']}; the HLO test "
      "`tests/scaling/test_distributed_inverses.py` checks such shares in the compiled "
      "program.", "",
      f"| | {one} | {many} | ratio |", "|---|---:|---:|---:|"]
  for label, key in (("inverse refresh, median ms", "refresh_median_ms"),
                     ("training step, median ms", "step_median_ms"),
                     ("training step, mean ms (refreshes included)", "step_mean_ms")):
    a, b = summary[key][one], summary[key][many]
    lines.append(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
  lines += ["", f"Medians over {payload['repeats']} interleaved repeats. On CPU "
            "the devices are simulated on the same cores, so the sharded run "
            "pays the partitioning and all-gather overhead without gaining "
            "compute; on N real devices each factorises 1/N of every stack."]
  return "\n".join(lines)


if __name__ == "__main__":
  main()
