"""K-FAC in a sharded job: its state's bytes per device, and what a step sends.

A decoder-only transformer (`examples.models.DecoderLM`: RMSNorm, rotary,
grouped-query attention, gated MLP; params with Flax's logical axis names,
placed by `examples.models.FSDP_TP_RULES`: FSDP over "data", tensor
parallelism over "model") on a ("data", "model") mesh, the batch split over
"data". For K-FAC (the README's recipe) and AdamW, each on meshes 1×1, 2×4
and 4×2 of 8 simulated CPU devices:

- bytes per device of the optimizer state and of the params, where a jitted
  ``init`` and a jitted step (no shardings given for the state) place them;
- collective bytes per device per step, read from the compiled step's HLO
  (`benchmarks.collectives`), averaged over the recipe's schedule: the
  statistics every 10 steps and the inverses every 50 (a step compiled with
  each part unconditional, then apart);
- the mean step time, and K-FAC's against its step with every leaf of the
  state replicated (as it was before the factors were spread), same mesh.

K-FAC runs twice: with whole factors (their stacks spread over the mesh,
gradients sent to their owners) and with ``factor_block_size`` tiles kept
with the params' shards (`curvature.tile_placement`).

Both run as a sharded job runs them: ``init`` and the step under
``jax.set_mesh``, no shardings given for the optimizer state.

``--large`` adds the same state and params bytes for a 1.34B-parameter
configuration (24 layers, width 2048, MLP 8192, vocabulary 32k, untied head)
on 64 and 256 devices, from the compiled ``init`` alone (abstract shapes,
nothing allocated), in a process of its own per device count.

From the repository root::

  python benchmarks/sharded_state.py --large   # full run, writes RESULTS.md
  python benchmarks/sharded_state.py --quick   # smoke test, no files
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "sharded_state"
# 1.34B parameters: 24 layers of width 2048, a gated MLP of 5464 (about the
# parameters of a plain MLP of 8192), a 32k vocabulary, an untied head.
LARGE = dict(vocab=32_000, width=2048, depth=24, heads=16, kv_heads=16, mlp=5464)
SMALL = dict(vocab=512, width=128, depth=2, heads=8, kv_heads=2, mlp=512)
MESHES = ((1, 1), (2, 4), (4, 2))
NEVER = 10**9  # a schedule period: at step 0, then never
# factor_block_size of the tiled contender: it divides every device's rows
# and columns of the small model's kernels on both meshes but the key and
# value projections' columns (32 over 4 or 2 devices).
TILE = 32
TILED = f"kfac_optax (recipe, tiles {TILE})"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: one layer, the 2 x 4 mesh, 2 timed steps, no files")
  parser.add_argument("--large", action="store_true",
                      help="also the 1.34B configuration on 64 and 256 devices")
  parser.add_argument("--steps", type=int, default=None, help="timed steps")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--sequence", type=int, default=64)
  parser.add_argument("--markdown", default=None)
  parser.add_argument("--large-devices", type=int, default=None,
                      help=argparse.SUPPRESS)  # the subprocess of --large
  parser.add_argument("--one-mesh", default=None,
                      help=argparse.SUPPRESS)  # the subprocess of one mesh
  args = parser.parse_args(argv)
  args.steps = args.steps or (2 if args.quick else 20)
  if args.markdown is None and not args.quick:
    args.markdown = os.path.join(REPO_ROOT, "benchmarks", "RESULTS.md")
  return args


def per_device_bytes(tree, shardings) -> int:
  """The largest per-device share of ``tree``'s arrays placed by ``shardings``."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  totals = {}
  for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shape = sharding.shard_shape(leaf.shape)
    for device in sharding.device_set:
      totals[device] = totals.get(device, 0) + int(np.prod(shape)) * leaf.dtype.itemsize
  return max(totals.values())


