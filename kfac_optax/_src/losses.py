"""Predictive distributions that K-FAC needs to know about the training loss.

Each loss is the negative log-likelihood of a distribution over targets given
the model output ``f``. It reduces its event axis (the last axis of ``f``) and
averages over every leading axis, so a batch holding ``L`` terms (examples, or
examples x positions) has loss ``(1/L) sum_i -log p(y_i | f_i)``.

Besides its value, K-FAC needs from a loss: samples ``y ~ p(y|f)``
(``estimation="fisher"``), a square root of the output Fisher
``F_out = E_y[∇_f log p ∇_f log pᵀ]`` (``"exact"``, ``"curvature_prop"``),
the gradient of the summed NLL with respect to ``f`` (every mode), and the
product ``F_out u`` (exact curvature-vector products).
"""

import dataclasses
import math
from typing import Any, Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_optax._src.linalg import precision

Batch = Any
Estimation = str
ESTIMATIONS = ("fisher", "empirical", "exact", "curvature_prop")


def batch_element(batch: Batch, index: int, argument: str, where: str) -> Any:
  """``batch[index]``, the default of ``argument=``; a TypeError naming that
  argument if the batch is not a tuple or list that long."""
  if isinstance(batch, (tuple, list)) and len(batch) > index:
    return batch[index]
  got = (f"has {len(batch)} element(s)" if isinstance(batch, (tuple, list))
         else f"is not a tuple or list (its type: {type(batch).__name__})")
  raise TypeError(f"the default `{argument}` reads batch[{index}], but the "
                  f"batch {got}; pass {argument}=lambda batch: ... to {where}")


def _second_element(batch: Batch) -> jax.Array:
  return batch_element(batch, 1, "targets", "the loss")


def _zero_where_masked(targets: jax.Array, mask: jax.Array) -> jax.Array:
  """``targets`` with 0 where ``mask`` (the terms' or, per unit, the
  targets' shape) is 0."""
  counted = jnp.reshape(mask, jnp.shape(mask) + (1,) * (
      jnp.ndim(targets) - jnp.ndim(mask))) != 0
  return jnp.where(counted, targets, jnp.zeros_like(targets))


