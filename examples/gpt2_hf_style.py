"""K-FAC and Adam on a small GPT-2 written the way Hugging Face writes it.

Hugging Face's Flax GPT-2 (``transformers``' ``FlaxGPT2LMHeadModel``) is not
built from stock flax layers alone; this script writes its structure
(module names, param layouts) anew, so that no download and no
``transformers`` install is needed:

- every projection (``c_attn``, ``c_proj``, ``c_fc``) is a ``FlaxConv1D``
  (``models.FlaxConv1D``, shared with the tests): a Dense layer whose kernel
  is stored ``(out, in)`` and applied as ``x @ kernel.T + bias``. One line
  tells K-FAC so::

    kfac_optax.register_layer(FlaxConv1D, "dense", kernel_layout="out_in")

- the LM head is tied to the token embedding ``wte`` by running an
  ``nn.Dense`` with the table's transpose as its kernel:
  ``self.lm_head.apply({"params": {"kernel": wte.T}}, h)``. One argument
  folds its statistics into the embedding's block:
  ``tied_embeddings={"lm_head": "transformer/wte"}``.

The text is CPython's pydoc help topics (``datasets.load_text``): a
character-level model, every position a loss term. Both optimizers start
from the same parameters and see the same windows, side by side (a step of
each in turn). The script prints the K-FAC blocks found, the loss every few
steps, and the final losses.
``--compare-fallback`` adds K-FAC with the projections on the diagonal
block, which is what they get without ``register_layer``.

From the repository root::

  python examples/gpt2_hf_style.py            # full run (minutes on 2 CPU cores)
  python examples/gpt2_hf_style.py --quick    # smoke test (seconds)
"""

import argparse
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_optax

try:
  from examples import cpu_threads
  from examples import datasets
  from examples import side_by_side
  from examples.models import FlaxConv1D
except ImportError:  # run as a script: examples/ itself is on sys.path
  import cpu_threads
  import datasets
  import side_by_side
  from models import FlaxConv1D


class Config:
  """The few GPT-2 settings used here (``transformers.GPT2Config``'s names)."""

  def __init__(self, vocab_size, n_positions, n_embd, n_layer, n_head):
    self.vocab_size, self.n_positions = vocab_size, n_positions
    self.n_embd, self.n_layer, self.n_head = n_embd, n_layer, n_head


