"""The models of the stability suite, each a ready-to-train `Problem`.

Nine small models on local data (nothing is downloaded): sklearn's digits,
Fashion-MNIST downsampled to 14x14 (digits when the Debian package is
absent), and the character text of `examples/transformer_lm.py`
(``datasets.load_text`` of the examples). Each is built by name with
`make_problem`, so tests can train one model without the suite::

  from benchmarks import stability_problems as sp
  problem = sp.make_problem("cnn_bn_dropout")
  tx = problem.kfac(learning_rate=None, momentum=None, adaptive_damping=True)
  state, losses = sp.train(problem, tx, steps=300)

Models with BatchNorm carry ``batch_stats`` in `TrainingState.variables`,
update them in their own loss (the Flax way) and hand them to K-FAC as
``tx.update(..., variables=...)``; models with dropout draw it from the
step's key, and K-FAC gets its own key (``rng=``).
"""

import dataclasses
import functools
import math
import operator
import os
import sys
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import kfac_optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # pylint: disable=wrong-import-position
from benchmarks.autoencoder import Autoencoder  # pylint: disable=wrong-import-position
from examples import datasets  # pylint: disable=wrong-import-position
from examples import models  # pylint: disable=wrong-import-position

# Examples per data set: full runs cycle through a few epochs in 300 steps;
# quick runs only need the shapes right.
IMAGES, QUICK_IMAGES = 8192, 256
WINDOWS, QUICK_WINDOWS, SEQ_LEN = 2048, 128, 32
QUICK_BATCH = 32


class TrainingState(NamedTuple):
  """What a training step carries: params, other collections, optimizer state."""
  params: Any
  variables: dict
  opt_state: Any


@dataclasses.dataclass(frozen=True)
class Problem:
  """One model of the suite, with its data, loss and initial variables.

  Attributes:
    name: key in `PROBLEMS` and in the results.
    description: one Markdown sentence: model, loss, data.
    model: the flax module; models with BatchNorm or dropout take ``train``.
    loss: its predictive loss; ``loss.value(outputs, batch)`` is trained.
    inputs: ``batch -> model input``.
    data: a pytree of arrays with a leading example axis.
    batch_size: examples per step.
    params: the initial params (the same for every optimizer).
    variables: the initial other collections (``{"batch_stats": ...}``), or {}.
    apply_kwargs: keywords of every training call (``{"train": True}``), or {}.
  """
  name: str
  description: str
  model: nn.Module
  loss: kfac_optax.losses.PredictiveLoss
  inputs: Callable[[Any], Any]
  data: Any
  batch_size: int
  params: Any
  variables: dict
  apply_kwargs: dict

  def batch(self, indices):
    return jax.tree.map(lambda x: x[indices], self.data)

  @property
  def num_examples(self) -> int:
    return len(jax.tree.leaves(self.data)[0])

  @property
  def example_batch(self):
    return self.batch(np.arange(self.batch_size))

  def outputs(self, params, variables, batch, rng):
    """``(model outputs, updated variables)``; ``rng`` drives dropout."""
    return self.model.apply(
        {"params": params, **variables}, self.inputs(batch),
        **self.apply_kwargs, rngs={"dropout": rng}, mutable=list(variables))

  def loss_fn(self, params, variables, batch, rng):
    """``(training loss, updated variables)``; ``rng`` drives dropout."""
    outputs, new_variables = self.outputs(params, variables, batch, rng)
    return self.loss.value(outputs, batch), new_variables

  def kfac_jax_loss(self, kfac_jax):
    """`loss_fn` for ``kfac_jax.Optimizer``, its loss registered with kfac-jax.

    kfac-jax's interface for state and randomness: ``(params, variables,
    rng, batch) -> (loss, variables)``. kfac-jax scales its curvature by one
    over the batch's leading size B, while `loss.value` averages over all of
    the B·T terms (T positions per example for a language model), so the
    loss is registered on the B·T rows with weight B / (B·T): both then
    describe the same loss.
    """
    register = {kfac_optax.losses.Categorical:
                    kfac_jax.register_softmax_cross_entropy_loss,
                kfac_optax.losses.Bernoulli:
                    kfac_jax.register_sigmoid_cross_entropy_loss}[type(self.loss)]

    def loss_fn(params, variables, rng, batch):
      outputs, new_variables = self.outputs(params, variables, batch, rng)
      targets = self.loss.batch_targets(outputs, batch)
      rows = outputs.reshape(-1, outputs.shape[-1])
      labels = targets.ndim < outputs.ndim  # class labels, not per-output
      register(rows, targets.reshape((-1,) if labels else rows.shape),
               weight=len(outputs) / len(rows))
      return self.loss.value(outputs, batch), new_variables
    return loss_fn

  def kfac(self, **settings) -> optax.GradientTransformationExtraArgs:
    """``kfac_optax.kfac`` for this model; ``settings`` are its keywords."""
    return kfac_optax.kfac(
        self.model.apply, self.loss, example_batch=self.example_batch,
        inputs=self.inputs, apply_kwargs=self.apply_kwargs or None, **settings)

  def init_state(self, tx, params=None) -> TrainingState:
    """A fresh `TrainingState` (own buffers: the step donates it)."""
    params = self.params if params is None else params
    return harness.fresh_copy(TrainingState(params, self.variables, tx.init(params)))

  def train_step(self, tx):
    """A jitted ``(TrainingState, batch, rng) -> (TrainingState, loss)``.

    The loss is the one before the update. Adam ignores ``batch``, ``rng``
    and ``variables``; K-FAC gets the variables the gradients were taken at.
    """
    def step(state, batch, rng):
      dropout_rng, kfac_rng = jax.random.split(rng)
      (value, variables), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(
          state.params, state.variables, batch, dropout_rng)
      updates, opt_state = tx.update(grads, state.opt_state, state.params,
                                     batch=batch, rng=kfac_rng,
                                     variables=state.variables)
      return TrainingState(optax.apply_updates(state.params, updates),
                           variables, opt_state), value
    return jax.jit(step, donate_argnums=0)


