"""K-FAC against Adam on a small character-level transformer language model.

The text is the Python standard library's own documentation: the help topics
of ``pydoc_data.topics`` (the text behind ``help("assert")`` etc., the
language reference in plain text), joined in sorted topic order. It ships
with every CPython, so nothing is downloaded; on CPython 3.11 it is about
465 K characters over about 100 distinct characters (the exact text, and so
the numbers, differ slightly between Python versions). The vocabulary is the
set of characters of the whole text; the last 10% of the text is held out for
validation.

The model is a pre-LayerNorm decoder: token embedding plus learned position
embedding, 2 blocks of causal multi-head self-attention (4 heads, width 64)
and a 4x MLP, a final LayerNorm and a dense readout to the vocabulary. Every
layer has a K-FAC block: the attention projections are ``nn.DenseGeneral``
(Kronecker blocks), the embeddings ``nn.Embed`` (diagonal input factor), the
LayerNorms diagonal blocks. The loss is the per-token cross-entropy over
outputs of shape (batch, positions, vocab), so every position of every
window is one loss term of K-FAC's Fisher.

Both optimizers start from the same parameters and see the same windows in
the same order (random start offsets, drawn without replacement from a seeded
permutation), side by side (a step of each in turn, as in
``mlp_classifier.py``); K-FAC also gets a fresh random key per step to
sample targets from the model for its Fisher estimate. At the end the script
prints loss and bits per character on the training and validation text, the
time per step and how long K-FAC took to reach Adam's final training loss
against Adam's own time, and saves both training-loss curves (against steps
and seconds) to a PNG.

K-FAC runs with the README's recommended settings for wall-clock speed:
learning rate and damping 1e-3, statistics every 10 steps, inverses every
50 (``--kfac-lr``, ``--kfac-damping``, ``--kfac-stats-period``,
``--kfac-inverse-period``). On 2 CPU cores it reached Adam's final loss of
the 1000 steps at step 797, in 0.81-0.83x Adam's time (two runs,
2026-11-25). With learning rate 1e-2, damping 1e-2 and inverses every step,
the example's settings before then: at step 716, in 1.22x Adam's time, its
steps 1.7x Adam's.

From the repository root::

  python examples/transformer_lm.py            # full run (a few minutes on 2 CPU cores)
  python examples/transformer_lm.py --quick    # smoke test (seconds)
"""

import argparse
import contextlib
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_optax

try:
  from examples import mlp_classifier
except ImportError:  # run as a script: examples/ itself is on sys.path
  import mlp_classifier

DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "output", "transformer_lm.png")
DEFAULT_STEPS = 1000
QUICK_STEPS = 40
QUICK_EVAL_WINDOWS = 64
VALIDATION_FRACTION = 0.1
EVAL_CHUNK = 256  # windows per jitted evaluation call


def load_text():
  """The stdlib's pydoc help topics as one string, and a description of it."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  text = "\n".join(topics.topics[name] for name in sorted(topics.topics))
  return text, "CPython's pydoc_data.topics (language reference help text)"


class Vocabulary:
  """Characters <-> integer ids, ids in sorted character order."""

  def __init__(self, text):
    self.chars = sorted(set(text))
    self._ids = {c: i for i, c in enumerate(self.chars)}

  def __len__(self):
    return len(self.chars)

  def encode(self, text):
    return np.fromiter((self._ids[c] for c in text), np.int32, len(text))

  def decode(self, ids):
    return "".join(self.chars[i] for i in ids)


def split_text(ids, validation_fraction=VALIDATION_FRACTION):
  """(train ids, validation ids): the validation part is the end of the text."""
  cut = int(round(len(ids) * (1.0 - validation_fraction)))
  return ids[:cut], ids[cut:]


def windows(ids, starts, length):
  """Inputs and next-character targets, both ``(len(starts), length)``."""
  index = np.asarray(starts)[:, None] + np.arange(length + 1)
  chunk = ids[index]
  return chunk[:, :-1], chunk[:, 1:]


def evaluation_starts(num_ids, length, max_windows=None):
  """Starts of non-overlapping windows that tile ``num_ids`` characters;
  ``max_windows`` keeps that many, evenly spread over the text."""
  starts = np.arange(0, num_ids - length, length)
  if max_windows is not None and len(starts) > max_windows:
    keep = np.linspace(0, len(starts) - 1, max_windows).round().astype(int)
    starts = starts[keep]
  return starts


class Block(nn.Module):
  """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""
  width: int
  num_heads: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(name="ln_attention")(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, qkv_features=self.width,
        deterministic=True, name="attention")(h, mask=mask)
    h = nn.LayerNorm(name="ln_mlp")(x)
    h = nn.gelu(nn.Dense(self.mlp_ratio * self.width, name="mlp_in")(h))
    return x + nn.Dense(self.width, name="mlp_out")(h)


