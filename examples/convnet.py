"""K-FAC against Adam on a small convnet (Fashion-MNIST, or sklearn digits).

The network is the one of the TensorFlow K-FAC convnet example: two 5x5
convolutions with 16 channels (SAME padding, ReLU by default), each followed
by a 3x3 max-pool of stride 2 (SAME), then one linear layer to the classes,
trained on the softmax cross-entropy. K-FAC gives each convolution a KFC
block (input patches ⊗ output gradients) and the linear layer a K-FAC block.

As in `mlp_classifier.py` (both use the data, training, evaluation and
plot helpers of ``datasets.py`` and ``side_by_side.py``; the network is
``models.ConvNet``), both optimizers start from the same parameters and see
the same mini-batches in the same order, a step of each in turn; K-FAC also
gets a fresh random key per step to sample targets for its Fisher estimate.
The model is Flax linen (``--api linen``, the default) or the same network
as an ``nnx.Module`` trained through ``nnx.Optimizer`` under ``nnx.jit``
(``--api nnx``). The script prints the final loss and accuracy on the train
and test sets, the time per step of each optimizer, and saves both
training-loss curves (against steps and seconds) to a PNG.

From the repository root::

  python examples/convnet.py              # full run (about 3 minutes on 2 CPU cores)
  python examples/convnet.py --api nnx    # the same in Flax NNX
  python examples/convnet.py --quick      # smoke test (about 30 s)
"""

import argparse
import os

from flax import nnx
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
                            "output", "convnet.png")
DEFAULT_STEPS = 300
QUICK_STEPS = 40
QUICK_TRAIN_SIZE = 2048
QUICK_TEST_SIZE = 1024


