"""What every benchmark shares: contenders, a fair timed race, and the reports.

A benchmark script describes its `Workload` (model, loss, data) and its
targets (`Goal`: a measured ratio and its bound), then calls `main`.
Everything else is here, so that every workload is measured the same way:

- Contenders: ``kfac_optax.kfac`` with fixed learning rate and damping
  (momentum 0.9); optionally a tuned kfac_optax (its own complete settings
  over `kfac`'s defaults) and one with adaptive
  learning rate, momentum and damping (kfac-jax's adaptive settings);
  ``optax.adam`` at several learning rates; the peers a JAX user would pick
  instead (`PEER_FAMILIES`), each at several learning rates: Muon
  (``optax.contrib.muon``, its kernels given the dimension numbers a user
  would write, `muon_dimension_numbers`; the other params on Adam at the
  workload's best Adam rate) and Schedule-Free AdamW
  (``optax.contrib.schedule_free_adamw``; its loss is taken at the point
  its gradient is, as for every contender); the Kronecker-factored peers
  PSGD Kron and Distributed Shampoo where they run (`optional_peers`; they
  set no target); kfac-jax with matched settings
  (same learning rate, momentum, damping, curvature EMA, inverse period and
  estimation mode) and with its adaptive learning rate, momentum and damping
  as in its own autoencoder example. kfac-jax is optional:
  without it the others run and the report says why it is missing.
- Fairness: every contender starts from the same parameters and sees the same
  batches in the same order with the same per-step random key. A discarded
  warm-up run per contender compiles everything (its first step is the
  compile time). In each timed run the contenders' steps are interleaved
  round-robin (step i of all of them before step i+1 of any, the first one
  rotating), each step timed on its own up to ``block_until_ready``, so slow
  drifts of machine speed hit all of them alike; timed runs are repeated and
  every timing is the median over the repeats.
- BLAS threads: jaxlib's CPU Cholesky and eigh call SciPy's OpenBLAS. With its
  default threads on 2 cores a 257x257 eigh took ~120 ms instead of 5 ms, and
  concurrent LAPACK calls in one XLA program could stall for seconds or
  deadlock. Every contender runs with one OpenBLAS thread (XLA's own matmuls
  do not use OpenBLAS); the report records the thread counts in effect.
- Losses are the mini-batch training losses before each update; "smoothed" is
  their trailing mean over `WINDOW` steps. Target losses are the lowest
  smoothed loss any peer (Adam, Muon, Schedule-Free AdamW) had at given
  steps; the time to a target is the sum of step times (compilation
  excluded) until a contender's smoothed loss first reaches it, and every
  contender's ratio is to the time of the peer that set the target. The
  wall-clock target (a peer's loss when its budget ran out, and everyone's
  time to it) smooths over `BUDGET_WINDOW` steps:
  with 10, a dip of Adam's curve set both its final loss and, when its
  curve had flattened, the first time it touched that loss (the convnet's
  ratio was 0.27 in one run and 0.55 in the next; with 50, 0.36 and 0.50).
- Accelerators: on a GPU (or any non-CPU backend) the results go to their
  own files and RESULTS.md sections, ``<name>_gpu`` (`backend_suffix`).
"""

import argparse
import ast
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import sys
import time
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_optax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script: make `examples` importable
  sys.path.insert(0, REPO_ROOT)
from benchmarks import optional_peers  # pylint: disable=wrong-import-position
from examples import side_by_side  # pylint: disable=wrong-import-position
from examples.cpu_threads import single_threaded_lapack  # pylint: disable=wrong-import-position

RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
RESULTS_MD = os.path.join(REPO_ROOT, "benchmarks", "RESULTS.md")
COMPAT_PATH = os.path.normpath(
    os.path.join(REPO_ROOT, "..", "shared", "bench", "kfac_jax_compat.py"))
KFAC_JAX_VERSION = "0.0.8"
KFAC_JAX_MATCHED = "kfac-jax (matched)"
WINDOW = 10
BUDGET_WINDOW = 50
NEVER = 10**9  # a refresh period: once at step 0, then never
WARMUP_STEPS = 6  # past the first inverse refresh after step 0 (period 5)
# kfac-jax's examples/autoencoder_mnist/pipeline.py (no burn-in, no L2).
KFAC_JAX_ADAPTIVE = dict(
    use_adaptive_learning_rate=True, use_adaptive_momentum=True,
    use_adaptive_damping=True, initial_damping=150.0,
    damping_adaptation_decay=0.95, damping_adaptation_interval=5,
    min_damping=1e-5, max_damping=1000.0, curvature_ema=0.95,
    inverse_update_period=5)
# The same controls in kfac_optax: quadratic-model learning rate and momentum,
# Levenberg-Marquardt damping.
KFAC_OPTAX_ADAPTIVE = dict(
    learning_rate=None, momentum=None, adaptive_damping=True,
    damping=KFAC_JAX_ADAPTIVE["initial_damping"],
    ema_decay=KFAC_JAX_ADAPTIVE["curvature_ema"],
    **{k: KFAC_JAX_ADAPTIVE[k] for k in (
        "damping_adaptation_decay", "damping_adaptation_interval",
        "min_damping", "max_damping", "inverse_update_period")})
# The README's recommended settings for wall-clock speed, the same on every
# workload (chosen by benchmarks/studies/recipe_sweep.py): the
# fixed-learning-rate mode (KL clipping 1e-3, inverse="auto") with learning
# rate and damping 1e-3, statistics every 10 steps, inverses every 50.
RECIPE_NAME = "kfac_optax (recipe)"
# The workload's own settings on top of the recipe (the README's advice).
TUNED_NAME = "kfac_optax (tuned)"
RECIPE = dict(learning_rate=1e-3, damping=1e-3, stats_update_period=10,
              inverse_update_period=50)
# The optimizers a JAX user would pick instead of K-FAC; the targets are the
# best of them.
PEER_FAMILIES = ("adam", "muon", "schedule_free_adamw")
_KFAC_JAX_ESTIMATION = {"fisher": "fisher_gradients", "empirical": "empirical",
                        "exact": "fisher_exact"}


