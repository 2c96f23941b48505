"""K-FAC against AdamW on a decoder-only transformer sharded FSDP + tensor parallel.

The mesh is ``jax.make_mesh((devices // N, N), ("data", "model"))`` with
Explicit axes (``jax.make_mesh``'s default, sharding in types), N =
``--model-axis``. The model (`Decoder`, NNX) is written for it the way
Flax's own sharded examples are:

- every kernel declares its mesh axes with Flax's partitioning metadata
  (``nnx.with_partitioning``): its input axis over "data" (FSDP, ZeRO-3) and
  its output axis over "model" (Megatron's column-parallel layers), the
  row-parallel ones (attention output, MLP down projection) the other way;
  ``jax.set_mesh`` places each param as it is created;
- the activations name their shardings (``out_sharding=``): the batch over
  "data", the heads and the MLP's hidden units over "model".

Blocks: RMSNorm, grouped-query causal attention with rotary positions,
RMSNorm, gated (SwiGLU) MLP; token embedding, final RMSNorm, an untied
readout. K-FAC runs the model in its own passes under these same Explicit
axes; its factors and inverses are spread over all the devices (each owning
whole layers), its momentum sharded like the params. With
``--factor-block-size 16`` its factors are kept as diagonal tiles of 16,
each device holding the tiles of its own shard of each kernel: no gradient
moves between devices (docs/scaling.md, "Tiled factors").

The text is CPython's own help topics (``datasets.load_text``, as in
``transformer_lm.py``), bytes as tokens. K-FAC (the README's language-model
settings: learning rate and damping 1e-3, statistics every 10 steps,
inverses every 50) and AdamW take a step each in turn on the same windows
(``side_by_side.train``); the script prints both losses, the time per step,
and K-FAC's time to AdamW's final loss against AdamW's.

From the repository root, on one host (``--cpu-devices 8`` simulates 8
devices on a CPU)::

  python examples/sharded_transformer.py --cpu-devices 8 --model-axis 2
  python examples/sharded_transformer.py --cpu-devices 8 --model-axis 2 --quick

On several hosts, launched as ``data_parallel.py`` is (here two processes
on one machine, 4 simulated CPU devices each, one mesh over all 8; each
process feeds its own rows of every batch)::

  python examples/sharded_transformer.py --coordinator 127.0.0.1:12345 \\
      --num-processes 2 --process-id 0 --cpu-devices 4 --quick &
  python examples/sharded_transformer.py --coordinator 127.0.0.1:12345 \\
      --num-processes 2 --process-id 1 --cpu-devices 4 --quick
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import kfac_optax

try:
  from examples import data_parallel
  from examples import datasets
  from examples import models
  from examples import side_by_side
except ImportError:  # run as a script: examples/ itself is on sys.path
  import data_parallel
  import datasets
  import models
  import side_by_side

DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "output", "sharded_transformer.png")
QUICK_STEPS = 12

# The activations' shardings: (batch, position, features).
RESIDUAL = P("data", None, None)
SPLIT = P("data", None, "model")


def linear(inputs: int, outputs: int, axes: tuple, rngs: nnx.Rngs) -> nnx.Linear:
  """A bias-free linear layer whose kernel lives on the mesh ``axes``."""
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
  return nnx.Linear(inputs, outputs, use_bias=False, kernel_init=init, rngs=rngs)


def rms_norm(width: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(width, scale_init=nnx.with_partitioning(
      nnx.initializers.ones, (None,)), rngs=rngs)


class Block(nnx.Module):
  """Pre-norm decoder block: grouped-query attention with rotary positions
  and a gated MLP, each behind an RMSNorm, with residual connections."""

  def __init__(self, width: int, heads: int, kv_heads: int, mlp: int,
               rngs: nnx.Rngs):
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
    self.attention_norm, self.mlp_norm = rms_norm(width, rngs), rms_norm(width, rngs)
    self.query = linear(width, width, ("data", "model"), rngs)
    # Fewer key/value heads than devices on "model": they stay whole.
    self.key = linear(width, kv_heads * self.head_dim, ("data", None), rngs)
    self.value = linear(width, kv_heads * self.head_dim, ("data", None), rngs)
    self.out = linear(width, width, ("model", "data"), rngs)
    self.gate = linear(width, mlp, ("data", "model"), rngs)
    self.up = linear(width, mlp, ("data", "model"), rngs)
    self.down = linear(mlp, width, ("model", "data"), rngs)

  def _heads(self, x: jax.Array, count: int) -> jax.Array:
    return models.rotary(x.reshape(*x.shape[:2], count, self.head_dim))

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.attention_norm(x)
    q = self._heads(self.query(h, out_sharding=SPLIT), self.heads)
    k = self._heads(self.key(h, out_sharding=RESIDUAL), self.kv_heads)
    v = self.value(h, out_sharding=RESIDUAL).reshape(k.shape)
    # Each query head's key/value head, split over "model" like the queries.
    group = self.heads // self.kv_heads
    heads = P("data", None, "model", None)
    k = jax.sharding.reshard(jnp.repeat(k, group, axis=2), heads)
    v = jax.sharding.reshard(jnp.repeat(v, group, axis=2), heads)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim)
    positions = jnp.arange(x.shape[1])
    logits = jnp.where(positions[:, None] >= positions, logits, -1e9)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)
    x = x + self.out(attended.reshape(x.shape), out_sharding=RESIDUAL)
    h = self.mlp_norm(x)
    gated = nnx.silu(self.gate(h, out_sharding=SPLIT)) * self.up(h, out_sharding=SPLIT)
    return x + self.down(gated, out_sharding=RESIDUAL)


class Decoder(nnx.Module):
  """Decoder-only transformer LM of `Block`s: token embedding (vocabulary
  over "model", features over "data"), final RMSNorm, untied readout."""

  def __init__(self, vocab: int = 256, width: int = 64, depth: int = 2,
               heads: int = 4, kv_heads: int = 2, mlp: int = 128, *,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(0.02), ("model", "data")), rngs=rngs)
    self.blocks = nnx.List([Block(width, heads, kv_heads, mlp, rngs)
                            for _ in range(depth)])
    self.norm = rms_norm(width, rngs)
    self.readout = linear(width, vocab, ("data", "model"), rngs)

  def __call__(self, ids: jax.Array) -> jax.Array:
    x = self.embed(ids, out_sharding=RESIDUAL)
    for block in self.blocks:
      x = block(x)
    return self.readout(self.norm(x), out_sharding=SPLIT)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  data_parallel.add_process_flags(parser).add_argument(
      "--model-axis", type=int, default=2,
      help="devices on the mesh's 'model' axis (tensor parallel)")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--kfac-lr", type=float, default=1e-3)
  parser.add_argument("--adamw-lr", type=float, default=3e-3)
  parser.add_argument("--factor-block-size", type=int, default=None,
                      help="K-FAC's factors as diagonal tiles of this size, each "
                      "device keeping its own shards' (16 divides every "
                      "device's rows and columns on 4x2 and 2x4 meshes)")
  parser.add_argument("--plot", default=DEFAULT_PLOT)
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK_STEPS} steps, statistics and inverses "
                      "every 4 (a smoke test)")
  args = parser.parse_args(argv)
  data_parallel.check_process_flags(parser, args)
  if args.quick:
    args.steps = QUICK_STEPS
  return args


def main(argv=None):
  """Trains `Decoder` with K-FAC and with AdamW on the mesh; returns
  ``{"kfac": metrics, "adamw": metrics, "initial_loss": log(256)}``, each
  ``metrics`` with ``first_loss``, ``last_loss`` (mean over the last 10% of
  steps), ``ms_per_step`` (median, compilation excluded), K-FAC's also
  ``time_to_adamw_final_loss_vs_adamw``."""
  args = parse_args(argv)
  data_parallel.start_jax(args)
  mesh = jax.make_mesh((jax.device_count() // args.model_axis, args.model_axis),
                       ("data", "model"))
  text, description = datasets.load_text()
  ids = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
  order = side_by_side.batch_order(len(ids) - args.seq_len, args.batch_size,
                                   args.steps, args.seed)
  batch_sharding = NamedSharding(mesh, P("data"))
  rows = data_parallel.local_rows(batch_sharding, args.batch_size)
  batch_at = lambda i: data_parallel.global_batch(
      batch_sharding, datasets.windows(ids, order[i], args.seq_len), rows)
  print(f"{description}: {len(ids)} bytes; mesh {dict(mesh.shape)}, Explicit "
        f"axes; {args.steps} steps of {args.batch_size} windows of {args.seq_len}")

  periods = 4 if args.quick else None
  with jax.set_mesh(mesh):
    model = Decoder(rngs=nnx.Rngs(args.seed))
    loss = kfac_optax.losses.softmax_cross_entropy()
    trainer = side_by_side.nnx_trainer(model, loss)
    optimizers = {
        "K-FAC": kfac_optax.kfac(
            model, loss, example_batch=batch_at(0), learning_rate=args.kfac_lr,
            damping=1e-3, momentum=0.9, stats_update_period=periods or 10,
            inverse_update_period=periods or 50,
            factor_block_size=args.factor_block_size),
        "AdamW": optax.adamw(args.adamw_lr),
    }
    trained = side_by_side.train(
        {name: trainer.start(tx) for name, tx in optimizers.items()},
        trainer.step, batch_at, args.steps, args.seed)

  results, curves = {}, {}
  print(f"\n{'':>6} {'first loss':>10} {'last loss':>9} {'ms/step':>7}")
  for name, (_, losses, seconds) in trained.items():
    curves[name] = (losses, seconds)
    tail = max(1, len(losses) // 10)
    metrics = {"first_loss": float(losses[0]),
               "last_loss": float(np.mean(losses[-tail:])),
               "ms_per_step": 1e3 * float(np.median(seconds[1:]))}
    results[name.lower().replace("-", "")] = metrics
    print(f"{name:>6} {metrics['first_loss']:10.4f} {metrics['last_loss']:9.4f} "
          f"{metrics['ms_per_step']:7.1f}")
  results["kfac"]["time_to_adamw_final_loss_vs_adamw"] = (
      side_by_side.report_time_to_reference_loss(curves, "AdamW", ["K-FAC"])["K-FAC"])
  if jax.process_index() == 0:
    side_by_side.save_plot(args.plot, curves, "Sharded decoder LM (FSDP + "
                           f"tensor parallel, mesh {dict(mesh.shape)})")
  results["initial_loss"] = float(np.log(256))
  return results


if __name__ == "__main__":
  data_parallel.run_as_script(main)