def train(problem: Problem, tx, steps: int, seed: int = 0):
  """Trains ``steps`` steps on the suite's batches and keys.

  Returns:
    ``(final TrainingState, losses)``, the losses (before each update) as a
    float64 array of length ``steps``.
  """
  step, state = problem.train_step(tx), problem.init_state(tx)
  batches = harness.Batches(problem, seed)
  losses = []
  with harness.single_threaded_lapack():
    for i in range(steps):
      state, loss = step(state, *batches(i))
      losses.append(loss)
  return state, np.asarray(jax.device_get(losses), np.float64)


# --------------------------------------------------------------------------
# Models (small on purpose: the whole suite runs in minutes on 2 cores)


class BatchNormCNN(nn.Module):
  """conv 3x3 → BN → relu → conv 3x3/2 → BN → relu → avg-pool 2 → dropout → dense."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    for features, stride in ((16, 1), (32, 2)):
      x = nn.Conv(features, (3, 3), strides=stride)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2)).reshape(len(x), -1)
    x = nn.Dropout(0.2, deterministic=not train)(x)
    return nn.Dense(self.num_classes)(x)


class AttentionClassifier(nn.Module):
  """Rows as tokens: dense embedding + learned positions, one pre-LayerNorm
  ``nn.SelfAttention`` block with a residual, mean over tokens, dense readout."""
  num_classes: int = 10
  width: int = 32
  num_heads: int = 4

  @nn.compact
  def __call__(self, x):  # (N, tokens, features)
    positions = self.param("positions", nn.initializers.normal(0.02),
                           x.shape[-2:-1] + (self.width,))
    h = nn.Dense(self.width)(x) + positions
    h = h + nn.SelfAttention(num_heads=self.num_heads, deterministic=True)(
        nn.LayerNorm()(h))
    return nn.Dense(self.num_classes)(h.mean(axis=-2))


class LSTMLM(nn.Module):
  """Character LM: embedding → LSTM (`nn.RNN`, every step a K-FAC row) → dense."""
  vocab_size: int
  embed: int = 24
  hidden: int = 64

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab_size, self.embed)(tokens)
    x = nn.RNN(nn.LSTMCell(self.hidden),
               variable_axes={"kfac_inputs": 0, "kfac_perturbations": 0})(x)
    return nn.Dense(self.vocab_size)(x)


class ResidualBlock(nn.Module):
  """relu(shortcut + BN(conv(relu(BN(conv x))))); a 1x1 conv shortcut when the shape changes."""
  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train,
                             momentum=0.9)
    conv = functools.partial(nn.Conv, self.features, use_bias=False)
    y = nn.relu(norm()(conv((3, 3), self.strides)(x)))
    y = norm()(conv((3, 3))(y))
    if x.shape != y.shape:
      x = norm()(conv((1, 1), self.strides)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """conv stem → BN → relu, one residual block per stage, global mean, dense."""
  num_classes: int = 10
  stages: tuple[int, ...] = (16, 32)

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(self.stages[0], (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    for i, features in enumerate(self.stages):
      x = ResidualBlock(features, 1 if i == 0 else 2)(x, train)
    return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


class GPTBlock(nn.Module):
  """GPT-2 block from stock layers: x + proj(attn(qkv(ln x))), x + mlp(ln x)."""
  width: int
  num_heads: int

  @nn.compact
  def __call__(self, x):
    batch, length, _ = x.shape
    heads = lambda t: t.reshape(batch, length, self.num_heads, -1)
    q, k, v = map(heads, jnp.split(
        nn.Dense(3 * self.width, name="qkv")(nn.LayerNorm(name="ln_1")(x)), 3, -1))
    mask = nn.make_causal_mask(jnp.ones((batch, length)))
    attended = nn.dot_product_attention(q, k, v, mask=mask)
    x = x + nn.Dense(self.width, name="proj")(attended.reshape(x.shape))
    h = nn.gelu(nn.Dense(4 * self.width, name="mlp_in")(nn.LayerNorm(name="ln_2")(x)))
    return x + nn.Dense(self.width, name="mlp_out")(h)


class GPT(nn.Module):
  """Token + position embeddings, GPT-2 blocks, final LayerNorm, tied head."""
  vocab_size: int
  max_length: int
  width: int = 32
  num_heads: int = 2
  num_blocks: int = 2

  @nn.compact
  def __call__(self, tokens):
    wte = nn.Embed(self.vocab_size, self.width, name="wte")
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    x = wte(tokens) + nn.Embed(self.max_length, self.width, name="wpe")(positions)
    for i in range(self.num_blocks):
      x = GPTBlock(self.width, self.num_heads, name=f"block_{i}")(x)
    return wte.attend(nn.LayerNorm(name="ln_f")(x))


class ViT(nn.Module):
  """A small ViT in big_vision's layout: patches by a strided conv, learned
  position embeddings, pre-LayerNorm encoder blocks (attention, GELU MLP),
  a final LayerNorm, the mean over patches, a zero-initialised head.

  As big_vision's does, the head also maps every patch (``logits_2d``,
  sown as an intermediate, which training discards): a call of the head
  that the loss never reads."""
  num_classes: int = 10
  patch: int = 2
  width: int = 32
  depth: int = 2
  num_heads: int = 4

  @nn.compact
  def __call__(self, images):  # (N, H, W) pixels
    x = nn.Conv(self.width, (self.patch, self.patch), strides=self.patch,
                padding="VALID", name="embedding")(images[..., None])
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c) + self.param(
        "pos_embedding", nn.initializers.normal(1 / math.sqrt(c)), (1, h * w, c))
    for i in range(self.depth):
      y = nn.MultiHeadDotProductAttention(
          num_heads=self.num_heads, kernel_init=nn.initializers.xavier_uniform(),
          name=f"attention_{i}")(nn.LayerNorm()(x))
      x = x + y
      y = nn.gelu(nn.Dense(2 * c, name=f"mlp_in_{i}")(nn.LayerNorm()(x)))
      x = x + nn.Dense(c, name=f"mlp_out_{i}")(y)
    x = nn.LayerNorm(name="encoder_norm")(x)
    head = nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")
    self.sow("intermediates", "logits_2d", head(x.reshape(n, h, w, c)))
    return head(x.mean(axis=1))


# --------------------------------------------------------------------------
# Data (local files only)


def digits(size=None):
  """sklearn's 8x8 digits (training part): ``(N, 8, 8)`` pixels, labels."""
  x, y, _, _ = datasets.load_digits()
  return x[:size].reshape(-1, 8, 8), y[:size]


