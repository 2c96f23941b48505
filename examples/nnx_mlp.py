"""K-FAC against Adam on a Flax NNX MLP, trained through ``nnx.Optimizer``.

The NNX twin of `mlp_classifier.py` (Fashion-MNIST, or sklearn digits): the
model is an ``nnx.Module`` with dropout, and both optimizers run the loop the
NNX guides teach, ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` updated inside
``nnx.jit``. K-FAC takes the model itself in place of a linen apply
function, and the batch and a fresh random key per step as
``optimizer.update(model, grads, batch=..., rng=...)`` (the key samples its
Fisher targets and its dropout masks; Adam ignores both). Both start from the
same weights and see the same mini-batches; the script prints K-FAC's blocks,
the final loss and accuracy on the full train and test sets, and saves the
training-loss curves to a PNG.

From the repository root::

  python examples/nnx_mlp.py            # full run (1000 steps)
  python examples/nnx_mlp.py --quick    # smoke test (seconds)
"""

import argparse
import os
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_optax

try:
  from examples import datasets
  from examples import mlp_classifier
except ImportError:  # run as a script: examples/ itself is on sys.path
  import datasets
  import mlp_classifier

DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "output", "nnx_mlp.png")
QUICK_STEPS = 60
QUICK_TRAIN_SIZE = 2048
QUICK_TEST_SIZE = 1024


class MLP(nnx.Module):
  """features -> 256 -> 128 -> classes, tanh, dropout before the head."""

  def __init__(self, num_features: int, num_classes: int, dropout: float,
               rngs: nnx.Rngs):
    self.hidden = nnx.List([nnx.Linear(num_features, 256, rngs=rngs),
                            nnx.Linear(256, 128, rngs=rngs)])
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(128, num_classes, rngs=rngs)

  def __call__(self, x):
    for layer in self.hidden:
      x = jnp.tanh(layer(x))
    return self.head(self.dropout(x))


def parse_args(argv=None):
  """Command-line flags; ``argv=None`` reads ``sys.argv``."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dataset", default="auto",
                      choices=["auto", "fashion_mnist", "digits"])
  parser.add_argument("--steps", type=int, default=None,
                      help=f"training steps per optimizer (default 1000, "
                      f"{QUICK_STEPS} with --quick)")
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--dropout", type=float, default=0.1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plot", default=DEFAULT_PLOT,
                      help="where to save the loss curves (PNG; default "
                      "examples/output/nnx_mlp.png)")
  # The settings of mlp_classifier.py, tuned there on the same MLP.
  parser.add_argument("--kfac-lr", type=float, default=0.01)
  parser.add_argument("--kfac-damping", type=float, default=1e-2)
  parser.add_argument("--kfac-momentum", type=float, default=0.9)
  parser.add_argument("--adam-lr", type=float, default=3e-3)
  parser.add_argument("--quick", action="store_true",
                      help=f"smoke test: {QUICK_STEPS} steps on "
                      f"{QUICK_TRAIN_SIZE} training examples")
  args = parser.parse_args(argv)
  if args.steps is None:
    args.steps = QUICK_STEPS if args.quick else 1000
  return args


def cross_entropy(model, batch):
  logits = model(batch[0])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


@nnx.jit
def train_step(model, optimizer, batch, rng):
  """One step of the NNX guides' loop; ``batch`` and ``rng`` reach K-FAC."""
  loss, grads = nnx.value_and_grad(cross_entropy)(model, batch)
  optimizer.update(model, grads, batch=batch, rng=rng)
  return loss


@nnx.jit
def _chunk_sums(model, x, y):
  logits = model(x)
  return (jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y)),
          jnp.sum(jnp.argmax(logits, axis=-1) == y))


def evaluate(model, x, y, chunk=10_000):
  """(mean loss, accuracy) over a whole data set, dropout off."""
  model.eval()
  sums = [_chunk_sums(model, x[i:i + chunk], y[i:i + chunk])
          for i in range(0, len(x), chunk)]
  model.train()
  return (sum(float(s[0]) for s in sums) / len(x),
          sum(int(s[1]) for s in sums) / len(x))


def main(argv=None):
  """Trains with K-FAC and with Adam; returns ``{"kfac": m, "adam": m}``,
  ``m`` with ``train_loss``, ``train_accuracy``, ``test_loss``,
  ``test_accuracy``, ``last_batch_loss`` and ``seconds``."""
  args = parse_args(argv)
  x_train, y_train, x_test, y_test, description = datasets.load_classification(
      args.dataset)
  if args.quick:
    x_train, y_train = x_train[:QUICK_TRAIN_SIZE], y_train[:QUICK_TRAIN_SIZE]
    x_test, y_test = x_test[:QUICK_TEST_SIZE], y_test[:QUICK_TEST_SIZE]
  num_classes = int(max(y_train.max(), y_test.max())) + 1
  print(f"{description}: {len(x_train)} train / {len(x_test)} test examples, "
        f"{x_train.shape[1]} features; {args.steps} steps of batch "
        f"{args.batch_size}")
  order = mlp_classifier.batch_order(len(x_train), args.batch_size, args.steps,
                                     args.seed)
  example_batch = (x_train[:args.batch_size], y_train[:args.batch_size])
  loss = kfac_optax.losses.softmax_cross_entropy()

  results, curves = {}, {}
  for name in ("K-FAC", "Adam"):
    # The same seed, so both start from the same weights.
    model = MLP(x_train.shape[1], num_classes, args.dropout, nnx.Rngs(args.seed))
    if name == "K-FAC":
      tx = kfac_optax.kfac(model, loss, example_batch=example_batch,
                           learning_rate=args.kfac_lr,
                           momentum=args.kfac_momentum, damping=args.kfac_damping)
      print(kfac_optax.describe(tx, nnx.state(model, nnx.Param)))
    else:
      tx = optax.adam(args.adam_lr)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng, losses = jax.random.key(args.seed + 1), []
    start = time.perf_counter()
    for indices in order:
      rng, step_rng = jax.random.split(rng)
      losses.append(train_step(model, optimizer,
                               (x_train[indices], y_train[indices]), step_rng))
    curves[name] = np.asarray(jax.device_get(losses), np.float64)
    seconds = time.perf_counter() - start
    train_loss, train_accuracy = evaluate(model, x_train, y_train)
    test_loss, test_accuracy = evaluate(model, x_test, y_test)
    tail = max(1, len(curves[name]) // 10)
    results[name.lower().replace("-", "")] = {
        "train_loss": train_loss, "train_accuracy": train_accuracy,
        "test_loss": test_loss, "test_accuracy": test_accuracy,
        "last_batch_loss": float(np.mean(curves[name][-tail:])),
        "seconds": seconds,
    }

  print(f"\nFinal metrics after {args.steps} steps ({description}):")
  print(f"{'':>6} {'train loss':>10} {'train acc':>9} {'test loss':>9} "
        f"{'test acc':>8} {'time':>7}")
  for name, m in results.items():
    print(f"{name:>6} {m['train_loss']:10.4f} {m['train_accuracy']:9.2%} "
          f"{m['test_loss']:9.4f} {m['test_accuracy']:8.2%} "
          f"{m['seconds']:6.1f}s")
  mlp_classifier.save_plot(args.plot, curves, f"NNX MLP on {description}")
  print(f"loss curves saved to {args.plot}")
  return results


if __name__ == "__main__":
  main()