def setting_up(config, mesh_shape, batch_size, sequence):
  """(model, loss, sharded params, batch, mesh) for a mesh shape."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import kfac_optax  # pylint: disable=import-outside-toplevel
  from examples import models  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh(mesh_shape, ("data", "model"),
                       devices=jax.devices()[:mesh_shape[0] * mesh_shape[1]],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = models.DecoderLM(**config)
  ids = jnp.zeros((batch_size, sequence + 1), jnp.int32)
  abstract = jax.eval_shape(model.init, jax.random.key(0), ids[:, :-1])["params"]
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                          models.FSDP_TP_RULES)
  params = jax.jit(lambda key: model.init(key, ids[:, :-1])["params"],
                   out_shardings=shardings)(jax.random.key(0))
  # The rules in the boxes, as with_logical_partitioning(..., rules=) puts
  # them: under Auto axes they tell K-FAC each param's layout.
  params = jax.tree.map(
      lambda box: box.replace(rules=models.FSDP_TP_RULES), params,
      is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  tokens = jax.random.randint(jax.random.key(1), ids.shape, 0, config["vocab"])
  tokens = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.P("data")))
  batch = (tokens[:, :-1], tokens[:, 1:])
  return model, kfac_optax.losses.softmax_cross_entropy(), params, batch, mesh


def optimizers(model, loss, batch, **periods):
  import kfac_optax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  recipe = dict(learning_rate=1e-3, damping=1e-3, stats_update_period=10,
                inverse_update_period=50)
  apply_fn = getattr(model, "apply", model)  # linen's apply, or an NNX module
  return {"kfac_optax (recipe)": kfac_optax.kfac(
              apply_fn, loss, example_batch=batch, **{**recipe, **periods}),
          TILED: kfac_optax.kfac(apply_fn, loss, example_batch=batch,
                                 factor_block_size=TILE, **{**recipe, **periods}),
          "adamw": optax.adamw(1e-3)}


def step_fn(model, loss, tx):
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  def step(params, state, batch, key):
    grads = jax.grad(lambda p: loss.value(model.apply({"params": p}, batch[0]),
                                          batch))(params)
    updates, state = tx.update(grads, state, params, batch=batch, rng=key)
    return optax.apply_updates(params, updates), state
  return step


def collective_bytes(name, hlo_of, model, loss, batch):
  """Bytes per device per step, averaged over the recipe's schedule: the
  step compiled with no statistics or refresh, with statistics, with both.
  ``hlo_of(tx)``: the compiled step's text with optimizer ``tx``."""
  from benchmarks import collectives  # pylint: disable=import-outside-toplevel
  variants = {"plain": (NEVER, NEVER), "statistics": (1, NEVER), "both": (1, 1)}
  if name == "adamw":
    variants = {"plain": (NEVER, NEVER)}
  sent = {}
  for variant, (stats, inverses) in variants.items():
    tx = optimizers(model, loss, batch, stats_update_period=stats,
                    inverse_update_period=inverses)[name]
    sent[variant] = collectives.step_bytes(hlo_of(tx)).total()
  if name == "adamw":
    return {"per_step": sent["plain"], "plain": sent["plain"]}
  statistics = sent["statistics"] - sent["plain"]
  refresh = sent["both"] - sent["statistics"]
  return {"per_step": sent["plain"] + statistics / 10 + refresh / 50,
          "plain": sent["plain"], "statistics": statistics, "refresh": refresh}


def linen_step_hlo(model, loss, params, batch):
  """``tx -> `` the compiled text of `step_fn`'s step (linen, Auto axes)."""
  import jax  # pylint: disable=import-outside-toplevel

  def hlo_of(tx):
    state = jax.jit(tx.init)(params)
    return jax.jit(step_fn(model, loss, tx)).lower(
        params, state, batch, jax.random.key(0)).compile().as_text()
  return hlo_of