def small_images(size):
  """Fashion-MNIST 2x2-mean-pooled to 14x14 (digits 8x8 without it):
  ``(N, side, side)`` pixels in [0, 1], labels, and a description."""
  x, y, _, _, description = datasets.load_classification()
  side = math.isqrt(x.shape[1])
  x = x[:size].reshape(-1, side, side)
  if side == 28:
    x = x.reshape(-1, 14, 2, 14, 2).mean(axis=(2, 4))
    description = description.replace("28x28", "pooled to 14x14")
  return x, y[:size], description


@functools.cache
def text_windows(count):
  """``count`` non-overlapping character windows of the example text,
  spread over its training part: inputs and next-character targets, both
  ``(count, SEQ_LEN)``, and the vocabulary size."""
  text, _ = datasets.load_text()
  vocab = datasets.Vocabulary(text)
  ids, _ = datasets.split_text(vocab.encode(text))
  starts = datasets.evaluation_starts(len(ids), SEQ_LEN, count)
  return datasets.windows(ids, starts, SEQ_LEN), len(vocab)


# --------------------------------------------------------------------------
# The suite


def _problem(name, description, model, loss, inputs, data, batch_size, seed,
             train_flag=False):
  """A `Problem` with the model initialised on its example batch."""
  apply_kwargs = {"train": True} if train_flag else {}
  first = jax.tree.map(lambda x: x[:batch_size], data)
  initial = model.init(jax.random.key(seed), inputs(first))
  return Problem(name, description, model, loss, inputs, data, batch_size,
                 params=initial["params"],
                 variables={k: v for k, v in initial.items() if k != "params"},
                 apply_kwargs=apply_kwargs)