class FlaxGPT2Attention(nn.Module):
  config: Config

  def setup(self):
    self.c_attn = FlaxConv1D(3 * self.config.n_embd)
    self.c_proj = FlaxConv1D(self.config.n_embd)

  def __call__(self, h):
    batch, length, width = h.shape
    heads = self.config.n_head
    split = lambda x: x.reshape(batch, length, heads, width // heads)
    query, key, value = map(split, jnp.split(self.c_attn(h), 3, axis=-1))
    mask = nn.make_causal_mask(jnp.ones((batch, length)), dtype=bool)
    out = nn.dot_product_attention(query, key, value, mask=mask)
    return self.c_proj(out.reshape(batch, length, width))


class FlaxGPT2MLP(nn.Module):
  config: Config

  def setup(self):
    self.c_fc = FlaxConv1D(4 * self.config.n_embd)
    self.c_proj = FlaxConv1D(self.config.n_embd)

  def __call__(self, h):
    return self.c_proj(nn.gelu(self.c_fc(h), approximate=True))


class FlaxGPT2Block(nn.Module):
  config: Config

  def setup(self):
    self.ln_1 = nn.LayerNorm(epsilon=1e-5)
    self.attn = FlaxGPT2Attention(self.config)
    self.ln_2 = nn.LayerNorm(epsilon=1e-5)
    self.mlp = FlaxGPT2MLP(self.config)

  def __call__(self, h):
    h = h + self.attn(self.ln_1(h))
    return h + self.mlp(self.ln_2(h))


class FlaxGPT2BlockCollection(nn.Module):
  config: Config

  def setup(self):
    self.blocks = [FlaxGPT2Block(self.config, name=str(i))
                   for i in range(self.config.n_layer)]

  def __call__(self, h):
    for block in self.blocks:
      h = block(h)
    return h


class FlaxGPT2Module(nn.Module):
  config: Config

  def setup(self):
    embed = nn.initializers.normal(0.02)
    self.wte = nn.Embed(self.config.vocab_size, self.config.n_embd, embedding_init=embed)
    self.wpe = nn.Embed(self.config.n_positions, self.config.n_embd, embedding_init=embed)
    self.h = FlaxGPT2BlockCollection(self.config)
    self.ln_f = nn.LayerNorm(epsilon=1e-5)

  def __call__(self, input_ids):
    position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
    return self.ln_f(self.h(self.wte(input_ids) + self.wpe(position_ids)))


class FlaxGPT2LMHeadModule(nn.Module):
  """GPT-2 with its LM head tied to ``wte``: ``(B, T)`` ids -> logits."""
  config: Config

  def setup(self):
    self.transformer = FlaxGPT2Module(self.config)
    self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False)

  def __call__(self, input_ids):
    h = self.transformer(input_ids)
    shared_kernel = self.transformer.variables["params"]["wte"]["embedding"].T
    return self.lm_head.apply({"params": {"kernel": shared_kernel}}, h)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps per optimizer (default 300, 6 with --quick)")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="windows per step (default 32, 8 with --quick)")
  parser.add_argument("--seq-len", type=int, default=None,
                      help="characters per window (default 64, 16 with --quick)")
  parser.add_argument("--width", type=int, default=None,
                      help="n_embd (default 64, 16 with --quick)")
  parser.add_argument("--layers", type=int, default=None,
                      help="n_layer (default 2, 1 with --quick)")
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--kfac-lr", type=float, default=0.01)
  parser.add_argument("--kfac-damping", type=float, default=1e-2)
  parser.add_argument("--adam-lr", type=float, default=3e-3)
  parser.add_argument("--print-every", type=int, default=None,
                      help="print the losses every this many steps")
  parser.add_argument("--compare-fallback", action="store_true",
                      help="also train K-FAC with the FlaxConv1D projections on "
                      "the diagonal block, as they are without register_layer")
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: a tiny model, a few steps")
  args = parser.parse_args(argv)
  defaults = ({"steps": 6, "batch_size": 8, "seq_len": 16, "width": 16, "layers": 1}
              if args.quick else
              {"steps": 300, "batch_size": 32, "seq_len": 64, "width": 64, "layers": 2})
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.print_every is None:
    args.print_every = max(1, args.steps // 10)
  return args


def main(argv=None):
  """Trains with K-FAC and Adam; returns ``{name: per-step losses}`` and
  ``{name: validation loss}`` (mean nats per character)."""
  args = parse_args(argv)
  kfac_optax.register_layer(FlaxConv1D, "dense", kernel_layout="out_in")

  text, description = datasets.load_text()
  vocab = datasets.Vocabulary(text)
  train_ids, validation_ids = datasets.split_text(vocab.encode(text))
  config = Config(len(vocab), args.seq_len, args.width, args.layers, args.heads)
  model = FlaxGPT2LMHeadModule(config)
  loss = kfac_optax.losses.softmax_cross_entropy()
  example_batch = datasets.windows(train_ids, np.arange(args.batch_size),
                                   args.seq_len)
  trainer = side_by_side.linen_trainer(model, loss, example_batch[0], args.seed)
  params = trainer.params
  print(f"{description}; GPT-2 (Hugging Face layout) with n_embd={args.width}, "
        f"n_layer={args.layers}: {sum(p.size for p in jax.tree.leaves(params))} "
        f"parameters; {args.steps} steps of {args.batch_size} windows of {args.seq_len}")

  optimizers = {
      "K-FAC": kfac_optax.kfac(
          model.apply, loss, example_batch=example_batch,
          learning_rate=args.kfac_lr, damping=args.kfac_damping,
          inverse_update_period=1,
          tied_embeddings={"lm_head": "transformer/wte"}),
      "Adam": optax.adam(args.adam_lr),
  }
  if args.compare_fallback:
    optimizers["K-FAC diag"] = kfac_optax.kfac(
        model.apply, loss, example_batch=example_batch,
        learning_rate=args.kfac_lr, damping=args.kfac_damping,
        inverse_update_period=1, tied_embeddings={"lm_head": "transformer/wte"},
        layer_overrides={"transformer/h/*/c_*": "diagonal"})
  order = side_by_side.batch_order(
      len(train_ids) - args.seq_len, args.batch_size, args.steps, args.seed)
  evaluate = side_by_side.make_text_evaluate(model.apply, loss, args.seq_len)
  eval_starts = datasets.evaluation_starts(
      len(validation_ids), args.seq_len, 16 if args.quick else None)

  for name, tx in optimizers.items():
    if name.startswith("K-FAC"):
      print(f"{name}: the block of every module\n{kfac_optax.describe(tx, params)}\n")
  with cpu_threads.single_threaded_lapack():
    trained = side_by_side.train(
        {name: trainer.start(tx) for name, tx in optimizers.items()}, trainer.step,
        lambda i: datasets.windows(train_ids, order[i], args.seq_len),
        len(order), args.seed)
  curves = {name: losses for name, (_, losses, _) in trained.items()}
  validation = {name: evaluate(state.params, validation_ids, eval_starts)
                for name, (state, _, _) in trained.items()}

  print(f"\ntraining loss (uniform guess: {math.log(len(vocab)):.3f} nats)")
  print(f"{'step':>6} " + " ".join(f"{name:>10}" for name in curves))
  for step in sorted({*range(0, args.steps, args.print_every), args.steps - 1}):
    print(f"{step:6d} " + " ".join(f"{c[step]:10.4f}" for c in curves.values()))
  print("validation loss: " + ", ".join(f"{n} {v:.4f}" for n, v in validation.items()))
  return curves, validation


if __name__ == "__main__":
  main()
