"""K-FAC against Adam on a small character-level transformer language model.

The text (``datasets.load_text``) is the Python standard library's own
documentation: the help topics of ``pydoc_data.topics`` (the text behind
``help("assert")`` etc., the language reference in plain text), joined in
sorted topic order. It ships with every CPython, so nothing is downloaded; on
CPython 3.11 it is about 465 K characters over about 100 distinct characters
(the exact text, and so the numbers, differ slightly between Python
versions). The vocabulary is the set of characters of the whole text; the
last 10% of the text is held out for validation.

The model (``models.TransformerLM``) is a pre-LayerNorm decoder: token
embedding plus learned position embedding, 2 blocks of causal multi-head
self-attention (4 heads, width 64) and a 4x MLP, a final LayerNorm and a
dense readout to the vocabulary. Every layer has a K-FAC block: the
attention projections are ``nn.DenseGeneral`` (Kronecker blocks), the
embeddings ``nn.Embed`` (diagonal input factor), the LayerNorms diagonal
blocks. The loss is the per-token cross-entropy over outputs of shape
(batch, positions, vocab), so every position of every window is one loss
term of K-FAC's Fisher.

Both optimizers start from the same parameters and see the same windows in
the same order (random start offsets, drawn without replacement from a seeded
permutation), side by side (a step of each in turn, ``side_by_side.train``,
as in ``mlp_classifier.py``); K-FAC also gets a fresh random key per step to
sample targets from the model for its Fisher estimate. At the end the script
prints loss and bits per character on the training and validation text, the
time per step and how long K-FAC took to reach Adam's final training loss
against Adam's own time, and saves both training-loss curves (against steps
and seconds) to a PNG.

K-FAC runs with the README's recommended settings for wall-clock speed:
learning rate and damping 1e-3, statistics every 10 steps, inverses every
50 (``--kfac-lr``, ``--kfac-damping``, ``--kfac-stats-period``,
``--kfac-inverse-period``; the docs' advice for language models is
``--kfac-lr 3e-2 --kfac-momentum 0.7 --kfac-damping 1e-4
--kfac-inverse-period 10 --kfac-warmup 10``). On 2 CPU cores it reached
Adam's final loss of the 1000 steps at step 797, in 0.81-0.83x Adam's time
(two runs, 2026-11-25); with the advice at step 429, in 0.44x (validation
loss 1.310 against Adam's 1.424; 2026-11-28; the advice without the
damping, inverse period and warm-up: step 557, 0.58x). With learning rate 1e-2,
damping 1e-2 and inverses every step, the example's settings before then:
at step 716, in 1.22x Adam's time, its steps 1.7x Adam's.

From the repository root::

  python examples/transformer_lm.py            # full run (a few minutes on 2 CPU cores)
  python examples/transformer_lm.py --quick    # smoke test (seconds)
"""

import argparse
import math
import os

import jax
import numpy as np
import optax

import kfac_optax

try:
  from examples import cpu_threads
  from examples import datasets
  from examples import models
  from examples import side_by_side
except ImportError:  # run as a script: examples/ itself is on sys.path
  import cpu_threads
  import datasets
  import models
  import side_by_side

DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "output", "transformer_lm.png")
DEFAULT_STEPS = 1000
QUICK_STEPS = 40
QUICK_EVAL_WINDOWS = 64


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
  parser.add_argument("--kfac-norm-constraint", type=float, default=1e-3,
                      help="KL bound on each step (kfac's norm_constraint)")
  parser.add_argument("--kfac-stats-period", type=int, default=10,
                      help="update K-FAC's statistics every this many steps")
  parser.add_argument("--kfac-inverse-period", type=int, default=50,
                      help="refresh K-FAC's inverses every this many steps")
  parser.add_argument("--kfac-warmup", type=int, default=0,
                      help="K-FAC's statistics and inverses on each of the "
                      "first this many steps (curvature_warmup)")
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
    (`side_by_side.report_time_to_reference_loss`).
  """
  args = parse_args(argv)
  text, description = datasets.load_text()
  vocab = datasets.Vocabulary(text)
  train_ids, validation_ids = datasets.split_text(vocab.encode(text))
  print(f"{description}: {len(text)} characters, vocabulary {len(vocab)}; "
        f"{len(train_ids)} train / {len(validation_ids)} validation; "
        f"{args.steps} steps of {args.batch_size} windows of {args.seq_len}")

  model = models.TransformerLM(len(vocab), args.seq_len)
  loss = kfac_optax.losses.softmax_cross_entropy()
  example_batch = datasets.windows(train_ids, np.arange(args.batch_size),
                                   args.seq_len)
  trainer = side_by_side.linen_trainer(model, loss, example_batch[0], args.seed)
  params = trainer.params
  print(f"{sum(p.size for p in jax.tree.leaves(params))} parameters")
  optimizers = {
      "K-FAC": kfac_optax.kfac(
          model.apply, loss, example_batch=example_batch,
          learning_rate=args.kfac_lr, momentum=args.kfac_momentum,
          norm_constraint=args.kfac_norm_constraint, damping=args.kfac_damping,
          stats_update_period=args.kfac_stats_period,
          inverse_update_period=args.kfac_inverse_period,
          curvature_warmup=args.kfac_warmup),
      "Adam": optax.adam(args.adam_lr),
  }
  order = side_by_side.batch_order(
      len(train_ids) - args.seq_len, args.batch_size, args.steps, args.seed)
  evaluate = side_by_side.make_text_evaluate(model.apply, loss, args.seq_len)
  eval_starts = {
      split: datasets.evaluation_starts(len(ids), args.seq_len, args.eval_windows)
      for split, ids in (("train", train_ids), ("validation", validation_ids))}

  with cpu_threads.single_threaded_lapack():
    trained = side_by_side.train(
        {name: trainer.start(tx) for name, tx in optimizers.items()}, trainer.step,
        lambda i: datasets.windows(train_ids, order[i], args.seq_len), len(order),
        args.seed)
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
      side_by_side.report_time_to_reference_loss(curves, "Adam", ["K-FAC"])["K-FAC"])
  side_by_side.save_plot(
      args.plot, curves,
      f"Character transformer LM on pydoc topics ({args.steps} steps)")
  print(f"loss curves saved to {args.plot}")
  results["initial_loss"] = math.log(len(vocab))
  return results


if __name__ == "__main__":
  main()