@dataclasses.dataclass(frozen=True)
class PredictiveLoss:
  """Base class: a negative log-likelihood with sampling and Fisher access.

  Attributes:
    targets: batch -> targets of the loss (default: ``batch[1]``).
    mask: batch -> which terms count (shape ``outputs.shape[:-1]``, e.g. a
      per-token padding mask), or None for all. Masked terms leave the loss,
      its gradients and every K-FAC statistic (see `Terms`). Non-negative
      weights work too: the loss is ``Σ w NLL / Σ w``, and a term of weight
      k enters every statistic as k copies of it would. For a distribution
      independent per output unit (``sigmoid_cross_entropy``,
      ``squared_error``) the mask may also have the outputs' shape: each
      unit is then a term of its own (missing labels of a multi-label
      task), the loss ``Σ_units w NLL_unit / Σ w``. A masked term's
      targets may be anything, NaN included (`batch_targets`).
  """

  targets: Callable[[Batch], jax.Array] = _second_element
  mask: Callable[[Batch], jax.Array] | None = None

  # For messages: the factory's name, and what its targets must be.
  NAME: ClassVar[str] = "loss"
  TARGETS: ClassVar[str] = ("targets of the outputs' shape (one output unit "
                            "still has its last axis: y[..., None])")
  INTEGER_TARGETS: ClassVar[bool] = False
  # Independent per output unit (a diagonal output Fisher): a mask may
  # select units.
  PER_UNIT: ClassVar[bool] = False

  # How many arrays of the model's outputs the loss reads (`joint`: several).
  num_outputs: ClassVar[int] = 1
  # Every term's NLL is at least 0, so the loss is: the automatic mode then
  # checks any step whose model predicts a larger decrease than the loss
  # (`optimizer.kfac_step`). False where it can be negative (a learned
  # variance) or is not known (your own distribution, unless you set it).
  nonnegative: ClassVar[bool] = False

  def term_shape(self, outputs: Any) -> tuple:
    """The shape of the loss terms: the outputs' leading axes."""
    return tuple(jnp.shape(outputs)[:-1])

  def target_shape(self, outputs_shape: tuple) -> tuple:
    """The shape ``targets(batch)`` must have for outputs of ``outputs_shape``."""
    return tuple(outputs_shape)

  def batch_targets(self, outputs: jax.Array, batch: Batch) -> jax.Array:
    """`checked_targets`, 0 where the mask is 0.

    A masked target may be anything, NaN included (Flax's ogbg-molpcba
    example marks a missing label so): left in, its NLL and its output
    gradient would be NaN, and the mask's weight 0 times NaN is NaN, in
    the loss and in every empirical statistic.
    """
    targets = self.checked_targets(outputs, batch)
    if self.mask is None:
      return targets
    mask = self.batch_mask(outputs, batch)
    return jax.tree.map(lambda y: _zero_where_masked(y, mask), targets)

  def checked_targets(self, outputs: jax.Array, batch: Batch) -> jax.Array:
    """``targets(batch)``, checked against ``outputs`` at trace time.

    Raises:
      ValueError: naming the loss, both shapes and what ``targets=`` must
        return, if the targets do not fit (instead of broadcasting silently).
    """
    targets = self.targets(batch)
    expected = self.target_shape(jnp.shape(outputs))
    integer = jnp.issubdtype(jnp.result_type(targets), jnp.integer)
    if jnp.shape(targets) != expected or (self.INTEGER_TARGETS and not integer):
      raise ValueError(
          f"{self.NAME}: targets(batch) has shape {jnp.shape(targets)} "
          f"({jnp.result_type(targets)}) for outputs of shape "
          f"{jnp.shape(outputs)}; targets= must return {self.TARGETS}, here "
          f"{expected}")
    return targets

  def batch_mask(self, outputs: jax.Array, batch: Batch) -> jax.Array:
    """``mask(batch)``, checked to have the terms' shape ``outputs.shape[:-1]``
    (or, `PER_UNIT`, the outputs' shape).

    Raises:
      ValueError: if it has another shape (broadcasting would weight the
        wrong terms, or every term by every mask entry).
    """
    mask = self.mask(batch)
    shape = jnp.shape(outputs)
    if jnp.shape(mask) == shape and self.PER_UNIT:
      return mask
    if jnp.shape(mask) != shape[:-1]:
      units = (f" or, one entry per output unit, the outputs' shape {shape}"
               if self.PER_UNIT else
               " (one entry per term: the last axis is the distribution's, so a "
               "mask cannot select parts of it)")
      raise ValueError(
          f"{self.NAME}: mask(batch) has shape {jnp.shape(mask)} for outputs of "
          f"shape {shape}; it must have the shape of the loss terms, "
          f"outputs.shape[:-1] = {shape[:-1]}{units}")
    return mask

  def output_weights(self, outputs: jax.Array, batch: Batch) -> jax.Array | None:
    """The mask's weight of every output unit (broadcastable to
    ``outputs``, negative weights as 0), or None without a mask."""
    if self.mask is None:
      return None
    mask = jnp.maximum(self.batch_mask(outputs, batch).astype(jnp.float32), 0)
    return mask if self.PER_UNIT and mask.ndim == jnp.ndim(outputs) else mask[..., None]

  def nll(self, outputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-term negative log-likelihood, shape ``outputs.shape[:-1]``."""
    raise self._missing("nll", "every use")

  def nll_grad(self, outputs: Any, targets: Any) -> Any:
    """``∂ Σ_terms NLL / ∂f``: the output gradient whose outer products
    estimate the output Fisher (`joint` scales each head's by the square
    root of its weight)."""
    return jax.grad(lambda f: jnp.sum(self.nll(f, targets)))(outputs)

  def sample(self, rng: jax.Array, outputs: jax.Array) -> jax.Array:
    """One draw of targets from the model's predictive distribution."""
    raise self._missing("sample", 'estimation="fisher" (the default)')

  def fisher_sqrt(self, outputs: jax.Array) -> jax.Array:
    """Columns ``B[k]`` (shape ``(C, *outputs.shape)``) with ``Σ_k B_k B_kᵀ = F_out``.

    ``F_out`` is the Fisher of the distribution with respect to ``f``, one
    ``C x C`` matrix per term, ``C = outputs.shape[-1]``.
    """
    raise self._missing("fisher_sqrt", 'estimation="exact" or "curvature_prop"')

  def fisher_product(self, outputs: jax.Array, u: jax.Array) -> jax.Array:
    """``F_out u`` per term, for ``u`` of shape ``(..., *outputs.shape)``."""
    raise self._missing("fisher_product", "kfac's solved steps (learning_rate or "
                        "momentum None), adaptive damping and exact_product")

  def _missing(self, method: str, needed_by: str) -> NotImplementedError:
    """The error for a method a subclass did not define."""
    return NotImplementedError(
        f"{type(self).__name__} does not define {method}, which {needed_by} "
        "needs; a distribution of your own subclasses "
        "kfac_optax.losses.PredictiveLoss and defines nll, sample, fisher_sqrt "
        "and fisher_product (docs/models.md, \"Your own distribution\")")

  def value(self, outputs: jax.Array, batch: Batch) -> jax.Array:
    """The training loss: the mean NLL over the (unmasked) terms of the batch."""
    targets = self.batch_targets(outputs, batch)
    if self.mask is None:
      return jnp.mean(self.nll(outputs, targets))
    mask = self.batch_mask(outputs, batch)
    if self.PER_UNIT and mask.ndim == jnp.ndim(outputs):  # each unit a term
      nll = self.nll(outputs[..., None], targets[..., None])
    else:
      nll = self.nll(outputs, targets)
    mask = mask.astype(nll.dtype)
    return jnp.sum(nll * mask) / jnp.sum(mask)

  def terms(self, outputs: jax.Array, batch: Batch) -> "Terms":
    """The loss terms of this batch: how many count, and which (a mask per
    unit weighs each example by its units' weights: its number of terms)."""
    if self.mask is None:
      return Terms(math.prod(self.term_shape(outputs)))
    mask = self.batch_mask(outputs, batch).astype(jnp.float32)
    if self.PER_UNIT and mask.ndim == jnp.ndim(outputs):
      mask = jnp.sum(mask, -1)
    return Terms(jnp.sum(mask), mask)


class Categorical(PredictiveLoss):
  """Categorical distribution over the last axis of the logits ``f``.

  Targets are integer labels of shape ``f.shape[:-1]``. With ``p = softmax(f)``
  the output Fisher is ``diag(p) - p pᵀ``; its square root has columns
  ``B_k = sqrt(p_k) (e_k - p)``.
  """

  NAME = "softmax_cross_entropy"
  nonnegative = True
  TARGETS = "integer class labels (not one-hot) of shape outputs.shape[:-1]"
  INTEGER_TARGETS = True

  def target_shape(self, outputs_shape):
    return tuple(outputs_shape[:-1])

  def nll(self, outputs, targets):
    # The label's log-probability picked by a mask, not a gather: under
    # Explicit mesh axes a gather from vocabulary-sharded logits needs its
    # output sharding named; a masked sum over the classes does not.
    log_p = jax.nn.log_softmax(precision.at_least_float32(outputs))
    label = jnp.arange(log_p.shape[-1]) == jnp.asarray(targets)[..., None]
    return -jnp.sum(jnp.where(label, log_p, 0.0), axis=-1)

  def sample(self, rng, outputs):
    return jax.random.categorical(rng, precision.at_least_float32(outputs))

  def fisher_sqrt(self, outputs):
    p = jax.nn.softmax(precision.at_least_float32(outputs))
    root_p = jnp.sqrt(p)
    # columns[..., k, j] = sqrt(p_k) (δ_kj - p_j)
    columns = _diagonal_embed(root_p) - root_p[..., :, None] * p[..., None, :]
    return jnp.moveaxis(columns, -2, 0)

  def fisher_product(self, outputs, u):
    p = jax.nn.softmax(precision.at_least_float32(outputs))
    return p * u - p * jnp.sum(p * u, -1, keepdims=True)


class Bernoulli(PredictiveLoss):
  """Independent Bernoulli per output unit, summed over the last axis.

  Targets are in [0, 1] with the shape of ``f``. The output Fisher is
  ``diag(σ(f)(1 - σ(f)))``.
  """

  NAME = "sigmoid_cross_entropy"
  nonnegative = True
  PER_UNIT = True

  def nll(self, outputs, targets):
    return jnp.sum(optax.sigmoid_binary_cross_entropy(
        precision.at_least_float32(outputs), targets), axis=-1)

  def sample(self, rng, outputs):
    probs = jax.nn.sigmoid(precision.at_least_float32(outputs))
    return jax.random.bernoulli(rng, probs).astype(probs.dtype)

  def fisher_sqrt(self, outputs):
    probs = jax.nn.sigmoid(precision.at_least_float32(outputs))
    return jnp.moveaxis(_diagonal_embed(jnp.sqrt(probs * (1 - probs))), -2, 0)

  def fisher_product(self, outputs, u):
    probs = jax.nn.sigmoid(precision.at_least_float32(outputs))
    return probs * (1 - probs) * u


class Gaussian(PredictiveLoss):
  """Unit-variance Gaussian: ``0.5 ||y - f||²`` over the last axis.

  The output Fisher is the identity.
  """

  NAME = "squared_error"
  nonnegative = True
  PER_UNIT = True

  def nll(self, outputs, targets):
    return 0.5 * jnp.sum(
        jnp.square(targets - precision.at_least_float32(outputs)), axis=-1)

  def sample(self, rng, outputs):
    outputs = precision.at_least_float32(outputs)
    return outputs + jax.random.normal(rng, outputs.shape)

  def fisher_sqrt(self, outputs):
    ones = jnp.ones(outputs.shape, precision.at_least_float32(outputs).dtype)
    return jnp.moveaxis(_diagonal_embed(ones), -2, 0)

  def fisher_product(self, outputs, u):
    return precision.at_least_float32(u)


class DiagonalNormal(PredictiveLoss):
  """Normal with a learned diagonal variance: the last axis of ``f`` holds
  the means and the log standard deviations, ``f = [μ, s]``, ``σ = exp(s)``.

  Targets have ``f``'s shape with half its last axis. Per term, ``NLL =
  Σ_j s_j + (y_j - μ_j)² / (2σ_j²) + ½ log 2π``. The output Fisher in these
  coordinates is diagonal, ``diag(1/σ², 2)``: ``E[(y-μ)²/σ⁴] = 1/σ²`` for
  the means and ``E[((y-μ)²/σ² - 1)²] = 2`` for the log scales, the cross
  terms odd moments, zero.
  """

  NAME = "diagonal_normal"
  TARGETS = ("targets with the outputs' shape but half their last axis (the "
             "outputs hold the means, then the log standard deviations)")

  def target_shape(self, outputs_shape):
    *terms, width = outputs_shape
    if width % 2:
      raise ValueError(
          f"{self.NAME}: the outputs' last axis has {width} entries, but it "
          "must hold the means and the log standard deviations, one of each "
          "per target: an even number (e.g. nn.Dense(2 * d))")
    return (*terms, width // 2)

  def _split(self, outputs):
    mean, log_scale = jnp.split(precision.at_least_float32(outputs), 2, axis=-1)
    return mean, log_scale

  def nll(self, outputs, targets):
    mean, log_scale = self._split(outputs)
    z = (targets - mean) * jnp.exp(-log_scale)
    return jnp.sum(log_scale + 0.5 * jnp.square(z) + 0.5 * jnp.log(2 * jnp.pi), -1)

  def sample(self, rng, outputs):
    mean, log_scale = self._split(outputs)
    return mean + jnp.exp(log_scale) * jax.random.normal(rng, mean.shape)

  def _fisher_diagonal(self, outputs):
    _, log_scale = self._split(outputs)
    return jnp.concatenate([jnp.exp(-2 * log_scale),
                            jnp.full_like(log_scale, 2.0)], -1)

  def fisher_sqrt(self, outputs):
    return jnp.moveaxis(_diagonal_embed(jnp.sqrt(self._fisher_diagonal(outputs))), -2, 0)

  def fisher_product(self, outputs, u):
    return self._fisher_diagonal(outputs) * u


def diagonal_normal(
    targets: Callable[[Batch], jax.Array] = _second_element,
    mask: Callable[[Batch], jax.Array] | None = None) -> DiagonalNormal:
  """Normal NLL with learned means and log standard deviations ``[μ, log σ]``
  on the outputs' last axis (heteroscedastic regression, a continuous
  policy); targets have half that axis."""
  return DiagonalNormal(targets, mask)


def softmax_cross_entropy(
    targets: Callable[[Batch], jax.Array] = _second_element,
    mask: Callable[[Batch], jax.Array] | None = None) -> Categorical:
  """Softmax cross-entropy with integer labels ``targets(batch)``."""
  return Categorical(targets, mask)


def sigmoid_cross_entropy(
    targets: Callable[[Batch], jax.Array] = _second_element,
    mask: Callable[[Batch], jax.Array] | None = None) -> Bernoulli:
  """Sigmoid cross-entropy summed over the last axis; targets in [0, 1]."""
  return Bernoulli(targets, mask)


def squared_error(
    targets: Callable[[Batch], jax.Array] = _second_element,
    mask: Callable[[Batch], jax.Array] | None = None) -> Gaussian:
  """``0.5 ||y - f||²`` summed over the last axis (unit-variance Gaussian)."""
  return Gaussian(targets, mask)


@dataclasses.dataclass(frozen=True)
class Joint(PredictiveLoss):
  """Several heads' distributions, independent given the model: the
  outputs are a tuple ``(f_1, ..., f_H)``, head ``h`` reads ``f_h``.

  With weights ``c_h`` the loss is ``Σ_h c_h NLL_h`` per term (an
  actor-critic's policy cross-entropy plus ``c`` times its value's squared
  error), and its Fisher, equal to its GGN, is ``Σ_h c_h J_hᵀ F_h J_h``:
  K-FAC's output gradients carry ``√c_h`` on head ``h``, one backward pass
  for all heads. Sampled targets are drawn per head; their cross terms
  vanish in expectation. The empirical Fisher is the outer product of
  ``Σ_h √c_h ∇NLL_h``. Every head has the same terms (the same leading
  axes, e.g. one per example); one ``mask`` weighs them for all heads.
  """

  heads: tuple[PredictiveLoss, ...] = ()
  weights: tuple[float, ...] = ()

  NAME = "joint"

  def __post_init__(self):
    if not self.heads or not all(isinstance(h, PredictiveLoss)
                                 and not isinstance(h, Joint) for h in self.heads):
      raise TypeError("joint takes kfac_optax.losses distributions, one per "
                      f"head (not joint ones), got {self.heads!r}")
    if any(h.mask is not None for h in self.heads):
      raise ValueError("joint: the heads' terms are weighed by one mask for all "
                       "of them; pass mask= to joint, not to a head")
    if len(self.weights) != len(self.heads) or not all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0
        for c in self.weights):
      raise ValueError(f"joint: weights must be {len(self.heads)} positive "
                       f"numbers, one per head, got {self.weights!r}")

  @property
  def num_outputs(self) -> int:
    return len(self.heads)

  @property
  def nonnegative(self) -> bool:
    return all(head.nonnegative for head in self.heads)

  def term_shape(self, outputs):
    shapes = [head.term_shape(f) for head, f in zip(self.heads, outputs)]
    if len(set(shapes)) != 1:
      raise ValueError(
          f"joint: the heads' outputs have leading axes {shapes}, but every head "
          "must have the same terms (e.g. one per example: shapes (batch, "
          "classes) and (batch, 1)). Heads with other terms, such as a "
          "per-token and a per-sequence head, are not supported: give K-FAC "
          "the head that carries most of your loss and leave the other head's "
          "layers unpreconditioned, layer_overrides={'its/path': 'skip'}")
    return shapes[0]

  def checked_targets(self, outputs, batch):
    return tuple(head.checked_targets(f, batch) for head, f in zip(self.heads, outputs))

  def batch_mask(self, outputs, batch):
    mask, terms = self.mask(batch), self.term_shape(outputs)
    if jnp.shape(mask) != terms:
      raise ValueError(f"joint: mask(batch) has shape {jnp.shape(mask)}; it must "
                       f"have the shape of the heads' terms, {terms}")
    return mask

  def output_weights(self, outputs, batch):
    weights = super().output_weights(outputs, batch)  # the terms', per unit
    return None if weights is None else tuple(weights for _ in self.heads)

  def nll(self, outputs, targets):
    self.term_shape(outputs)  # the heads' terms must line up, not broadcast
    return sum(c * head.nll(f, y) for head, c, f, y
               in zip(self.heads, self.weights, outputs, targets))

  def nll_grad(self, outputs, targets):
    return tuple(math.sqrt(c) * head.nll_grad(f, y) for head, c, f, y
                 in zip(self.heads, self.weights, outputs, targets))

  def sample(self, rng, outputs):
    keys = jax.random.split(rng, len(self.heads))
    return tuple(head.sample(key, f) for head, key, f in zip(self.heads, keys, outputs))

  def fisher_sqrt(self, outputs):
    # Head h's columns, scaled by √c_h, where the other heads' are zero.
    columns = [math.sqrt(c) * head.fisher_sqrt(f)
               for head, c, f in zip(self.heads, self.weights, outputs)]
    counts = [len(b) for b in columns]
    return tuple(
        jnp.concatenate([b if i == h else jnp.zeros((n, *b.shape[1:]), b.dtype)
                         for i, n in enumerate(counts)])
        for h, b in enumerate(columns))

  def fisher_product(self, outputs, u):
    return tuple(c * head.fisher_product(f, v) for head, c, f, v
                 in zip(self.heads, self.weights, outputs, u))


def joint(*heads: PredictiveLoss, weights: tuple[float, ...] | None = None,
          mask: Callable[[Batch], jax.Array] | None = None) -> Joint:
  """Several heads' losses as one: ``Σ_h weights[h] · NLL_h`` per term.

  The model's outputs (``outputs=``) are a tuple with one array per head, in
  order; each head reads its own ``targets=``. E.g. an actor-critic's
  ``joint(softmax_cross_entropy(targets=lambda b: b["actions"]),
  squared_error(targets=lambda b: b["returns"][:, None]), weights=(1.0,
  0.5))`` for outputs ``(logits, value)``: K-FAC's curvature is then the
  sum of the policy's and the value's Fisher, as in ACKTR (Wu et al. 2017).

  Args:
    *heads: one `kfac_optax.losses` distribution per head, without a mask.
    weights: each head's ``c_h > 0`` (default 1 each).
    mask: batch -> weights of the terms, shared by every head.
  """
  return Joint(mask=mask, heads=tuple(heads),
               weights=tuple(weights) if weights is not None else (1.0,) * len(heads))


def _diagonal_embed(x: jax.Array) -> jax.Array:
  """[..., C] -> [..., C, C] with x on the diagonal."""
  return x[..., :, None] * jnp.eye(x.shape[-1], dtype=x.dtype)


class Terms(NamedTuple):
  """The NLL terms of a batch, as every K-FAC statistic counts them.

  Attributes:
    count: L, the number of (unmasked) terms: the sum of their weights.
    mask: float mask (or non-negative weights) over the loss's leading axes
      (for a mask per output unit, each example's sum of its units'), or
      None. A captured array whose leading axes equal the mask's shape (a
      layer applied per token of a per-token loss, or any layer under a
      per-example mask) has its rows weighted by it, so masked positions
      never enter a statistic. Output gradients carry their term's weight
      already (`output_cotangents` scales by its square root, so ``g gᵀ``
      by the weight): their rows are weighted by the mask's `support`.
  """
  count: Any
  mask: jax.Array | None = None

  def support(self) -> "Terms":
    """These terms with the mask replaced by 1 where it is positive: the row
    weights of output gradients."""
    if self.mask is None:
      return self
    return self._replace(mask=(self.mask > 0).astype(self.mask.dtype))

  def mask_for(self, shape: tuple) -> jax.Array | None:
    """The mask, broadcastable to an array of ``shape`` whose leading axes it
    matches; None if there is no mask or the axes do not match."""
    if self.mask is None or tuple(shape[:self.mask.ndim]) != self.mask.shape:
      return None
    return self.mask.reshape(self.mask.shape + (1,) * (len(shape) - self.mask.ndim))

  def row_weights(self, shape: tuple, num_rows: int) -> jax.Array | None:
    """Weights for the ``num_rows`` example-major rows of an array of ``shape``."""
    if self.mask_for(shape) is None:
      return None
    return jnp.repeat(self.mask.reshape(-1), num_rows // self.mask.size)


def output_cotangents(
    loss: PredictiveLoss,
    outputs: Any,
    batch: Batch,
    estimation: Estimation,
    rng: jax.Array | None,
    num_samples: int,
) -> Any:
  """Cotangents on the model output whose backward passes give K-FAC's ``g``.

  Returns an array of shape ``(K, *outputs.shape)`` (for `joint`, one per
  head's outputs, the heads' K the same), zero at masked terms
  and scaled by the square root of a weighted term's weight. Back-propagating
  cotangent ``k`` gives layer output gradients ``g_k``, scaled so that every
  Fisher estimate is the plain sum ``Σ_k g_k g_kᵀ``:

  - ``"empirical"``: K = 1, ``∂ Σ_i NLL_i(f, y_batch) / ∂f``.
  - ``"fisher"``: K = ``num_samples`` draws ``y ~ p(y|f)``, each gradient
    scaled by ``1/sqrt(K)`` (so the sum is the sample mean).
  - ``"exact"``: K = C columns of the output-Fisher square root, so
    ``Σ_k g_k g_kᵀ = Jᵀ F_out J`` exactly.
  - ``"curvature_prop"``: K = ``num_samples`` Rademacher combinations
    ``Σ_c r_c B_c / sqrt(K)`` of those columns (independent signs per term),
    whose expected sum of outer products is ``F_out`` (Martens et al. 2012).
  """
  weights = loss.output_weights(outputs, batch)
  scale = lambda tree, factor: jax.tree.map(lambda c: c * factor, tree)

  if estimation == "empirical":
    cotangents = jax.tree.map(lambda c: c[None], loss.nll_grad(
        outputs, loss.batch_targets(outputs, batch)))
  elif estimation == "fisher":
    keys = jax.random.split(rng, num_samples)
    samples = jax.vmap(loss.sample, in_axes=(0, None))(keys, outputs)
    cotangents = scale(jax.vmap(lambda y: loss.nll_grad(outputs, y))(samples),
                       1 / math.sqrt(num_samples))
  elif estimation == "exact":
    cotangents = loss.fisher_sqrt(outputs)
  elif estimation == "curvature_prop":
    columns = loss.fisher_sqrt(outputs)  # (C, *outputs.shape) per output array
    signs = jax.random.rademacher(
        rng, (num_samples, jax.tree.leaves(columns)[0].shape[0],
              *loss.term_shape(outputs)), jnp.float32)
    cotangents = scale(jax.tree.map(
        lambda b: jnp.einsum("kc...,c...j->k...j", signs, b), columns),
        1 / math.sqrt(num_samples))
  else:
    raise ValueError(
        f"estimation must be one of {ESTIMATIONS}, got {estimation!r}")
  # Masked terms: no gradient; weighted ones: Σ_k g gᵀ scales by the weight.
  if weights is None:
    return jax.tree.map(lambda c, f: c.astype(f.dtype), cotangents, outputs)
  return jax.tree.map(lambda c, w, f: (c * jnp.sqrt(w)).astype(f.dtype),
                      cotangents, weights, outputs)
