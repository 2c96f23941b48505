"""K-FAC's three treatments of time steps on a small LSTM character model.

An LSTM applies the same weights at every time step. K-FAC can treat the
steps of such a layer as independent rows (``"independent"``, the default)
or model them as a series (``"series_option1"``, ``"series_option2"``;
Martens, Ba & Johnson 2018, see docs/models.md, "Recurrent networks"). This
script trains the same LSTM language model with each of the three and with
Adam at the best of three learning rates, on the same windows in the same
order, side by side (a step of each in turn, as in ``mlp_classifier.py``),
and reports the loss against steps and against wall time.

The text is the one ``transformer_lm.py`` uses (``datasets.load_text``):
CPython's ``pydoc_data.topics`` (shipped with every CPython, nothing is
downloaded), the last 10% held out.
The model: a character embedding (width 32), one ``nn.RNN(nn.LSTMCell(64))``
over the window (its eight gate projections are ``nn.Dense`` layers shared
over time: the series blocks apply to them), a dense readout per position.

From the repository root::

  python examples/lstm_lm.py            # full run (a few minutes on 2 CPU cores)
  python examples/lstm_lm.py --quick    # smoke test (seconds)
"""

import argparse
import math
import os

import flax.linen as nn
import numpy as np
import optax

import kfac_optax

try:
  from examples import cpu_threads
  from examples import datasets
  from examples import side_by_side
except ImportError:  # run as a script: examples/ itself is on sys.path
  import cpu_threads
  import datasets
  import side_by_side

DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "output", "lstm_lm.png")
OPTIONS = ("independent", "series_option1", "series_option2")
ADAM_LRS = (3e-3, 1e-2, 3e-2)
THREADED = {"kfac_inputs": 0, "kfac_perturbations": 0}  # the time axis


class LSTMLM(nn.Module):
  """``(B, T)`` ids -> ``(B, T, vocab)`` next-character logits."""
  vocab_size: int
  embedding: int = 32
  hidden: int = 64

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab_size, self.embedding, name="embedding")(tokens)
    # K-FAC's collections gain the time axis (axis 0) like any scanned
    # variable; the params are broadcast over time.
    h = nn.RNN(nn.LSTMCell(self.hidden, name="lstm"), variable_axes=THREADED,
               name="rnn")(x)
    return nn.Dense(self.vocab_size, name="readout")(h)


