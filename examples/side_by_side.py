"""How the examples race optimizers: side by side, then compared.

Every optimizer starts from the same parameters and sees the same batches
(`batch_order`) and random keys in the same order. `train` interleaves their
steps (a step of each in turn), so that a slow spell of the machine falls on
all of them alike. `summarize_runs` and `make_evaluate` give each run's
metrics, `report_time_to_reference_loss` how soon each reached a reference
run's final loss, and `save_plot` the training-loss curves against steps and
against seconds.

A `Trainer` hides the one difference between the Flax APIs: a linen model
trains as a `kfac_optax.TrainState` under ``jax.jit`` (`linen_trainer`), an
NNX model through ``nnx.Optimizer`` under ``nnx.jit`` (`nnx_trainer`).
"""

import math
import os
import time
from typing import Any, Callable, NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import kfac_optax

try:
  from examples import datasets
except ImportError:  # run as a script: examples/ itself is on sys.path
  import datasets

EVAL_CHUNK = 10_000  # examples per jitted evaluation call
EVAL_WINDOWS = 256  # text windows per jitted evaluation call
SMOOTHING = 25  # steps in the trailing mean of the loss curves


# -- training ----------------------------------------------------------------


class Trainer(NamedTuple):
  """How one Flax API trains and evaluates a model from its initial weights.

  Attributes:
    model: the model as `kfac_optax.kfac` takes it: a linen apply function
      or the ``nnx.Module``.
    params: the initial params (for `kfac_optax.describe`).
    start: ``tx -> state``, a fresh training state from the initial weights.
    step: ``(state, batch, rng) -> (state, loss)``, one compiled step that
      passes ``batch`` and ``rng`` to ``tx.update`` (Adam ignores them).
    params_of: ``state -> params``.
    logits: ``(params, x) -> logits``, traceable.
  """
  model: Any
  params: Any
  start: Callable[[optax.GradientTransformation], Any]
  step: Callable[[Any, Any, jax.Array], tuple[Any, jax.Array]]
  params_of: Callable[[Any], Any]
  logits: Callable[[Any, jax.Array], jax.Array]


def add_api_flag(parser):
  """``--api {linen,nnx}``: the Flax API the model is written in."""
  parser.add_argument("--api", default="linen", choices=["linen", "nnx"],
                      help="Flax API of the model: linen (TrainState, jax.jit) "
                      "or nnx (nnx.Optimizer, nnx.jit)")


def linen_trainer(model, loss, example_inputs, seed):
  """A `Trainer` of a linen model, initialized from ``seed``:
  `kfac_optax.TrainState` under ``jax.jit``."""
  params = jax.jit(model.init)(jax.random.key(seed), example_inputs)["params"]

  def start(tx):
    state = kfac_optax.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=tx)
    # The step donates (and so invalidates) the buffers of the state it is
    # given: copying keeps the shared initial `params` alive for the next
    # optimizer.
    return jax.tree.map(jnp.copy, state)
  return Trainer(model.apply, params, start, make_train_step(loss),
                 lambda state: state.params,
                 lambda params, x: model.apply({"params": params}, x))


def nnx_trainer(model, loss):
  """A `Trainer` of an NNX model (params only): ``nnx.Optimizer`` under
  ``nnx.jit``; each optimizer trains its own copy of ``model``."""
  graphdef, params = nnx.split(model)
  params = nnx.as_pure(params)  # arrays: each `merge` makes new Variables

  @nnx.jit
  def update(model, optimizer, batch, rng):
    def batch_loss(model):
      return loss.value(model(batch[0]), batch)
    value, grads = nnx.value_and_grad(batch_loss)(model)
    optimizer.update(model, grads, batch=batch, rng=rng)
    return value

  def start(tx):
    copy = nnx.merge(graphdef, params)
    return copy, nnx.Optimizer(copy, tx, wrt=nnx.Param)

  def step(state, batch, rng):
    return state, update(*state, batch, rng)  # updates the state in place
  return Trainer(model, params, start, step, lambda state: nnx.state(state[0]),
                 lambda params, x: nnx.merge(graphdef, params)(x))


def make_train_step(loss):
  """A jitted ``(state, batch, rng) -> (state, loss)``; the state is donated.

  The same step serves both optimizers: `kfac_optax.TrainState` forwards
  ``batch`` and ``rng`` to ``tx.update``, and optax's Adam ignores them.
  """
  def step(state, batch, rng):
    def batch_loss(params):
      return loss.value(state.apply_fn({"params": params}, batch[0]), batch)
    value, grads = jax.value_and_grad(batch_loss)(state.params)
    return state.apply_gradients(grads=grads, batch=batch, rng=rng), value
  return jax.jit(step, donate_argnums=0)