@dataclasses.dataclass(frozen=True)
class Workload:
  """What a benchmark trains.

  Attributes:
    name: file stem of its results and key of its RESULTS.md section.
    title: heading of that section.
    description: one Markdown sentence: model, loss, data.
    model: the flax module.
    loss: its predictive loss; ``loss.value(outputs, batch)`` is trained.
    inputs: ``batch -> model input``.
    register_kfac_jax_loss: ``(kfac_jax, outputs, batch) -> None``, the same
      loss in kfac-jax's terms.
    data: a pytree of arrays with a leading example axis; a batch is the
      tree indexed by example indices.
    batch_size: examples per step.
    mutable: the collections other than params that a training step updates
      (``("batch_stats",)`` for BatchNorm in training mode).
    kfac_jax_unsupported: why kfac-jax is not run on this workload, or None.
  """
  name: str
  title: str
  description: str
  model: nn.Module
  loss: kfac_optax.losses.PredictiveLoss
  inputs: Callable[[Any], Any]
  register_kfac_jax_loss: Callable[[Any, Any, Any], None] | None
  data: Any
  batch_size: int
  mutable: tuple[str, ...] = ()
  kfac_jax_unsupported: str | None = None

  def batch(self, indices):
    return jax.tree.map(lambda x: x[indices], self.data)

  @property
  def num_examples(self) -> int:
    return len(jax.tree.leaves(self.data)[0])

  def loss_and_state(self, params, model_state, batch):
    """``(loss, updated model_state)``; ``model_state`` holds `mutable`."""
    variables = {"params": params, **model_state}
    if not self.mutable:
      return self.loss.value(self.model.apply(variables, self.inputs(batch)),
                             batch), model_state
    outputs, model_state = self.model.apply(
        variables, self.inputs(batch), mutable=list(self.mutable))
    return self.loss.value(outputs, batch), model_state

  def loss_fn(self, params, batch):
    return self.loss_and_state(params, {}, batch)[0]


@dataclasses.dataclass(frozen=True)
class Goal:
  """A target: ``row[field] <= limit``, checked for every kfac_optax.

  ``contenders``: the kfac_optax rows it is checked on (None: all of them).
  """
  text: str
  field: str
  limit: float
  contenders: tuple[str, ...] | None = None


# Every workload's targets against the peers (issue 40): never behind the
# best peer at any target, and a first-step compile within twice Adam's.
PEER_GOALS = (
    Goal("worst time to a target (every T-k and B120s) / the best peer's",
         "worst_target_time_vs_peer", 1.0, (RECIPE_NAME, TUNED_NAME)),
    Goal("compile (first step) / the best Adam's", "compile_vs_adam", 2.0),
)


@dataclasses.dataclass
class Contender:
  """One optimizer in the race.

  Attributes:
    name: label in tables, JSON and plot.
    family: "kfac_optax", "kfac_jax" or one of `PEER_FAMILIES`.
    settings: its hyperparameters, as reported.
    start: ``params -> state`` (fresh buffers).
    step: ``(state, batch, rng, step index) -> (state, loss before the update)``.
    max_steps: steps it runs in a timed run (None: all).
  """
  name: str
  family: str
  settings: dict
  start: Callable[[Any], Any]
  step: Callable[[Any, Any, Any, int], tuple[Any, Any]]
  max_steps: int | None = None


@jax.jit
def fresh_copy(tree):
  return jax.tree.map(jnp.copy, tree)


class ModelTrainState(kfac_optax.TrainState):
  """`kfac_optax.TrainState` that also carries the model's `Workload.mutable`."""
  model_state: Any = flax.struct.field(default_factory=dict)


def train_step(workload: Workload):
  """A jitted ``(ModelTrainState, batch, rng) -> (state, loss)``, state donated.

  One step serves every optax contender: `kfac_optax.TrainState` forwards
  ``batch``, ``rng`` (and for a stateful model the ``variables`` the
  gradients were taken at) to ``tx.update``, and Adam ignores them.
  """
  def step(state, batch, rng):
    (value, model_state), grads = jax.value_and_grad(
        workload.loss_and_state, has_aux=True)(state.params, state.model_state,
                                               batch)
    extra = dict(variables=state.model_state) if workload.mutable else {}
    return state.apply_gradients(grads=grads, batch=batch, rng=rng,
                                 model_state=model_state, **extra), value
  return jax.jit(step, donate_argnums=0)


def kfac_optax_tx(workload: Workload, example_batch, **settings):
  """`kfac_optax.kfac` with ``settings``; with ``schedule_free=True`` among
  them, `kfac_optax.schedule_free_kfac` with the others."""
  make = (kfac_optax.schedule_free_kfac if settings.pop("schedule_free", False)
          else kfac_optax.kfac)
  return make(workload.model.apply, workload.loss, example_batch=example_batch,
              inputs=workload.inputs, **settings)


def kfac_optax_contender(name, settings, workload, step, model_state=None,
                         max_steps=None):
  """A kfac_optax contender with ``settings`` (keywords of ``kfac_optax.kfac``)
  that trains by ``step`` (`train_step`)."""
  if "curvature_batch_size" in settings:  # a quick workload's batch is smaller
    settings = {**settings, "curvature_batch_size": min(
        settings["curvature_batch_size"], workload.batch_size)}
  example_batch = workload.batch(np.arange(workload.batch_size))
  return optax_contender(
      name, "kfac_optax", kfac_optax_tx(workload, example_batch, **settings),
      settings, workload, step, model_state, max_steps)


def optax_contender(name, family, tx, settings, workload, step, model_state=None,
                    max_steps=None):
  """A contender that trains with ``tx`` by `train_step`.

  ``model_state``: the initial `Workload.mutable` collections (None: none).
  """
  def start(params):
    return fresh_copy(ModelTrainState.create(
        apply_fn=workload.model.apply, params=params, tx=tx,
        model_state=model_state or {}))
  return Contender(name, family, settings, start,
                   lambda state, batch, rng, i: step(state, batch, rng),
                   max_steps)


def muon_dimension_numbers(params):
  """How a user hands a Flax model's kernels to ``optax.contrib.muon``.

  Muon orthogonalises a matrix ``W`` of ``x @ W``: its reduction (input) and
  output axes. Dense kernels are ``(in, out)``; convolution kernels
  ``(*window, in, out)`` are matrices of the flattened window and input
  channels (as the Muon speedruns reshape them); the attention's
  ``DenseGeneral`` kernels are ``(in, heads, head_dim)`` for query, key and
  value and ``(heads, head_dim, out)`` for its output (linen's attention
  names them so; a workload with another ``DenseGeneral`` layout needs its
  rule here). Embeddings, biases and scales go to Adam, as in Muon's own
  recipe.
  """
  muon = optax.contrib.MuonDimensionNumbers

  def dims(path, leaf):
    names = [getattr(key, "key", str(key)) for key in path]
    if names[-1] != "kernel" or leaf.ndim < 2:
      return None
    if leaf.ndim == 3 and names[-2] in ("query", "key", "value"):
      return muon(0, (1, 2))
    if leaf.ndim == 3 and names[-2] == "out":
      return muon((0, 1), 2)
    return muon(tuple(range(leaf.ndim - 1)), leaf.ndim - 1)
  return jax.tree_util.tree_map_with_path(dims, params)