def parse_args(argv=None):
  """Command-line flags; ``argv=None`` reads ``sys.argv``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=32)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plot", default=DEFAULT_PLOT,
                      help="where to save the loss curves (PNG; default "
                      "examples/output/lstm_lm.png)")
  parser.add_argument("--kfac-lr", type=float, default=0.03)
  parser.add_argument("--kfac-damping", type=float, default=1e-2)
  parser.add_argument("--kfac-momentum", type=float, default=0.9)
  parser.add_argument("--kfac-stats-period", type=int, default=1,
                      help="update K-FAC's statistics every this many steps")
  parser.add_argument("--kfac-inverse-period", type=int, default=5)
  parser.add_argument("--eval-windows", type=int, default=512,
                      help="evaluation windows per split")
  parser.add_argument("--options", nargs="+", choices=OPTIONS, default=None,
                      help="K-FAC options to train (default: all three; "
                      "series_option2 with --quick)")
  parser.add_argument("--adam-lrs", nargs="+", type=float, default=None,
                      help=f"Adam learning rates to try (default {ADAM_LRS}; "
                      f"{ADAM_LRS[1]} with --quick)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: 6 steps of a tiny model, one K-FAC "
                      "option and one Adam learning rate (compilation "
                      "dominates: each K-FAC option compiles for seconds)")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.batch_size, args.seq_len = 6, 4, 8
    args.hidden, args.eval_windows, args.kfac_inverse_period = 8, 8, 1
  args.options = args.options or (["series_option2"] if args.quick else list(OPTIONS))
  args.adam_lrs = args.adam_lrs or ([ADAM_LRS[1]] if args.quick else list(ADAM_LRS))
  return args


def main(argv=None):
  """Trains with the three K-FAC options and Adam; prints and returns metrics.

  Returns:
    ``{name: metrics}`` for each trained K-FAC option (``independent``,
    ``series_option1``, ``series_option2``) and ``adam`` (the best of the
    learning rates tried, by the mean loss of its last 10% of steps, with
    its ``learning_rate``), each with
    ``validation_loss`` (nats per character), ``last_batch_loss``,
    ``ms_per_step`` (median, compilation excluded) and ``seconds`` (all
    steps but the first); the K-FAC options also
    ``time_to_adam_final_loss_vs_adam`` (seconds to the best Adam's final
    smoothed training loss over Adam's; inf if never); plus
    ``initial_loss`` (log vocab).
  """
  args = parse_args(argv)
  text, description = datasets.load_text()
  vocab = datasets.Vocabulary(text)
  train_ids, validation_ids = datasets.split_text(vocab.encode(text))
  print(f"{description}: {len(text)} characters, vocabulary {len(vocab)}; "
        f"{args.steps} steps of {args.batch_size} windows of {args.seq_len}")

  model = LSTMLM(len(vocab), hidden=args.hidden)
  loss = kfac_optax.losses.softmax_cross_entropy()
  example_batch = datasets.windows(train_ids, np.arange(args.batch_size),
                                   args.seq_len)
  trainer = side_by_side.linen_trainer(model, loss, example_batch[0], args.seed)
  optimizers = {
      option: kfac_optax.kfac(
          model.apply, loss, example_batch=example_batch,
          learning_rate=args.kfac_lr, momentum=args.kfac_momentum,
          damping=args.kfac_damping, stats_update_period=args.kfac_stats_period,
          inverse_update_period=args.kfac_inverse_period,
          layer_overrides={"lstm/*": option})
      for option in args.options}
  optimizers.update({f"adam {lr:g}": optax.adam(lr) for lr in args.adam_lrs})
  order = side_by_side.batch_order(len(train_ids) - args.seq_len,
                                   args.batch_size, args.steps, args.seed)
  evaluate = side_by_side.make_text_evaluate(model.apply, loss, args.seq_len)
  eval_starts = datasets.evaluation_starts(len(validation_ids), args.seq_len,
                                           args.eval_windows)

  with cpu_threads.single_threaded_lapack():
    trained = side_by_side.train(
        {name: trainer.start(tx) for name, tx in optimizers.items()}, trainer.step,
        lambda i: datasets.windows(train_ids, order[i], args.seq_len),
        len(order), args.seed)
  results, curves = {}, {}
  for name, (state, losses, seconds) in trained.items():
    curves[name] = (losses, seconds)
    tail = max(1, args.steps // 10)
    results[name] = {
        "validation_loss": evaluate(state.params, validation_ids, eval_starts),
        "last_batch_loss": float(np.mean(losses[-tail:])),
        "ms_per_step": 1e3 * float(np.median(seconds[1:])),
        "seconds": float(np.sum(seconds[1:]))}

  adam = min((n for n in results if n.startswith("adam")),
             key=lambda n: results[n]["last_batch_loss"])
  print(f"\nAfter {args.steps} steps (uniform guess {math.log(len(vocab)):.3f} nats):")
  print(f"{'':>16} {'last 10% loss':>13} {'val loss':>8} {'ms/step':>7} {'seconds':>7}")
  for name, m in results.items():
    mark = " <- best Adam" if name == adam else ""
    print(f"{name:>16} {m['last_batch_loss']:13.4f} {m['validation_loss']:8.4f} "
          f"{m['ms_per_step']:7.1f} {m['seconds']:7.1f}{mark}")
  shown = [*args.options, adam]
  ratios = side_by_side.report_time_to_reference_loss(curves, adam, args.options)
  for name, ratio in ratios.items():
    results[name]["time_to_adam_final_loss_vs_adam"] = ratio
  side_by_side.save_plot(args.plot, {n: curves[n] for n in shown},
                         f"LSTM character LM on pydoc topics ({args.steps} steps)")
  print(f"loss curves saved to {args.plot}")
  out = {name: results[name] for name in args.options}
  out["adam"] = {**results[adam], "learning_rate": float(adam.split()[1])}
  out["initial_loss"] = math.log(len(vocab))
  return out


if __name__ == "__main__":
  main()