def mlp(quick, seed):
  x, y, description = small_images(QUICK_IMAGES if quick else IMAGES)
  return _problem(
      "mlp", f"MLP {x[0].size}-128-64-10 (tanh), softmax cross-entropy; "
      f"{description}, {len(x)} images.",
      models.MLP(hidden=(128, 64)), kfac_optax.losses.softmax_cross_entropy(),
      operator.itemgetter(0), (x.reshape(len(x), -1), y),
      QUICK_BATCH if quick else 128, seed)


def cnn_bn_dropout(quick, seed):
  x, y = digits(QUICK_IMAGES if quick else None)
  return _problem(
      "cnn_bn_dropout", "CNN conv16-BN-conv32/2-BN-pool-dropout 0.2-dense, "
      f"dict batches; sklearn digits, {len(x)} images.",
      BatchNormCNN(),
      kfac_optax.losses.softmax_cross_entropy(targets=lambda b: b["label"]),
      lambda b: b["image"], {"image": x[..., None], "label": y},
      QUICK_BATCH if quick else 64, seed, train_flag=True)


def self_attention(quick, seed):
  x, y = digits(QUICK_IMAGES if quick else None)
  return _problem(
      "self_attention", "nn.SelfAttention classifier (width 32, 4 heads; "
      "8 rows of 8 pixels as tokens); sklearn digits, "
      f"{len(x)} images.",
      AttentionClassifier(), kfac_optax.losses.softmax_cross_entropy(),
      operator.itemgetter(0), (x, y), QUICK_BATCH if quick else 64, seed)