def family_label(family):
  """How reports name an optimizer family (``schedule_free_adamw`` ->
  ``schedule-free-adamw``)."""
  return family.replace("_", "-")


def rate_grid(family, make, rates, workload, step, model_state=None):
  """``family``'s contenders, one per learning rate of ``rates``, each
  training with ``make(rate)`` by ``step``."""
  return [optax_contender(f"{family_label(family)} lr={lr:g}", family, make(lr),
                          dict(learning_rate=lr), workload, step, model_state)
          for lr in rates]


def peer_contenders(workload, args, step, params, model_state=None):
  """Adam, Muon and Schedule-Free AdamW, each at its grid of learning rates.

  Muon's non-matrix params train with Adam at ``args.muon_adam_lr`` (the
  workload's best Adam rate on CPU).
  """
  dims = muon_dimension_numbers(params)
  factories = dict(
      adam=optax.adam,
      muon=lambda lr: optax.contrib.muon(
          lr, adam_learning_rate=args.muon_adam_lr,
          muon_weight_dimension_numbers=dims),
      schedule_free_adamw=optax.contrib.schedule_free_adamw)
  grids = dict(adam=args.adam_lrs, muon=args.muon_lrs,
               schedule_free_adamw=args.schedule_free_lrs)
  return [contender for family in PEER_FAMILIES
          for contender in rate_grid(family, factories[family], grids[family],
                                     workload, step, model_state)]


def optional_contenders(workload, args, step, model_state=None):
  """PSGD Kron and Shampoo at their grids, where they run on ``workload``
  (`optional_peers`: imported, then probed in a child process);
  ``(contenders, {family: why not})``."""
  contenders, unavailable = [], {}
  for family in optional_peers.FAMILIES:
    rates = getattr(args, f"{family}_lrs")
    if not rates:
      continue
    make, reason = optional_peers.load(family)
    reason = reason or optional_peers.probe(workload.name, family, rates[0],
                                            args.large)
    if reason:
      unavailable[family] = reason
      continue
    contenders += rate_grid(family, make, rates, workload, step, model_state)
  return contenders, unavailable


def backend_suffix() -> str:
  """``""`` on CPU, ``"_gpu"`` (the backend's name) elsewhere.

  Results of an accelerator go to their own files and RESULTS.md sections
  (``autoencoder_gpu.json``, ...), never over the CPU ones.
  """
  backend = jax.default_backend()
  return "" if backend == "cpu" else f"_{backend}"


def accelerator() -> str | None:
  """The accelerator's name (e.g. ``NVIDIA H100 80GB HBM3``); None on CPU."""
  return None if jax.default_backend() == "cpu" else jax.devices()[0].device_kind


def import_kfac_jax(mode: str = "auto"):
  """``(kfac_jax, None)``, or ``(None, why not)``; mode "require" raises instead.

  kfac-jax 0.0.8 needs ``../shared/bench/kfac_jax_compat.py`` imported first
  to run on current JAX.
  """
  if mode == "skip":
    return None, "skipped on request (--kfac-jax skip)"
  if importlib.util.find_spec("kfac_jax") is None:
    reason = "kfac-jax is not installed (pip install -e '.[bench]')"
  elif not os.path.isfile(COMPAT_PATH):
    reason = f"its compatibility adapter {COMPAT_PATH} is missing"
  else:
    try:
      sys.path.insert(0, os.path.dirname(COMPAT_PATH))
      import kfac_jax_compat  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
      import kfac_jax  # pylint: disable=import-outside-toplevel
      return kfac_jax, None
    except Exception as error:  # pylint: disable=broad-except
      reason = f"importing kfac-jax failed: {type(error).__name__}: {error}"
  if mode == "require":
    raise RuntimeError(reason)
  return None, reason


def kfac_jax_loss(workload: Workload, kfac_jax):
  """``workload``'s ``(params, batch) -> loss`` with its loss registered in kfac-jax."""
  def loss_fn(params, batch):
    outputs = workload.model.apply({"params": params}, workload.inputs(batch))
    workload.register_kfac_jax_loss(kfac_jax, outputs, batch)
    return workload.loss.value(outputs, batch)
  return loss_fn


def kfac_jax_contender(name, kfac_jax, loss_fn, example_batch, seed, *,
                       settings, optimizer_kwargs, step_kwargs, max_steps=None,
                       func_state=None):
  """A contender that trains with ``kfac_jax.Optimizer`` (no burn-in, no L2).

  Args:
    loss_fn: the training loss, its loss registered in kfac-jax:
      ``(params, batch) -> loss``, or for models with other collections or
      dropout (``func_state`` given) ``(params, func_state, rng, batch) ->
      (loss, func_state)``, kfac-jax's interface for state and randomness.
    func_state: the initial other collections (e.g. ``{"batch_stats": ...}``;
      ``{}`` for dropout alone), or None.

  The contender's state is ``(params, opt_state)``, then ``func_state``.
  """
  stateful = func_state is not None
  optimizer = kfac_jax.Optimizer(
      value_and_grad_func=jax.value_and_grad(loss_fn, has_aux=stateful),
      l2_reg=0.0, value_func_has_state=stateful, value_func_has_rng=stateful,
      num_burnin_steps=0, multi_device=False, **optimizer_kwargs)
  step_kwargs = {k: jnp.asarray(v, jnp.float32) for k, v in step_kwargs.items()}

  def start(params):
    params = fresh_copy(params)  # kfac-jax donates them
    state = fresh_copy(func_state) if stateful else None
    opt_state = optimizer.init(params, jax.random.key(seed), example_batch, state)
    return (params, opt_state) + ((state,) if stateful else ())

  def step(state, batch, rng, i):
    *state, stats = optimizer.step(
        state[0], state[1], rng, batch=batch,
        func_state=state[2] if stateful else None, global_step_int=i,
        **step_kwargs)
    return tuple(state), stats["loss"]

  return Contender(name, "kfac_jax", settings, start, step, max_steps)