def batch_order(num_examples, batch_size, steps, seed):
  """Indices of every mini-batch: reshuffled each epoch, shape (steps, B)."""
  rng = np.random.default_rng(seed)
  per_epoch = num_examples // batch_size  # drop the ragged last batch
  if per_epoch == 0:
    raise ValueError(f"batch size {batch_size} exceeds the {num_examples} "
                     "training examples")
  epochs = -(-steps // per_epoch)
  order = [rng.permutation(num_examples)[:per_epoch * batch_size]
           for _ in range(epochs)]
  return np.concatenate(order).reshape(-1, batch_size)[:steps]


def train(states, step_fn, batch_at, steps, seed):
  """Runs ``steps`` steps of every optimizer in ``states``, side by side.

  At every step each optimizer in turn takes the same batch and random key.
  Interleaved, a stretch of the machine running slow (here: tens to hundreds
  of steps 1.5x slower, whichever optimizer was running) falls on all of
  them alike, not on whichever ran first.

  Args:
    states: ``{name: training state}``.
    step_fn: ``(state, batch, rng) -> (state, loss)``.
    batch_at: ``i -> the batch of step i``.
    steps: how many steps each optimizer takes.
    seed: the random keys' seed.

  Returns:
    ``{name: (final state, per-step losses, per-step wall times in
    seconds)}``, each step waited for (the first includes compilation).
  """
  states, rng = dict(states), jax.random.key(seed + 1)
  losses = {name: [] for name in states}
  seconds = {name: [] for name in states}
  bar = tqdm(range(steps), desc=" / ".join(states), unit="step", dynamic_ncols=True)
  for i in bar:
    rng, step_rng = jax.random.split(rng)
    batch = batch_at(i)
    for name in states:
      start = time.perf_counter()
      states[name], loss = step_fn(states[name], batch, step_rng)
      losses[name].append(float(loss))  # waits for the step
      seconds[name].append(time.perf_counter() - start)
    if i % 20 == 0 or i == steps - 1:
      bar.set_postfix({name: f"{values[-1]:.4f}" for name, values in losses.items()})
  return {name: (states[name], np.asarray(losses[name]), np.asarray(seconds[name]))
          for name in states}


# -- evaluation --------------------------------------------------------------


def make_evaluate(logits_fn, loss):
  """``(params, x, y) -> (mean loss, accuracy)`` over a whole data set, with
  ``logits_fn(params, x)`` the model's logits."""
  @jax.jit
  def chunk_sums(params, x, y):
    logits = logits_fn(params, x)
    return (jnp.sum(loss.nll(logits, y)),
            jnp.sum(jnp.argmax(logits, axis=-1) == y))

  def evaluate(params, x, y):
    total_loss, correct = 0.0, 0
    for start in range(0, len(x), EVAL_CHUNK):
      chunk_loss, chunk_correct = chunk_sums(
          params, x[start:start + EVAL_CHUNK], y[start:start + EVAL_CHUNK])
      total_loss += float(chunk_loss)
      correct += int(chunk_correct)
    return total_loss / len(x), correct / len(x)
  return evaluate


def make_text_evaluate(apply_fn, loss, seq_len):
  """``(params, ids, starts) -> mean per-character loss`` over the windows
  of ``seq_len`` characters that start at ``starts`` (`datasets.windows`)."""
  @jax.jit
  def chunk_sum(params, x, y):
    return jnp.sum(loss.nll(apply_fn({"params": params}, x), y))

  def evaluate(params, ids, starts):
    total = 0.0
    for first in range(0, len(starts), EVAL_WINDOWS):
      x, y = datasets.windows(ids, starts[first:first + EVAL_WINDOWS], seq_len)
      total += float(chunk_sum(params, x, y))
    return total / (len(starts) * seq_len)
  return evaluate


def summarize_runs(trained, params_of, evaluate, data):
  """Metrics of each optimizer's run of `train`.

  Args:
    trained: `train`'s result.
    params_of: ``state -> params``.
    evaluate: ``(params, x, y) -> (mean loss, accuracy)``.
    data: ``(x_train, y_train, x_test, y_test)``.

  Returns:
    ``(results, curves)``: ``results[key]`` (key: the name lowercased,
    without "-") has ``train_loss``, ``train_accuracy``, ``test_loss``,
    ``test_accuracy``, ``last_batch_loss`` (mean over the last 10% of
    steps), ``seconds`` (the steps' wall time, compilation included),
    ``compile_seconds`` (the first step), ``ms_per_step`` and
    ``median_ms_per_step`` (mean and median of the other steps);
    ``curves[name] = (losses, step seconds)``.
  """
  x_train, y_train, x_test, y_test = data
  results, curves = {}, {}
  for name, (state, losses, step_s) in trained.items():
    curves[name] = (losses, step_s)
    params = params_of(state)
    train_loss, train_accuracy = evaluate(params, x_train, y_train)
    test_loss, test_accuracy = evaluate(params, x_test, y_test)
    after_first = step_s[1:] if len(step_s) > 1 else step_s
    results[name.lower().replace("-", "")] = {
        "train_loss": train_loss, "train_accuracy": train_accuracy,
        "test_loss": test_loss, "test_accuracy": test_accuracy,
        "last_batch_loss": float(np.mean(losses[-max(1, len(losses) // 10):])),
        "seconds": float(np.sum(step_s)),
        "compile_seconds": float(step_s[0]),
        "ms_per_step": 1e3 * float(np.mean(after_first)),
        "median_ms_per_step": 1e3 * float(np.median(after_first)),
    }
  return results, curves


# -- the loss curves ---------------------------------------------------------


def trailing_mean(values, window):
  """Mean of the last ``window`` values at every position (fewer at the start).

  Each window summed on its own: differences of a running sum lose a
  finite loss after a huge one (a run that blew up to 1e32 and then fell
  to 1e17 read 0 and "reached" every target).
  """
  values = np.asarray(values, np.float64)
  sums = np.convolve(values, np.ones(window))[:len(values)]
  return sums / np.minimum(np.arange(1, len(values) + 1), window)


def first_reach(smoothed, step_s, target):
  """``(steps, seconds)`` until ``smoothed`` first is <= ``target``, or Nones."""
  hits = np.flatnonzero(np.asarray(smoothed) <= target)
  if not len(hits):
    return None, None
  return int(hits[0]) + 1, float(np.sum(step_s[:hits[0] + 1]))


def time_to_reference_loss(curves, reference, window=SMOOTHING):
  """How soon each run reaches the final loss of the ``reference`` run.

  Args:
    curves: ``{name: (losses, step seconds)}``; the first step's time
      (compilation) is not counted.
    reference: the name whose final smoothed loss is the target.

  Returns:
    ``(target loss, {name: (steps, seconds) or (None, None)})``, losses
    smoothed by their trailing mean over ``window`` steps.
  """
  target = trailing_mean(curves[reference][0], window)[-1]
  return target, {
      name: first_reach(trailing_mean(losses, window), np.r_[0.0, seconds[1:]],
                        target)
      for name, (losses, seconds) in curves.items()}


def report_time_to_reference_loss(curves, reference, names):
  """Prints how soon each of ``names`` reached the ``reference`` run's final
  loss (`time_to_reference_loss`) against the reference's own time.

  Returns:
    ``{name: its seconds / the reference's seconds}``, inf where never.
  """
  target, reached = time_to_reference_loss(curves, reference)
  reference_steps, reference_s = reached[reference]
  print(f"{reference}'s final training loss {target:.4f} (trailing mean of "
        f"{SMOOTHING} batches), first reached by {reference} at step "
        f"{reference_steps} in {reference_s:.2f} s")
  ratios = {}
  for name in names:
    steps, seconds = reached[name]
    ratios[name] = math.inf if seconds is None else seconds / reference_s
    print(f"  by {name}: " + ("never" if seconds is None else
                              f"at step {steps} in {seconds:.2f} s "
                              f"({ratios[name]:.2f}x {reference}'s time)"))
  return ratios


def save_plot(path, curves, title, window=SMOOTHING):
  """Saves the training-loss curves ``{label: (losses, step seconds)}`` (log
  y) against steps and against seconds (compilation excluded) to ``path``."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  directory = os.path.dirname(path)
  if directory:
    os.makedirs(directory, exist_ok=True)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for label, (losses, seconds) in curves.items():
    smoothing = max(1, min(window, len(losses) // 10))  # per curve
    for ax, x in zip(axes, (np.arange(1, len(losses) + 1),
                            np.cumsum(np.r_[0.0, seconds[1:]]))):
      line, = ax.plot(x, trailing_mean(losses, smoothing),
                      label=f"{label} (trailing mean of {smoothing})")
      ax.plot(x, losses, color=line.get_color(), alpha=0.2, linewidth=0.8)
  for ax, label in zip(axes, ("step", "training time (s, compilation excluded)")):
    ax.set(xlabel=label, yscale="log",
           ylabel="training loss (mini-batch cross-entropy)")
    ax.grid(True, which="both", alpha=0.3)
  axes[0].legend()
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