def explicit_axes_collectives(mesh_shape, args, config) -> dict:
  """`collective_bytes` of K-FAC and AdamW on the sharded example's NNX
  `Decoder` (`examples.sharded_transformer`, same sizes as `SMALL`):
  Explicit axes, each kernel placed by Flax's partitioning metadata, the
  activations by ``out_sharding=``; ``nnx.Optimizer``."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import kfac_optax  # pylint: disable=import-outside-toplevel
  from examples import sharded_transformer  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh(mesh_shape, ("data", "model"),
                       devices=jax.devices()[:mesh_shape[0] * mesh_shape[1]])
  loss = kfac_optax.losses.softmax_cross_entropy()
  with jax.set_mesh(mesh):
    model = sharded_transformer.Decoder(**config, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(1).integers(0, config["vocab"],
                                            (args.batch_size, args.sequence + 1))
    batch = jax.device_put((ids[:, :-1], ids[:, 1:]), jax.NamedSharding(mesh, jax.P("data")))

  def hlo_of(tx):
    with jax.set_mesh(mesh):
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      graphdef, state = nnx.split((model, optimizer))

      def step(state, batch, key):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: loss.value(m(batch[0]), batch))(model)
        optimizer.update(model, grads, batch=batch, rng=key)  # AdamW ignores both
        return nnx.state((model, optimizer))
      return jax.jit(step).lower(state, batch, jax.random.key(0)).compile().as_text()
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  return {"params_bytes": per_device_bytes(params, [x.sharding for x in params]),
          "collectives": {name: collective_bytes(name, hlo_of, model, loss, batch)
                          for name in ("kfac_optax (recipe)", TILED, "adamw")}}


def measure_mesh(mesh_shape, args, config):
  """The figures of both optimizers on one mesh, each run as a sharded job
  runs it: ``init`` and the step jitted under ``jax.set_mesh``."""
  import jax  # pylint: disable=import-outside-toplevel
  model, loss, params, batch, mesh = setting_up(config, mesh_shape,
                                                args.batch_size, args.sequence)
  replicated = jax.sharding.NamedSharding(mesh, jax.P())
  rows = {}
  for name, tx in optimizers(model, loss, batch).items():
    placements = {}
    if name != "adamw":  # the state as it was: every leaf on every device
      whole = jax.tree.map(lambda _: replicated, jax.eval_shape(tx.init, params))
      placements["replicated"] = (
          jax.jit(tx.init, out_shardings=whole)(params),
          jax.jit(step_fn(model, loss, tx), in_shardings=(None, whole, None, None),
                  out_shardings=(None, whole)))
    with jax.set_mesh(mesh):
      init = jax.jit(tx.init).lower(params).compile()
      state = init(params)
      step = jax.jit(step_fn(model, loss, tx))
      placements["as XLA places it"] = (state, step)
      times = {}
      for placement, (s, run) in placements.items():
        p = params
        for i in range(2):  # the state's placement may change once: compiled twice
          p, s = jax.block_until_ready(run(p, s, batch, jax.random.key(i)))
        start = time.perf_counter()
        for i in range(args.steps):  # one at a time: XLA:CPU's collectives of two
          # executions in flight at once deadlocked 8 simulated devices on 2 cores
          p, s = jax.block_until_ready(run(p, s, batch, jax.random.key(i + 1)))
        times[placement] = 1000 * (time.perf_counter() - start) / args.steps
      step_state = step.lower(params, state, batch, jax.random.key(0)).compile(
          ).output_shardings[1]
      rows[name] = {
          "state_bytes_after_init": per_device_bytes(state, init.output_shardings),
          "state_bytes_after_step": per_device_bytes(state, step_state),
          "params_bytes": per_device_bytes(params, jax.tree.map(
              lambda x: x.sharding, params)),
          "collectives": collective_bytes(name, linen_step_hlo(model, loss, params, batch),
                                          model, loss, batch),
          "step_ms": times}
  return rows


def measure_large(devices: int):
  """State and params bytes per device of the 1.34B configuration, from the
  compiled init alone (run in a process with ``devices`` CPU devices)."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import kfac_optax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from examples import models  # pylint: disable=import-outside-toplevel
  model_axis = 8
  mesh = jax.make_mesh((devices // model_axis, model_axis), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = models.DecoderLM(**LARGE)
  ids = jax.ShapeDtypeStruct((devices, 128), jnp.int32)
  abstract = jax.eval_shape(model.init, jax.random.key(0), ids)["params"]
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                          models.FSDP_TP_RULES)
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        nn.meta.unbox(abstract), nn.meta.unbox(shardings))
  batch = (ids, ids)
  result = {"devices": devices, "mesh": [devices // model_axis, model_axis],
            "params_bytes": per_device_bytes(params, jax.tree.map(
                lambda x: x.sharding, params)),
            "params_total": sum(x.size for x in jax.tree.leaves(params))}
  loss = kfac_optax.losses.softmax_cross_entropy()
  with jax.set_mesh(mesh):  # as the sharded job it stands for
    for name, tx in (("kfac_optax (recipe)", kfac_optax.kfac(
        model.apply, loss, example_batch=batch, learning_rate=1e-3, damping=1e-3,
        stats_update_period=10, inverse_update_period=50)),
                     ("adamw", optax.adamw(1e-3))):
      compiled = jax.jit(tx.init).lower(params).compile()
      state = jax.eval_shape(tx.init, params)
      step = jax.jit(step_fn(model, loss, tx)).lower(
          params, state, batch, jax.random.key(0)).compile()
      result[name] = {
          "after_init": per_device_bytes(state, compiled.output_shardings),
          "after_step": per_device_bytes(state, step.output_shardings[1])}
  return result


def run_large(devices: int) -> dict:
  """`measure_large` in a fresh process with ``devices`` CPU devices."""
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--large-devices", str(devices)],
      capture_output=True, text=True, check=True, cwd=REPO_ROOT)
  return json.loads(out.stdout.strip().splitlines()[-1])