def make_contenders(workload, args, kfac_jax, params, model_state=None):
  """All contenders of the race, in table order.

  In a wall-clock race (``args.budget_s``) the contenders paired with kfac-jax
  (kfac_optax at matched settings, kfac_optax (adaptive)) and kfac-jax's stop
  after ``args.matched_steps``: they are there for the per-step comparison,
  the others race for the targets.
  """
  example_batch = workload.batch(np.arange(workload.batch_size))
  step = train_step(workload)

  def ours(name, settings, max_steps=None):
    return kfac_optax_contender(name, settings, workload, step, model_state,
                                max_steps)

  kfac = dict(learning_rate=args.kfac_lr, damping=args.kfac_damping,
              momentum=args.kfac_momentum, ema_decay=0.95,
              inverse_update_period=args.inverse_period, estimation="fisher",
              inverse=args.kfac_inverse,
              norm_constraint=None)  # matched with kfac-jax: no KL clipping
  contenders = [ours("kfac_optax", kfac, args.matched_steps)] if args.matched else []
  if args.recipe:
    contenders.append(ours(RECIPE_NAME, RECIPE))
  if args.tuned:
    contenders.append(ours(TUNED_NAME, args.tuned))
  if args.adaptive:
    contenders.append(ours("kfac_optax (adaptive)", {**kfac, **KFAC_OPTAX_ADAPTIVE},
                           args.matched_steps))
  contenders += peer_contenders(workload, args, step, params, model_state)
  if kfac_jax is not None:
    loss_fn = kfac_jax_loss(workload, kfac_jax)
    matched = dict(curvature_ema=kfac["ema_decay"],
                   inverse_update_period=kfac["inverse_update_period"],
                   estimation_mode=_KFAC_JAX_ESTIMATION[kfac["estimation"]])
    fixed = dict(learning_rate=kfac["learning_rate"],
                 momentum=kfac["momentum"], damping=kfac["damping"])
    contenders.append(kfac_jax_contender(
        KFAC_JAX_MATCHED, kfac_jax, loss_fn, example_batch, args.seed,
        settings={**fixed, **matched}, optimizer_kwargs=matched,
        step_kwargs=fixed, max_steps=args.kfac_jax_steps or args.matched_steps))
    contenders.append(kfac_jax_contender(
        "kfac-jax (adaptive)", kfac_jax, loss_fn, example_batch, args.seed,
        settings=KFAC_JAX_ADAPTIVE, optimizer_kwargs=KFAC_JAX_ADAPTIVE,
        step_kwargs={}, max_steps=args.kfac_jax_steps or args.matched_steps))
  return contenders


# --------------------------------------------------------------------------
# The race


class Batches:
  """Device batch and random key of every step, the same for all contenders.

  The batches are those of the examples' ``side_by_side.batch_order`` (a fresh
  permutation each epoch, the ragged end dropped), drawn as far as a race
  gets: a wall-clock race has no step count known in advance.
  """

  def __init__(self, workload: Workload, seed: int):
    self.workload, self.key, self.cached = workload, jax.random.key(seed + 1), {}
    self.per_epoch = workload.num_examples // workload.batch_size
    if self.per_epoch == 0:
      raise ValueError(f"batch size {workload.batch_size} exceeds the "
                       f"{workload.num_examples} examples")
    self.rng, self.epochs = np.random.default_rng(seed), []

  def indices(self, i):
    epoch, position = divmod(i, self.per_epoch)
    while len(self.epochs) <= epoch:
      self.epochs.append(self.rng.permutation(self.workload.num_examples))
    size = self.workload.batch_size
    return self.epochs[epoch][position * size:(position + 1) * size]

  def __call__(self, i):
    if i not in self.cached:  # keep only the current step's
      self.cached = {i: jax.block_until_ready((
          jax.device_put(self.workload.batch(self.indices(i))),
          jax.random.fold_in(self.key, i)))}
    return self.cached[i]


def timed_step(contender, state, i, batches):
  batch, rng = batches(i)
  start = time.perf_counter()
  state, loss = jax.block_until_ready(contender.step(state, batch, rng, i))
  return state, float(loss), time.perf_counter() - start


def warm_up(contenders, params, batches, steps):
  """Compiles every contender on a discarded run.

  Returns:
    ``({name: compile seconds (its first step)}, {name: error})``.
  """
  compile_s, failed = {}, {}
  for contender in contenders:
    try:
      state = contender.start(params)
      for i in range(steps):
        state, _, seconds = timed_step(contender, state, i, batches)
        compile_s.setdefault(contender.name, seconds)
      print(f"  {contender.name:<20} compile (first step) "
            f"{compile_s.get(contender.name, math.nan):6.1f} s", flush=True)
    except Exception as error:  # pylint: disable=broad-except
      failed[contender.name] = f"{type(error).__name__}: {error}"
      print(f"  {contender.name:<20} FAILED: {failed[contender.name]}", flush=True)
  return compile_s, failed


def race(contenders, params, batches, steps, log_every=0, load=None,
         budget_s=None):
  """One timed run, the contenders' steps interleaved round-robin.

  A contender stops after ``steps`` (None: no limit), at its ``max_steps``,
  once its step times add up to ``budget_s`` seconds (None: no limit), or
  when its loss is not finite.

  Returns:
    ``{name: {"step_s": [...], "loss": [...]}}``.
  """
  if steps is None and budget_s is None:
    raise ValueError("a race needs steps or budget_s")
  states = jax.block_until_ready({c.name: c.start(params) for c in contenders})
  record = {c.name: dict(step_s=[], loss=[]) for c in contenders}

  def running(contender, i):
    done = record[contender.name]
    return (i < min(contender.max_steps or math.inf, steps or math.inf)
            and all(map(math.isfinite, done["loss"][-1:]))
            and (budget_s is None or sum(done["step_s"]) < budget_s))

  for i in itertools.count():
    active = [c for c in contenders if running(c, i)]
    if not active:
      break
    shift = i % len(active)
    for contender in active[shift:] + active[:shift]:
      states[contender.name], loss, seconds = timed_step(
          contender, states[contender.name], i, batches)
      record[contender.name]["step_s"].append(seconds)
      record[contender.name]["loss"].append(loss)
    if load is not None and i % 10 == 0:
      load.sample()
    if log_every and (i + 1) % log_every == 0:
      print(f"  step {i + 1:4d}: " + " | ".join(
          f"{c.name} {np.mean(record[c.name]['loss'][-WINDOW:]):.3g} "
          f"{1e3 * np.median(record[c.name]['step_s']):.0f}ms"
          for c in active), flush=True)
  return record


def interleaved_run(workload: Workload, racers, params, steps: int, seed: int,
                    quick: bool, log_every: int = 20):
  """Compiles ``racers`` and races them once for ``steps`` steps (one OpenBLAS
  thread) from ``params``, on ``workload``'s batches of ``seed``.

  Returns:
    ``(environment, load summary, compile seconds, [record])``; raises if a
    contender fails to compile.
  """
  batches = Batches(workload, seed)
  load = LoadSampler()
  with single_threaded_lapack():
    env = environment()
    compile_s, failed = warm_up(racers, params, batches, 1 if quick else WARMUP_STEPS)
    if failed:
      raise RuntimeError(f"contenders failed: {failed}")
    record = race(racers, params, batches, steps, 0 if quick else log_every, load)
  return env, load.summary(), compile_s, [record]