def parse_args(argv=None):
  """Command-line flags; ``argv=None`` reads ``sys.argv``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dataset", default="auto",
                      choices=["auto", "fashion_mnist", "digits"])
  side_by_side.add_api_flag(parser)
  parser.add_argument("--steps", type=int, default=None,
                      help=f"training steps per optimizer (default "
                      f"{DEFAULT_STEPS}, {QUICK_STEPS} with --quick)")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plot", default=DEFAULT_PLOT,
                      help="where to save the loss curves (PNG; default "
                      "examples/output/convnet.png)")
  parser.add_argument("--activation", default="relu",
                      choices=list(models.ACTIVATIONS))
  datasets.add_subset_flags(parser, QUICK_TRAIN_SIZE, QUICK_TEST_SIZE)
  # Defaults from a sweep on Fashion-MNIST (300 steps of batch 128, momentum
  # 0.9; training loss on 10k training images): lr = damping = 1e-3 gave
  # 0.258; lr 3e-3 with damping 3e-3 / 1e-2 gave 0.268 / 0.274; lr 1e-2 and
  # 3e-2 did worse (0.29-0.32) and diverged with damping 0.03 on a 2048-image
  # slice. Adam gave 0.419 / 0.383 / 0.331 / 0.409 at lr 1e-3 / 3e-3 / 1e-2
  # / 3e-2, so the baseline uses its best, 1e-2.
  parser.add_argument("--kfac-lr", type=float, default=1e-3)
  parser.add_argument("--kfac-damping", type=float, default=1e-3,
                      help="Tikhonov damping added to the Fisher")
  parser.add_argument("--kfac-momentum", type=float, default=0.9)
  parser.add_argument("--kfac-inverse-period", type=int, default=5,
                      help="refresh the factor inverses every N steps")
  # Cholesky: on CPU the inverses of the linear layer's 785x785 input factor
  # took 20-50 ms by Cholesky and 100-160 ms by eigh (same training loss).
  parser.add_argument("--kfac-inverse", default="cholesky",
                      choices=["cholesky", "eigh"])
  parser.add_argument("--adam-lr", type=float, default=1e-2)
  parser.add_argument("--quick", action="store_true",
                      help=f"smoke test: {QUICK_STEPS} steps on "
                      f"{QUICK_TRAIN_SIZE} training examples")
  args = parser.parse_args(argv)
  if args.steps is None:
    args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
  if args.quick:
    args.train_size = args.train_size or QUICK_TRAIN_SIZE
    args.test_size = args.test_size or QUICK_TEST_SIZE
  return args


def make_optimizers(model, loss, example_batch, args):
  """``{"K-FAC": ..., "Adam": ...}`` configured from the flags; ``model`` as
  `kfac_optax.kfac` takes it (a linen apply function or an ``nnx.Module``)."""
  return {
      "K-FAC": kfac_optax.kfac(
          model, loss, example_batch=example_batch,
          learning_rate=args.kfac_lr, momentum=args.kfac_momentum,
          damping=args.kfac_damping,
          inverse_update_period=args.kfac_inverse_period,
          inverse=args.kfac_inverse),
      "Adam": optax.adam(args.adam_lr),
  }


def main(argv=None):
  """Trains the convnet with K-FAC and with Adam; prints and returns metrics.

  Args:
    argv: command-line arguments (default ``sys.argv[1:]``).

  Returns:
    ``{"kfac": metrics, "adam": metrics}``, the metrics of
    `side_by_side.summarize_runs` (on the training and test examples
    used); K-FAC's also have ``time_to_adam_final_loss_vs_adam``.
  """
  args = parse_args(argv)
  x_train, y_train, x_test, y_test, description = datasets.load_classification(
      args.dataset)
  x_train, y_train = x_train[:args.train_size], y_train[:args.train_size]
  x_test, y_test = x_test[:args.test_size], y_test[:args.test_size]
  x_train, x_test = datasets.as_images(x_train), datasets.as_images(x_test)
  num_classes = int(max(y_train.max(), y_test.max())) + 1
  print(f"{description}: {len(x_train)} train / {len(x_test)} test images of "
        f"{'x'.join(map(str, x_train.shape[1:]))}; {args.steps} steps of batch "
        f"{args.batch_size}")

  loss = kfac_optax.losses.softmax_cross_entropy()
  example_batch = (x_train[:args.batch_size], y_train[:args.batch_size])
  if args.api == "linen":
    model = models.ConvNet(num_classes=num_classes, activation=args.activation)
    trainer = side_by_side.linen_trainer(model, loss, example_batch[0],
                                         args.seed)
  else:
    trainer = side_by_side.nnx_trainer(
        models.NnxConvNet(*x_train.shape[1:3], num_classes=num_classes,
                   activation=args.activation, rngs=nnx.Rngs(args.seed)), loss)
  optimizers = make_optimizers(trainer.model, loss, example_batch, args)
  order = side_by_side.batch_order(len(x_train), args.batch_size,
                                   args.steps, args.seed)
  evaluate = side_by_side.make_evaluate(trainer.logits, loss)

  # One OpenBLAS thread for the LAPACK calls of K-FAC's inverses: with
  # OpenBLAS's own threads on a small CPU machine the refreshes were 10-20x
  # slower, and concurrent LAPACK calls could stall (see the function).
  with cpu_threads.single_threaded_lapack():
    trained = side_by_side.train(
        {name: trainer.start(tx) for name, tx in optimizers.items()},
        trainer.step, lambda i: (x_train[order[i]], y_train[order[i]]),
        len(order), args.seed)
  results, curves = side_by_side.summarize_runs(
      trained, trainer.params_of, evaluate, (x_train, y_train, x_test, y_test))

  print(f"\nFinal metrics after {args.steps} steps ({description}):")
  print(f"{'':>6} {'train loss':>10} {'train acc':>9} {'test loss':>9} "
        f"{'test acc':>8} {'ms/step':>8} {'median':>7} {'1st step':>8}")
  for name, m in results.items():
    print(f"{name:>6} {m['train_loss']:10.4f} {m['train_accuracy']:9.2%} "
          f"{m['test_loss']:9.4f} {m['test_accuracy']:8.2%} "
          f"{m['ms_per_step']:8.1f} {m['median_ms_per_step']:7.1f} "
          f"{m['compile_seconds']:7.1f}s")
  print("ms/step: mean wall time of the steps after the first (K-FAC's "
        "inverse refreshes included), median: their median; 1st step: "
        "compilation included")
  results["kfac"]["time_to_adam_final_loss_vs_adam"] = (
      side_by_side.report_time_to_reference_loss(curves, "Adam", ["K-FAC"])["K-FAC"])
  side_by_side.save_plot(args.plot, curves,
                         f"ConvNet ({args.api}) on {description}")
  print(f"loss curves saved to {args.plot}")
  return results


if __name__ == "__main__":
  main()