def _text_problem(name, description, make_model, quick, seed):
  data, vocab_size = text_windows(QUICK_WINDOWS if quick else WINDOWS)
  return _problem(
      name, f"{description}; per-character cross-entropy on "
      f"{len(data[0])} windows of {SEQ_LEN} characters of the pydoc topics.",
      make_model(vocab_size), kfac_optax.losses.softmax_cross_entropy(),
      operator.itemgetter(0), data, QUICK_BATCH if quick else 32, seed)


def transformer(quick, seed):
  return _text_problem(
      "transformer_lm", "examples/transformer_lm.py's model, width 32, "
      "2 heads, 1 block",
      lambda vocab: models.TransformerLM(
          vocab, SEQ_LEN, width=32, num_heads=2, num_blocks=1), quick, seed)


def lstm(quick, seed):
  return _text_problem("lstm_lm", "character LSTM (embedding 24, 64 units)",
                       LSTMLM, quick, seed)


def autoencoder(quick, seed):
  x, _, description = small_images(QUICK_IMAGES if quick else IMAGES)
  model = Autoencoder(hidden=(128, 64, 32), code=8)
  pixels = x[0].size
  return _problem(
      "autoencoder", f"deep autoencoder {pixels}-128-64-32-8-32-64-128-"
      f"{pixels} (benchmarks/autoencoder.py's, smaller), sigmoid "
      f"cross-entropy; {description}, {len(x)} images.",
      model, kfac_optax.losses.sigmoid_cross_entropy(targets=lambda b: b),
      lambda b: b, x.reshape(len(x), -1), QUICK_BATCH if quick else 128, seed)


def resnet(quick, seed):
  x, y, description = small_images(QUICK_IMAGES if quick else IMAGES)
  return _problem(
      "resnet", "ResNet: conv16 stem, residual blocks of 16 and 32/2 "
      f"channels with BatchNorm, global mean; {description}, {len(x)} images.",
      ResNet(), kfac_optax.losses.softmax_cross_entropy(),
      operator.itemgetter(0), (x[..., None], y),
      QUICK_BATCH if quick else 64, seed, train_flag=True)


def vit(quick, seed):
  x, y, description = small_images(QUICK_IMAGES if quick else IMAGES)
  return _problem(
      "vit", "ViT in big_vision's layout (2x2 patches, width 32, 4 heads, "
      "2 blocks, learned positions, mean pooling, zero-initialised head "
      f"also applied to every patch); {description}, {len(x)} images.",
      ViT(), kfac_optax.losses.softmax_cross_entropy(), operator.itemgetter(0),
      (x, y), QUICK_BATCH if quick else 64, seed)


def gpt(quick, seed):
  return _text_problem(
      "gpt_lm", "GPT-2-style LM from stock layers (width 32, 2 heads, "
      "2 blocks, fused qkv Dense, tied Embed.attend head)",
      lambda vocab: GPT(vocab, SEQ_LEN), quick, seed)


PROBLEMS: dict[str, Callable[[bool, int], Problem]] = {
    "mlp": mlp, "cnn_bn_dropout": cnn_bn_dropout,
    "self_attention": self_attention, "transformer_lm": transformer,
    "lstm_lm": lstm, "autoencoder": autoencoder, "resnet": resnet,
    "gpt_lm": gpt, "vit": vit}


def make_problem(name: str, *, quick: bool = False, seed: int = 0) -> Problem:
  """The suite's model ``name`` (a key of `PROBLEMS`) with its data.

  Args:
    name: e.g. ``"cnn_bn_dropout"`` or ``"self_attention"``.
    quick: a few hundred examples and batches of `QUICK_BATCH` (same model).
    seed: the params' initialisation seed.
  """
  if name not in PROBLEMS:
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(PROBLEMS)}")
  return PROBLEMS[name](quick, seed)