class LoadSampler:
  """The 1-minute load average during the run: other processes skew timings."""

  def __init__(self):
    self.samples = []
    self.sample()

  def sample(self):
    self.samples.append(os.getloadavg()[0])

  def summary(self):
    self.sample()
    return dict(min=min(self.samples), median=float(np.median(self.samples)),
                max=max(self.samples))


# --------------------------------------------------------------------------
# Statistics


def trailing_mean(values, window=WINDOW):
  """Mean of the last ``window`` values at every position (fewer at the start)."""
  return side_by_side.trailing_mean(values, window)


first_reach = side_by_side.first_reach


def ratio(a, b):
  return None if a is None or not b else float(a / b)


def median_or_none(values):
  return None if not values or None in values else float(np.median(values))


def summarize(contenders, records, compile_s, target_steps, key_step,
              budget_s=None):
  """Per-contender rows (timings: medians over the repeats) and the targets.

  Targets: for each step k of ``target_steps`` the lowest smoothed loss any
  peer (`PEER_FAMILIES`) had at step k ("T{k}"); with ``budget_s``, the
  lowest smoothed loss any peer had when its budget ran out ("B{budget_s}s"),
  smoothed over `BUDGET_WINDOW` steps (for every contender's time to it
  too). Each contender's time to a target is compared with the time of the
  peer that set it. Loss curves, final losses and steps to targets come
  from the first repeat (runs are deterministic); seconds to targets are
  medians over repeats.
  """
  rows = {}
  for c in contenders:
    runs = [r[c.name] for r in records if r[c.name]["step_s"]]
    losses = records[0][c.name]["loss"]
    smoothed = trailing_mean(losses)
    rows[c.name] = dict(
        family=c.family, settings=c.settings, steps=len(losses),
        median_ms=median_or_none([1e3 * np.median(r["step_s"]) for r in runs]),
        mean_ms=median_or_none([1e3 * np.mean(r["step_s"]) for r in runs]),
        compile_s=compile_s.get(c.name),
        final_loss=float(smoothed[-1]) if len(losses) else None,
        diverged=bool(len(losses) and not math.isfinite(losses[-1])),
        losses=losses, smoothed=smoothed,
        step_s=records[0][c.name]["step_s"])

  def finished(name):
    return rows[name]["final_loss"] is not None and math.isfinite(
        rows[name]["final_loss"])

  peers = [n for n, r in rows.items() if r["family"] in PEER_FAMILIES
           and finished(n)]
  end_loss = {n: (trailing_mean(rows[n]["losses"], BUDGET_WINDOW)[-1]
                  if budget_s is not None else rows[n]["final_loss"])
              for n in peers}
  best_of = {}  # each peer family's best learning rate, and whether it is
  for family in PEER_FAMILIES:  # at an edge of the grid tried
    grid = [n for n in peers if rows[n]["family"] == family]
    if grid:
      best = min(grid, key=end_loss.get)
      rates = sorted(rows[n]["settings"]["learning_rate"] for n in grid)
      best_of[family] = dict(name=best, loss=float(end_loss[best]),
                             at_grid_edge=len(rates) < 3 or rows[best][
                                 "settings"]["learning_rate"] in (rates[0], rates[-1]))
  adams = [n for n in peers if rows[n]["family"] == "adam"]
  best_adam = min(adams, key=end_loss.get) if adams else None

  def lowest(losses_by_peer, **target):
    if losses_by_peer:
      source = min(losses_by_peer, key=losses_by_peer.get)
      targets.append(dict(target, loss=float(losses_by_peer[source]), source=source))

  targets = []
  for step in target_steps:
    lowest({n: rows[n]["smoothed"][min(step, rows[n]["steps"]) - 1] for n in peers},
           label=f"T{step}", step=step, window=WINDOW)
  if budget_s is not None:
    # The same smoothing as the curves it is reached on: the source peer
    # reaches its own target exactly, not one rounding error short.
    lowest(end_loss, label=f"B{budget_s:g}s", budget_s=budget_s,
           window=BUDGET_WINDOW)
  for name, row in rows.items():
    row["to_target"] = []
    for target in targets:
      reached = [first_reach(trailing_mean(r[name]["loss"], target["window"]),
                             r[name]["step_s"], target["loss"]) for r in records]
      row["to_target"].append(dict(
          steps=reached[0][0], seconds=median_or_none([s for _, s in reached])))
  for target_index, target in enumerate(targets):
    target["source_seconds"] = rows[target["source"]]["to_target"][target_index]["seconds"]

  reference = rows.get(KFAC_JAX_MATCHED, {})
  recipe = rows.get(RECIPE_NAME, {})
  for row in rows.values():
    for stat in ("mean_ms", "median_ms"):
      row[f"{stat[:-3]}_vs_adam"] = ratio(
          row[stat], rows[best_adam][stat] if best_adam else None)
      row[f"{stat[:-3]}_vs_kfac_jax"] = ratio(row[stat], reference.get(stat))
    row["mean_vs_recipe"] = ratio(row["mean_ms"], recipe.get("mean_ms"))
    row["compile_vs_adam"] = ratio(
        row["compile_s"], rows[best_adam]["compile_s"] if best_adam else None)
    times = {t["label"]: ratio(reached["seconds"], t["source_seconds"])
             for t, reached in zip(targets, row["to_target"])}
    row["target_time_vs_peer"] = times
    row["key_target_time_vs_peer"] = times.get(f"T{key_step}")
    row["budget_target_time_vs_peer"] = (
        times.get(f"B{budget_s:g}s") if budget_s is not None else None)
    # The worst ratio over every target; None if one was never reached.
    row["worst_target_time_vs_peer"] = (
        max(times.values()) if times and None not in times.values() else None)
  return rows, dict(best_adam=best_adam, best_of=best_of, targets=targets,
                    key_target_step=key_step, budget_s=budget_s,
                    repeats=len(records), window=WINDOW,
                    budget_window=BUDGET_WINDOW)


def check_goals(goals, rows):
  out = []
  for goal in goals:
    for name, row in rows.items():
      if row["family"] == "kfac_optax" and (
          goal.contenders is None or name in goal.contenders):
        measured = row.get(goal.field)
        if measured is not None:
          met = measured <= goal.limit
        else:  # a target this contender ran for and did not reach is missed
          met = False if "target_time" in goal.field and row["steps"] else None
        out.append(dict(goal=goal.text, contender=name, measured=measured,
                        limit=goal.limit, met=met))
  return out


# --------------------------------------------------------------------------
# Reports