class TransformerLM(nn.Module):
  """Causal character model: ``(B, T)`` ids -> ``(B, T, vocab)`` logits."""
  vocab_size: int
  max_length: int
  width: int = 64
  num_heads: int = 4
  num_blocks: int = 2

  @nn.compact
  def __call__(self, tokens):
    # Positions as a (B, T) lookup (not a shared (T,) one), so each example's
    # positions are rows of the embedding's K-FAC statistics.
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    x = (nn.Embed(self.vocab_size, self.width, name="token_embedding")(tokens)
         + nn.Embed(self.max_length, self.width, name="position_embedding")(positions))
    mask = nn.make_causal_mask(tokens)  # (B, 1, T, T)
    for i in range(self.num_blocks):
      x = Block(self.width, self.num_heads, name=f"block_{i}")(x, mask)
    x = nn.LayerNorm(name="ln_final")(x)
    return nn.Dense(self.vocab_size, name="readout")(x)


def parse_args(argv=None):
  """Command-line flags; ``argv=None`` reads ``sys.argv``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=None,
                      help=f"training steps per optimizer (default "
                      f"{DEFAULT_STEPS}, {QUICK_STEPS} with --quick)")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plot", default=DEFAULT_PLOT,
                      help="where to save the loss curves (PNG; default "
                      "examples/output/transformer_lm.png)")
  parser.add_argument("--kfac-lr", type=float, default=1e-3)
  parser.add_argument("--kfac-damping", type=float, default=1e-3,
                      help="Tikhonov damping added to the Fisher")
  parser.add_argument("--kfac-momentum", type=float, default=0.9)
  parser.add_argument("--kfac-stats-period", type=int, default=10,
                      help="update K-FAC's statistics every this many steps")
  parser.add_argument("--kfac-inverse-period", type=int, default=50,
                      help="refresh K-FAC's inverses every this many steps")
  parser.add_argument("--adam-lr", type=float, default=3e-3)
  parser.add_argument("--eval-windows", type=int, default=None,
                      help="cap on the evaluation windows per split (default: "
                      f"all; {QUICK_EVAL_WINDOWS} with --quick)")
  parser.add_argument("--quick", action="store_true",
                      help=f"smoke test: {QUICK_STEPS} steps, "
                      f"{QUICK_EVAL_WINDOWS} evaluation windows per split")
  args = parser.parse_args(argv)
  if args.steps is None:
    args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
  if args.eval_windows is None and args.quick:
    args.eval_windows = QUICK_EVAL_WINDOWS
  return args


def make_evaluate(apply_fn, loss, seq_len):
  """``(params, ids, starts) -> mean per-character loss`` over the windows."""
  @jax.jit
  def chunk_sum(params, x, y):
    return jnp.sum(loss.nll(apply_fn({"params": params}, x), y))

  def evaluate(params, ids, starts):
    total = 0.0
    for first in range(0, len(starts), EVAL_CHUNK):
      x, y = windows(ids, starts[first:first + EVAL_CHUNK], seq_len)
      total += float(chunk_sum(params, x, y))
    return total / (len(starts) * seq_len)
  return evaluate


def single_threaded_lapack():
  """A context that runs OpenBLAS (jaxlib's CPU LAPACK) on one thread.

  K-FAC inverts its factors with LAPACK (``eigh``), which jaxlib takes from
  SciPy's OpenBLAS. With its default threading on a small, busy CPU machine a
  257 x 257 ``eigh`` took about 120 ms instead of 5 ms single-threaded, and
  the inverse refreshes dominated K-FAC's time. XLA's own matmuls do not use
  OpenBLAS, so Adam is unaffected. A no-op without ``threadpoolctl`` (a
  scikit-learn dependency).
  """
  try:
    import scipy.linalg  # pylint: disable=g-import-not-at-top,unused-import
    import threadpoolctl  # pylint: disable=g-import-not-at-top
  except ImportError:
    return contextlib.nullcontext()
  # scipy.linalg loads SciPy's OpenBLAS, so the limit reaches it.
  return threadpoolctl.threadpool_limits(1, user_api="blas")


def main(argv=None):
  """Trains the model with K-FAC and with Adam; prints and returns metrics.

  Args:
    argv: command-line arguments (default ``sys.argv[1:]``).

  Returns:
    ``{"kfac": metrics, "adam": metrics, "initial_loss": log(vocab)}`` where
    ``metrics`` has ``train_loss``, ``validation_loss`` (mean per-character
    cross-entropy in nats over non-overlapping windows of each split),
    ``train_bpc``, ``validation_bpc`` (bits per character),
    ``last_batch_loss`` (mean over the last 10% of steps), ``first_loss``
    (loss of the first mini-batch), ``ms_per_step`` (median step time,
    compilation excluded), ``compile_seconds`` (first step) and
    ``seconds`` (all its steps); K-FAC's also
    ``time_to_adam_final_loss_vs_adam``
    (`mlp_classifier.report_time_to_reference_loss`).
  """
  args = parse_args(argv)
  text, description = load_text()
  vocab = Vocabulary(text)
  train_ids, validation_ids = split_text(vocab.encode(text))
  print(f"{description}: {len(text)} characters, vocabulary {len(vocab)}; "
        f"{len(train_ids)} train / {len(validation_ids)} validation; "
        f"{args.steps} steps of {args.batch_size} windows of {args.seq_len}")

  model = TransformerLM(len(vocab), args.seq_len)
  loss = kfac_optax.losses.softmax_cross_entropy()
  example_batch = windows(train_ids, np.arange(args.batch_size), args.seq_len)
  trainer = mlp_classifier.linen_trainer(model, loss, example_batch[0], args.seed)
  params = trainer.params
  print(f"{sum(p.size for p in jax.tree.leaves(params))} parameters")
  optimizers = {
      "K-FAC": kfac_optax.kfac(
          model.apply, loss, example_batch=example_batch,
          learning_rate=args.kfac_lr, momentum=args.kfac_momentum,
          damping=args.kfac_damping, stats_update_period=args.kfac_stats_period,
          inverse_update_period=args.kfac_inverse_period),
      "Adam": optax.adam(args.adam_lr),
  }
  order = mlp_classifier.batch_order(
      len(train_ids) - args.seq_len, args.batch_size, args.steps, args.seed)
  evaluate = make_evaluate(model.apply, loss, args.seq_len)
  eval_starts = {
      split: evaluation_starts(len(ids), args.seq_len, args.eval_windows)
      for split, ids in (("train", train_ids), ("validation", validation_ids))}

  with single_threaded_lapack():
    trained = mlp_classifier.train(
        {name: trainer.start(tx) for name, tx in optimizers.items()}, trainer.step,
        lambda i: windows(train_ids, order[i], args.seq_len), len(order), args.seed)
  results, curves = {}, {}
  for name, (state, losses, seconds) in trained.items():
    curves[name] = (losses, seconds)
    metrics = {
        "train_loss": evaluate(state.params, train_ids, eval_starts["train"]),
        "validation_loss": evaluate(state.params, validation_ids,
                                    eval_starts["validation"]),
    }
    tail = max(1, len(losses) // 10)
    metrics.update(
        train_bpc=metrics["train_loss"] / math.log(2),
        validation_bpc=metrics["validation_loss"] / math.log(2),
        last_batch_loss=float(np.mean(losses[-tail:])),
        first_loss=float(losses[0]),
        ms_per_step=1e3 * float(np.median(seconds[1:] if len(seconds) > 1
                                          else seconds)),
        compile_seconds=float(seconds[0]),
        seconds=float(np.sum(seconds)))
    results[name.lower().replace("-", "")] = metrics

  print(f"\nFinal metrics after {args.steps} steps (uniform guess: "
        f"{math.log(len(vocab)):.3f} nats = {math.log2(len(vocab)):.2f} bits):")
  print(f"{'':>6} {'train loss':>10} {'train bpc':>9} {'val loss':>8} "
        f"{'val bpc':>7} {'ms/step':>7} {'compile':>7}")
  for name, m in results.items():
    print(f"{name:>6} {m['train_loss']:10.4f} {m['train_bpc']:9.3f} "
          f"{m['validation_loss']:8.4f} {m['validation_bpc']:7.3f} "
          f"{m['ms_per_step']:7.1f} {m['compile_seconds']:6.1f}s")
  results["kfac"]["time_to_adam_final_loss_vs_adam"] = (
      mlp_classifier.report_time_to_reference_loss(curves, "Adam", ["K-FAC"])["K-FAC"])
  mlp_classifier.save_plot(
      args.plot, curves,
      f"Character transformer LM on pydoc topics ({args.steps} steps)")
  print(f"loss curves saved to {args.plot}")
  results["initial_loss"] = math.log(len(vocab))
  return results


if __name__ == "__main__":
  main()