def run_mesh(mesh_shape, args, tries: int = 3) -> tuple[dict, int]:
  """`measure_mesh` in a fresh process, and how many earlier tries died:
  XLA:CPU's collectives of 8 simulated devices on 2 cores deadlock now and
  then in the first run of a program (it aborts after 40 s; seen at the
  state-replicated step on 4 × 2 in about one run of three, before this
  module's code changed too)."""
  command = [sys.executable, os.path.abspath(__file__), "--one-mesh",
             "x".join(map(str, mesh_shape)), "--steps", str(args.steps),
             "--batch-size", str(args.batch_size), "--sequence", str(args.sequence),
             *(["--quick"] if args.quick else [])]
  for failed in range(tries):
    out = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if out.returncode == 0:
      return json.loads(out.stdout.strip().splitlines()[-1]), failed
  raise RuntimeError(f"{' '.join(command)} failed {tries} times:\n{out.stderr[-3000:]}")


def gigabytes(n) -> str:
  return f"{n / 1e9:.3f} GB"


def collectives_cell(sent) -> str:
  """Bytes per step (plain · statistics' part · refresh's part)."""
  if "statistics" not in sent:
    return f"{sent['per_step']:,.0f}"
  return (f"{sent['per_step']:,.0f} ({sent['plain']:,} · {sent['statistics']:,}"
          f" · {sent['refresh']:,})")