def environment():
  """Machine, versions and the BLAS threads in effect (call inside the limit)."""
  def first_line(path, prefix):
    try:
      with open(path, encoding="utf-8") as f:
        return next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith(prefix)), None)
    except OSError:
      return None

  def version(name):
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return None

  memory = first_line("/proc/meminfo", "MemTotal")
  try:
    import threadpoolctl  # pylint: disable=import-outside-toplevel
    blas = sorted({f"{p['internal_api']} {p['num_threads']} thread(s)"
                   for p in threadpoolctl.threadpool_info()
                   if p["user_api"] == "blas"})
  except ImportError:
    blas = ["threadpoolctl missing: OpenBLAS threads not limited"]
  return dict(
      accelerator=accelerator(),
      cpu=first_line("/proc/cpuinfo", "model name") or platform.machine(),
      cores=len(os.sched_getaffinity(0)),
      memory=f"{int(memory.split()[0]) / 2**20:.1f} GiB" if memory else None,
      os=platform.platform(), python=platform.python_version(),
      devices=[str(d) for d in jax.devices()], blas=blas,
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      # glibc's allocation policy changes CPU step times (RESULTS.md, "Memory
      # allocation on CPU"): record any setting of it.
      malloc={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
      versions={name: version(name) for name in (
          "jax", "jaxlib", "flax", "optax", "numpy", "kfac-jax", "kfac_optax",
          "distributed-kron", "precondition-opt")})


def jsonable(value):
  """NaN/inf -> None, numpy -> Python, recursively."""
  if isinstance(value, dict):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple, np.ndarray)):
    return [jsonable(v) for v in list(value)]
  if isinstance(value, (float, np.floating)):
    return float(value) if math.isfinite(value) else None
  if isinstance(value, np.integer):
    return int(value)
  return value


def write_json(path, payload):
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(jsonable(payload), f, indent=1)


def save_plot(path, rows, targets, title):
  """Training loss against wall-clock time and against steps, every contender."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  for name, row in rows.items():
    if not row["steps"]:
      continue
    for ax, x in zip(axes, (np.cumsum(row["step_s"]),
                            np.arange(1, row["steps"] + 1))):
      line, = ax.plot(x, row["smoothed"], label=name, linewidth=1.3)
      ax.plot(x, row["losses"], color=line.get_color(), alpha=0.15, linewidth=0.6)
  for ax, label in zip(axes, ("wall-clock training time (s, compilation excluded)",
                              "step")):
    for target in targets:
      ax.axhline(target["loss"], color="grey", linestyle=":", linewidth=0.8)
    ax.set(xlabel=label, yscale="log",
           ylabel=f"mini-batch training loss (lines: trailing mean of {WINDOW})")
    ax.grid(True, which="both", alpha=0.3)
  axes[1].legend(fontsize=8)
  fig.suptitle(f"{title} (dotted: target losses)")
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def fmt(value, spec=".1f"):
  return "—" if value is None else format(value, spec)


def markdown_section(payload):
  """The workload's section of RESULTS.md."""
  env, rows, summary = payload["environment"], payload["rows"], payload["summary"]
  config, load = payload["config"], payload["load_average"]
  targets = summary["targets"]
  key_label = (f"B{config['budget_s']:g}s" if config.get("budget_s")
               else f"T{summary['key_target_step']}")
  lines = [
      f"## {payload['title']}", "",
      f"- **Command:** `{payload['command']}` ({payload['date']}, "
      f"{payload['wall_s'] / 60:.1f} min)",
      "- **Machine:** "
      + (f"{env['accelerator']}, host " if env.get("accelerator") else "")
      + f"{env['cpu']}, {env['cores']} cores, {env['memory']}; "
      f"load average during the run {load['min']:.1f}-{load['max']:.1f} "
      f"(median {load['median']:.1f}); BLAS: {', '.join(env['blas'])}",
      "- **Versions:** " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()),
      f"- **Workload:** {payload['description']} Batch {config['batch_size']}, "
      + (f"{config['budget_s']:g} s of step time per contender"
         if config.get("budget_s") else f"{config['steps']} steps")
      + f" per timed run, {summary['repeats']} timed run(s), seed "
      f"{config['seed']}.",
      "- **Protocol:** see `benchmarks/harness.py`: same init, batches and "
      "keys for all; compilation in a discarded warm-up; steps interleaved "
      "round-robin; timings are medians over the timed runs. Mean ms/step "
      "includes the inverse refreshes. Targets T*k* = the lowest smoothed "
      f"(trailing mean of {WINDOW}) loss any peer (Adam, Muon, Schedule-Free "
      "AdamW) had at step *k*"
      + ("; B*s*s = the lowest loss any peer had when its *s* seconds of "
         f"step time ran out, smoothed over {summary['budget_window']} steps "
         "for it and for everyone's time to it" if config.get("budget_s")
         else "")
      + "; cells give steps / seconds to reach it (— = not reached); "
      "\"/ peer\" columns: time to the target over the time of the peer that "
      "set it (the key target and the worst over all targets).",
  ]
  if payload["kfac_jax_unavailable"]:
    lines.append(f"- **kfac-jax not run:** {payload['kfac_jax_unavailable']}")
  lines += [f"- **{family_label(family)} not run:** {reason}" for family, reason
            in payload.get("optional_unavailable", {}).items()]
  lines += [f"- **{name} failed:** `{error}`"
            for name, error in payload["failed"].items()]
  header = ["contender", "median ms/step", "mean ms/step", "compile s",
            "final loss"] + [f"{t['label']} = {t['loss']:.4g}" for t in targets] + [
                f"{key_label} / peer", "worst / peer", "mean / best Adam",
                "compile / best Adam's", "mean / kfac-jax (matched)"]
  lines += ["", "| " + " | ".join(header) + " |",
            "|---|" + "---:|" * (len(header) - 1)]
  for name, row in rows.items():
    final = fmt(row["final_loss"], ".4g") + (" (diverged)" if row["diverged"] else "")
    cells = [name, fmt(row["median_ms"]), fmt(row["mean_ms"]),
             fmt(row["compile_s"]), final]
    cells += [f"{fmt(t['steps'], 'd')} / {fmt(t['seconds'])}" for t in row["to_target"]]
    cells += [fmt(row["target_time_vs_peer"].get(key_label), ".2f"),
              fmt(row["worst_target_time_vs_peer"], ".2f"),
              fmt(row["mean_vs_adam"], ".2f"), fmt(row["compile_vs_adam"], ".2f"),
              fmt(row["mean_vs_kfac_jax"], ".2f")]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Targets set by: " + ", ".join(
      f"{t['label']} {t['source']}" for t in targets) + ". Best of each peer's "
            "grid: " + ", ".join(
                b["name"] + (" (**at the grid's edge**)" if b["at_grid_edge"] else "")
                for b in summary["best_of"].values()) + ". Settings:", ""]
  lines += [f"- {name}: " + ", ".join(f"{k}={v}" for k, v in row["settings"].items())
            + f" ({row['steps']} steps)" for name, row in rows.items()]
  if payload["goals"]:
    lines += ["", "| target | contender | measured | met |",
              "|---|---|---:|---|"]
    lines += [f"| {g['goal']} (<= {g['limit']:g}) | {g['contender']} | "
              f"{fmt(g['measured'], '.2f')} | "
              + ("yes" if g["met"] else "not measured" if g["met"] is None
                 else "**no**" + (" (not reached)" if g["measured"] is None else ""))
              + " |"
              for g in payload["goals"]]
  lines += ["", f"![{payload['name']}](results/{payload['name']}.png) "
            f"Raw data: `benchmarks/results/{payload['name']}.json`."]
  return "\n".join(lines)


def payload_header(name, workload, script, argv=None):
  """What a tool's JSON payload starts with: names, the command that ran
  ``script`` (with ``argv``, default the command line's) and the UTC date."""
  return dict(
      name=name, title=workload.title, description=workload.description,
      command=" ".join([f"python {script}", *(sys.argv[1:] if argv is None else argv)]),
      date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def run_name(workload, large):
  """A workload's run as its results file names it: size and backend."""
  return workload.name + ("_large" if large else "") + backend_suffix()


def run_title(workload, large, env):
  """The workload's title, with its size and the accelerator it ran on."""
  return (workload.title + (" (large)" if large else "")
          + (f" on GPU ({env['accelerator']})" if env["accelerator"] else ""))


def publish(name, payload, section, script=None, write=True,
            out_dir=RESULTS_DIR, markdown=RESULTS_MD):
  """Prints ``section``; with ``write``, saves ``payload`` as
  ``<out_dir>/<name>.json`` and ``section`` as ``name``'s section of
  ``markdown`` (``script``: see `update_markdown`)."""
  if write:
    write_json(os.path.join(out_dir, f"{name}.json"), payload)
    update_markdown(markdown, name, section, script)
  print("\n" + section + "\n", flush=True)


def update_markdown(path, name, section, script=None):
  """Replaces the section between ``name``'s markers in ``path`` (or appends it).

  ``script`` names the writer in the begin marker (default
  ``benchmarks/{name}.py``); a begin marker naming another writer (the
  script's path before it moved) is replaced too.
  """
  script = script or f"benchmarks/{name}.py"
  begin = f"<!-- {name}:begin (written by {script}) -->"
  end = f"<!-- {name}:end -->"
  text = ""
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      text = f.read()
  text = text or ("# Benchmark results\n\nEach section is rewritten by the "
                  "script named in its command.\n")
  block = f"{begin}\n{section}\n{end}"
  found = re.search(re.escape(f"<!-- {name}:begin") + r"[^>]*-->", text)
  if found and end in text[found.end():]:
    text = (text[:found.start()] + block
            + text[found.end():].split(end, 1)[1])
  else:
    text = text.rstrip("\n") + "\n\n" + block + "\n"
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


# --------------------------------------------------------------------------
# Entry point


def parse_args(argv, defaults: dict, description: str):
  """Flags shared by the benchmarks; ``defaults`` sets the workload's values.

  ``defaults`` needs quick_steps, kfac_lr, kfac_damping and muon_adam_lr,
  and may set any other flag's default (``tuned`` as a dict); ``large``:
  the defaults that change at the large size.
  """
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: a smaller workload, a few steps, one "
                      "run, one Adam, results to a temporary directory only")
  parser.add_argument("--steps", type=int, help="timed steps per run (with "
                      "--budget-s: at most)")
  parser.add_argument("--budget-s", type=float, help="seconds of step time "
                      "per contender in a timed run (compilation excluded); "
                      "sets the target B<s>s from the best Adam")
  parser.add_argument("--matched-steps", type=int, help="with --budget-s: "
                      "steps of the contenders paired with kfac-jax")
  parser.add_argument("--repeats", type=int, default=1, help="timed runs")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--kfac-lr", type=float)
  parser.add_argument("--kfac-damping", type=float)
  parser.add_argument("--kfac-momentum", type=float, default=0.9)
  parser.add_argument("--kfac-inverse", default="cholesky",
                      choices=["cholesky", "eigh"],
                      help="cholesky matches kfac-jax's (LU) damped inverses")
  parser.add_argument("--inverse-period", type=int, default=5)
  parser.add_argument("--matched", action=argparse.BooleanOptionalAction,
                      default=True, help="a kfac_optax with the settings "
                      "matched with kfac-jax (--kfac-lr, ...)")
  parser.add_argument("--recipe", action=argparse.BooleanOptionalAction,
                      default=True, help=f"a kfac_optax with the README's "
                      f"recommended settings ({RECIPE})")
  parser.add_argument("--tuned", type=parse_settings,
                      help="a second kfac_optax, e.g. 'learning_rate=0.1,"
                      "damping=1' (kfac_optax.kfac keywords, its defaults "
                      "for the others); 'none': off")
  parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction,
                      default=False, help="a kfac_optax with the adaptive "
                      "controls of the kfac-jax (adaptive) contender")
  rates = lambda s: [] if s == "none" else [float(v) for v in s.split(",")]
  parser.add_argument("--adam-lrs", type=rates, default=[1e-3, 3e-3, 1e-2])
  parser.add_argument("--muon-lrs", type=rates, default=[1e-2, 3e-2, 1e-1])
  parser.add_argument("--muon-adam-lr", type=float, help="Adam's learning "
                      "rate for the params Muon leaves to it (default: the "
                      "workload's best Adam rate)")
  parser.add_argument("--schedule-free-lrs", type=rates, default=[1e-3, 3e-3, 1e-2])
  parser.add_argument("--psgd-kron-lrs", type=rates, help="PSGD Kron's rates "
                      "(default: a third of --muon-adam-lr, its authors' advice "
                      "against Adam's; none with --quick)")
  parser.add_argument("--shampoo-lrs", type=rates, help="Distributed "
                      "Shampoo's rates (default: --muon-adam-lr, its step "
                      "grafted onto AdaGrad's; none with --quick)")
  parser.add_argument("--large", action="store_true", help="the workload's "
                      "large size (an accelerator's: its best Adam step "
                      ">= 5 ms on a GPU), results under <name>_large")
  parser.add_argument("--kfac-jax", default="auto",
                      choices=["auto", "require", "skip"])
  parser.add_argument("--kfac-jax-steps", type=int,
                      help="kfac-jax contenders stop after this many steps")
  parser.add_argument("--target-steps", type=lambda s: [int(v) for v in s.split(",")],
                      default=[30, 60, 120, 240])
  parser.add_argument("--key-target-step", type=int, default=120)
  parser.add_argument("--out-dir", help="JSON and PNG (default benchmarks/results)")
  parser.add_argument("--markdown", help="RESULTS.md to update "
                      "(default benchmarks/RESULTS.md; none with --quick)")
  parser.add_argument("--log-every", type=int, default=20)
  parser.set_defaults(**{k: v for k, v in defaults.items()
                         if k not in ("quick_steps", "large")})
  args = parser.parse_args(argv)
  if args.large:
    parser.set_defaults(**defaults.get("large", {}))
    args = parser.parse_args(argv)
  if args.muon_adam_lr is None:
    raise ValueError("the workload's defaults need muon_adam_lr")
  if args.psgd_kron_lrs is None:
    args.psgd_kron_lrs = [args.muon_adam_lr / 3]
  if args.shampoo_lrs is None:
    args.shampoo_lrs = [args.muon_adam_lr]
  if args.quick:  # one rate of each peer: the others differ only in a number
    args.steps, args.repeats = defaults["quick_steps"], 1
    args.adam_lrs, args.muon_lrs = args.adam_lrs[:1], args.muon_lrs[:1]
    args.schedule_free_lrs = args.schedule_free_lrs[:1]
    args.psgd_kron_lrs, args.shampoo_lrs = [], []
    args.kfac_jax_steps, args.log_every, args.budget_s = None, 0, None
    args.target_steps = sorted({min(s, args.steps) for s in args.target_steps})
    args.key_target_step = args.target_steps[-1]
  if args.budget_s is None:
    args.matched_steps = None
  if args.out_dir is None and not args.quick:
    args.out_dir = RESULTS_DIR
  if args.markdown is None and not args.quick:
    args.markdown = RESULTS_MD
  return args