def markdown(payload) -> str:
  lines = ["## K-FAC in a sharded job: state bytes and collectives per device",
           "", f"`{payload['command']}` ({payload['date']}; CPU, 8 simulated "
           "devices; the model: " + ", ".join(
               f"{k} {v}" for k, v in payload.get("config", SMALL).items())
           + f", batch {payload['batch_size']} × {payload['sequence']} tokens).",
           "", "| mesh (data × model) | optimizer | state / device | params / "
           "device | state after a step | collective bytes / step (plain · "
           "statistics · refresh) | step ms (replicated state) |",
           "|---|---|---:|---:|---:|---|---|"]
  for mesh, rows in payload["meshes"].items():
    for name, row in rows.items():
      parts = collectives_cell(row["collectives"])
      ms = row["step_ms"]
      timing = f"{ms['as XLA places it']:.1f}" + (
          f" ({ms['replicated']:.1f})" if "replicated" in ms else "")
      lines.append(f"| {mesh} | {name} | {row['state_bytes_after_init']:,} | "
                   f"{row['params_bytes']:,} | {row['state_bytes_after_step']:,} | "
                   f"{parts} | {timing} |")
  if payload.get("explicit"):
    lines += ["", "Explicit axes: the same sizes as the sharded example's NNX "
              "`Decoder` (`examples/sharded_transformer.py`: kernels placed by "
              "`nnx.with_partitioning`, activations by `out_sharding=`, "
              "`nnx.Optimizer`). K-FAC reads each gradient's layout from its "
              "type and moves each gradient matrix to the device owning its "
              "slot and back by all-to-all (`linalg.owner_routing`), and forms "
              "each statistic there (`curvature/owner_statistics.py`); with "
              f"tiles ({TILED}) each device keeps and applies the tiles of its "
              "own shard and moves no gradient (`curvature/tile_placement.py`). "
              "Under Auto axes above the layouts come from the params' logical "
              "partitioning boxes, with the rules in them.", "",
              "| mesh (data × model) | optimizer | params / device | collective "
              "bytes / step (plain · statistics · refresh) | AdamW's + 3 × params "
              "/ device |", "|---|---|---:|---|---:|"]
    for mesh, found in payload["explicit"].items():
      bound = found["collectives"]["adamw"]["per_step"] + 3 * found["params_bytes"]
      for name, sent in found["collectives"].items():
        lines.append(f"| {mesh} | {name} | {found['params_bytes']:,} | "
                     f"{collectives_cell(sent)} | {bound:,} |")
  if payload.get("large"):
    lines += ["", "The 1.34B configuration (" + ", ".join(
        f"{k} {v}" for k, v in LARGE.items()) + "), float32, from the compiled "
              "`init` and step (nothing allocated; after a step: where XLA "
              "places the state the step returns):", "",
              "| devices (data × model) | params | params / device | K-FAC state / "
              "device, after init · after a step | AdamW state / device, after "
              "init · after a step |", "|---|---:|---:|---:|---:|"]
    for row in payload["large"]:
      kfac, adamw = row["kfac_optax (recipe)"], row["adamw"]
      lines.append(
          f"| {row['devices']} ({row['mesh'][0]} × {row['mesh'][1]}) | "
          f"{row['params_total'] / 1e9:.2f}B | {gigabytes(row['params_bytes'])} | "
          f"{gigabytes(kfac['after_init'])} · {gigabytes(kfac['after_step'])} | "
          f"{gigabytes(adamw['after_init'])} · {gigabytes(adamw['after_step'])} |")
  if payload.get("deadlocked"):
    lines += ["", "Runs of a mesh that XLA:CPU's collectives deadlocked (retried in "
              "a fresh process, `run_mesh`): " + ", ".join(
                  f"{mesh}: {n}" for mesh, n in payload["deadlocked"].items()) + "."]
  lines += ["", "Collective bytes: the per-device results of the compiled step's "
            "all-reduces, all-gathers, reduce-scatters, all-to-alls and "
            "collective-permutes (`benchmarks/collectives.py`); per step: the "
            "plain step, plus the statistics' part / 10 and the refresh's / 50."]
  return "\n".join(lines)


def main(argv=None):
  args = parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  devices = args.large_devices or 8
  try:  # CPU only; must precede any JAX work
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError:
    pass
  if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
  from examples import cpu_threads  # pylint: disable=import-outside-toplevel
  cpu_threads.single_threaded_lapack().__enter__()
  if args.large_devices:
    print(json.dumps(measure_large(args.large_devices)))
    return
  config = {**SMALL, "depth": 1} if args.quick else SMALL
  if args.one_mesh:
    print(json.dumps(measure_mesh(tuple(map(int, args.one_mesh.split("x"))), args,
                                  config)))
    return
  from benchmarks import harness  # pylint: disable=import-outside-toplevel
  meshes = MESHES[1:2] if args.quick else MESHES
  measured = {f"{d} × {m}": run_mesh((d, m), args) for d, m in meshes}
  payload = {"command": " ".join(["python benchmarks/sharded_state.py",
                                  *(sys.argv[1:] if argv is None else argv)]),
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "batch_size": args.batch_size, "sequence": args.sequence, "config": config,
             "meshes": {mesh: rows for mesh, (rows, _) in measured.items()},
             "deadlocked": {mesh: n for mesh, (_, n) in measured.items() if n}}
  payload["explicit"] = {f"{d} × {m}": explicit_axes_collectives((d, m), args, config)
                         for d, m in meshes if d * m > 1}
  if args.large:
    payload["large"] = [run_large(n) for n in (64, 256)]
  section = markdown(payload)
  if args.markdown:
    harness.write_json(os.path.join(harness.RESULTS_DIR, f"{NAME}.json"), payload)
    harness.update_markdown(args.markdown, NAME, section)
  print(section)


if __name__ == "__main__":
  main()