def parse_settings(text):
  """``"a=1,b=x"`` -> ``{"a": 1, "b": "x"}``; ``"none"`` -> ``{}``."""
  def value(v):
    try:
      return ast.literal_eval(v)
    except (ValueError, SyntaxError):
      return v
  pairs = (item.split("=", 1) for item in text.split(",") if item)
  return {} if text.lower() == "none" else {k: value(v) for k, v in pairs}


def initial_variables(workload: Workload, seed: int):
  """``(params, model_state)``: the model's initial variables, split
  (`init` jitted: one compile instead of one per initializer op)."""
  variables = dict(jax.jit(workload.model.init)(
      jax.random.key(seed),
      workload.inputs(workload.batch(np.arange(workload.batch_size)))))
  params = variables.pop("params")
  return params, {k: variables[k] for k in workload.mutable}


def main(make_workload, goals, defaults, argv=None, script=None):
  """Runs one benchmark end to end; returns its results (the JSON payload).

  Args:
    make_workload: ``(quick, large) -> Workload``.
    goals: the workload's targets (`Goal`s).
    defaults: see `parse_args`.
    argv: command-line arguments (default ``sys.argv[1:]``).
    script: the script's path, for the reported command.
  """
  started = time.perf_counter()
  args = parse_args(argv, defaults, make_workload.__doc__.split("\n")[0])
  command = " ".join(["python", os.path.relpath(script or sys.argv[0], REPO_ROOT),
                      *(sys.argv[1:] if argv is None else argv)])
  workload = make_workload(args.quick, args.large)
  params, model_state = initial_variables(workload, args.seed)
  print(f"{workload.title}: {workload.num_examples} examples, batch "
        f"{workload.batch_size}, " + (f"{args.budget_s:g} s" if args.budget_s
                                      else f"{args.steps} steps")
        + f" x {args.repeats} run(s)", flush=True)
  kfac_jax, unavailable = import_kfac_jax(
      "skip" if workload.kfac_jax_unsupported else args.kfac_jax)
  unavailable = workload.kfac_jax_unsupported or unavailable
  if unavailable:
    print(f"NOTE: kfac-jax not run: {unavailable}", flush=True)
  contenders = make_contenders(workload, args, kfac_jax, params, model_state)
  optional, optional_unavailable = optional_contenders(
      workload, args, train_step(workload), model_state)
  contenders += optional
  for family, reason in optional_unavailable.items():
    print(f"NOTE: {family} not run: {reason}", flush=True)
  batches = Batches(workload, args.seed)
  load = LoadSampler()
  with single_threaded_lapack():
    env = environment()
    print(f"warm-up ({WARMUP_STEPS if not args.quick else 1} steps each, discarded):")
    compile_s, failed = warm_up(contenders, params, batches,
                                1 if args.quick else WARMUP_STEPS)
    if failed and args.kfac_jax == "require":
      raise RuntimeError(f"contenders failed: {failed}")
    contenders = [c for c in contenders if c.name not in failed]
    records = []
    for repeat in range(args.repeats):
      print(f"timed run {repeat + 1}/{args.repeats}:", flush=True)
      records.append(race(contenders, params, batches, args.steps,
                          args.log_every, load, args.budget_s))
  rows, summary = summarize(contenders, records, compile_s, args.target_steps,
                            args.key_target_step, args.budget_s)
  name = run_name(workload, args.large)
  title = run_title(workload, args.large, env)
  payload = dict(
      name=name, title=title, description=workload.description,
      command=command, date=datetime.datetime.now(datetime.timezone.utc).strftime(
          "%Y-%m-%d %H:%M UTC"),
      environment=env, load_average=load.summary(),
      config=dict(steps=args.steps, budget_s=args.budget_s,
                  batch_size=workload.batch_size,
                  num_examples=workload.num_examples, seed=args.seed,
                  quick=args.quick, warmup_steps=WARMUP_STEPS),
      kfac_jax_unavailable=unavailable,
      optional_unavailable=optional_unavailable, failed=failed, rows=rows,
      summary=summary, goals=check_goals(goals, rows))
  if args.out_dir:
    save_plot(os.path.join(args.out_dir, f"{name}.png"), rows,
              summary["targets"], title)
  payload["wall_s"] = time.perf_counter() - started
  if args.out_dir:
    write_json(os.path.join(args.out_dir, f"{name}.json"), payload)
  if args.markdown:
    update_markdown(args.markdown, name, markdown_section(payload),
                    f"benchmarks/{workload.name}.py")
  print("\n" + markdown_section(payload) + "\n")
  print(f"done in {payload['wall_s']:.0f} s", flush=True)
  return payload
