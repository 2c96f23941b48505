"""One update of `kfac`, as named steps, and `KFACState`, what it updates.

``δ = α v + μ δ_prev`` with ``v = F̂⁻¹ g`` (`Curvature.precondition`):

1. `step` updates the curvature with the λ in use (`_requested_damping`)
   and preconditions the gradient;
2. the coefficients α and μ are either solved from the quadratic model
   along ``v`` and ``δ_prev`` (`_solved_coefficients`) or the fixed
   learning rate and momentum, α scaled down by the norm constraint
   (`_fixed_coefficients`);
3. `_burned_in` zeroes the update during the first ``num_burnin_steps``;
4. with adaptive damping, `_adapt_damping` measures the reduction ratio ρ
   on schedule, moves λ by the Levenberg-Marquardt rule and rejects a step
   that did not lower the loss.

Hyperparameters may be traced arrays (``optax.inject_hyperparams``): the
only Python branches are on which of them are None.
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_optax._src.curvature.curvature import Curvature
from kfac_optax._src.curvature.state import ScaleByKFACState
from kfac_optax._src.curvature.sub_batch import first_examples
from kfac_optax._src.optimizer import adaptive
from kfac_optax._src.optimizer import update_args

_NAN = float("nan")

# A solved step whose damped model predicts more than this many times the
# last step's decrease is measured (`_surprising`): on the transformer LM
# benchmark, with the model built on 16 of 32 sequences, the loss jumped
# from 2.4-2.7 to 4.5-5.1 at unmeasured steps predicted to lower it by 1.8-5.0,
# 13-30 times the step before (benchmarks/RESULTS.md).
_SURPRISE = 4.0


class KFACState(NamedTuple):
  """State of `kfac`.

  Attributes:
    curvature: the `ScaleByKFACState` of its preconditioner.
    previous_update: the last update δ (params-shaped; zero at first).
    count: updates so far.
    damping: λ, adapted in place with ``adaptive_damping``.
    learning_rate, momentum: the last step's ``-α`` and ``μ`` in
      ``δ = α v + μ δ_prev`` (v the preconditioned gradient).
    rho: the last measured reduction ratio (0 before the first, and always
      without ``adaptive_damping``; nan for a step that the model did not
      predict to decrease the loss, a failed step).
    qmodel_change: the damped quadratic model's predicted change of the
      loss for the last step where it was computed (0 before, and always
      with a fixed learning rate and momentum); ``rho`` divides the
      measured change by the undamped model's.
    fisher_norm: the last step's approximate squared Fisher norm of its
      gradient part, ``α² vᵀ F̂ v = α² vᵀ g``.

  Every field is 0 before the first update.
  """
  curvature: ScaleByKFACState
  previous_update: Any
  count: jax.Array
  damping: jax.Array
  learning_rate: jax.Array
  momentum: jax.Array
  rho: jax.Array
  qmodel_change: jax.Array
  fisher_norm: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Settings:
  """`kfac`'s settings after its ``"auto"`` and None defaults are resolved
  (see `kfac` for each); ``curvature`` is its `Curvature`."""

  curvature: Curvature
  learning_rate: Any
  momentum: Any
  norm_constraint: Any
  adaptive_damping: bool
  damping: Any
  damping_adaptation_interval: int
  damping_adaptation_decay: Any
  min_damping: Any
  max_damping: Any
  l2_reg: Any
  num_burnin_steps: int
  quadratic_batch_size: int | None

  @property
  def solve(self) -> bool:
    """Whether the quadratic model chooses a coefficient (α or μ)."""
    return self.learning_rate is None or self.momentum is None


class _Quadratic(NamedTuple):
  """The undamped quadratic model along ``(v, δ_prev)``: ``q₀(α, μ) =
  linear · c + ½ cᵀ curvature c`` with ``c = (α, μ)``, and the loss at the
  params (over the replicas) on the model pass's examples, read from its
  outputs: ρ's loss before the step and `_implausible`'s bound, computed
  once."""
  curvature: jax.Array
  linear: jax.Array
  loss: jax.Array

  def change(self, alpha: jax.Array, mu: jax.Array) -> jax.Array:
    c = jnp.stack([alpha, mu])
    return self.linear @ c + 0.5 * c @ self.curvature @ c


class _Coefficients(NamedTuple):
  """α, μ, the damped model's predicted change where it was solved (else
  the state's), and the undamped model where it was built (else None)."""
  alpha: jax.Array
  mu: jax.Array
  qmodel_change: jax.Array
  quadratic: _Quadratic | None


def step(settings: Settings, grads: Any, state: KFACState, params: Any, batch: Any,
         variables: dict, rng: jax.Array | None) -> tuple[Any, KFACState]:
  """``(δ, new state)``: one update of `kfac` (see the module docstring)."""
  count, curvature = state.count, settings.curvature
  damping = _requested_damping(settings, state)
  curvature_state = curvature.update(
      state.curvature, params, batch=batch, rng=rng, variables=variables,
      damping=damping + settings.l2_reg)
  v, curvature_state = curvature.precondition_and_count(curvature_state, grads)
  vg = adaptive.tree_dot(v, grads)
  lr = (None if settings.learning_rate is None
        else update_args.value_at(settings.learning_rate, count))
  mu = (None if settings.momentum is None
        else update_args.value_at(settings.momentum, count))
  if settings.solve:
    coefficients = _solved_coefficients(settings, v, grads, state.previous_update,
                                        params, batch, variables, rng, damping,
                                        lr, mu, vg)
  else:
    coefficients = _fixed_coefficients(settings, lr, mu, vg, state.qmodel_change)
  moving = count >= settings.num_burnin_steps
  delta = _burned_in(moving, v, state.previous_update, coefficients)
  rho, new_damping = state.rho, damping
  if settings.adaptive_damping:
    delta, rho, new_damping = _adapt_damping(
        settings, state, coefficients, moving, delta, damping, grads, params,
        batch, variables, rng)
  alpha = coefficients.alpha
  return delta, KFACState(
      curvature_state, delta, optax.safe_increment(count), new_damping,
      -alpha, coefficients.mu, rho,
      jnp.asarray(coefficients.qmodel_change, jnp.float32),
      jnp.square(alpha) * vg)


def _requested_damping(settings: Settings, state: KFACState) -> jax.Array:
  """λ for this step: the adapted one in the state, or the schedule's."""
  if settings.adaptive_damping:
    return state.damping
  return jnp.asarray(update_args.value_at(settings.damping, state.count),
                     jnp.float32)


def _model_examples(settings: Settings, batch: Any) -> Any:
  """The examples the quadratic model is built on: the first
  ``quadratic_batch_size`` (all for None)."""
  return first_examples(batch, settings.quadratic_batch_size, "quadratic_batch_size")


def _solved_coefficients(settings: Settings, v: Any, grads: Any, previous: Any,
                         params: Any, batch: Any, variables: dict,
                         rng: jax.Array | None, damping: jax.Array,
                         lr: Any, mu: Any, vg: jax.Array) -> _Coefficients:
  """α and μ that minimise the damped quadratic model along ``v`` and
  ``δ_prev`` (the free ones: a given lr or μ stays; μ given as 0, along
  ``v`` alone), from exact Fisher-vector products on the batch, or its
  first ``quadratic_batch_size`` examples (`adaptive.quadratic_coefficients`)."""
  curvature, l2_reg = settings.curvature, settings.l2_reg
  batch = _model_examples(settings, batch)
  # With momentum given as 0 the step has no δ_prev part: its tangent, about
  # 40% of the quadratic pass's work, is left out, and the model is padded to
  # (v, δ_prev) with zeros (μ = 0 for it).
  momentum_free = (isinstance(settings.momentum, (int, float))
                   and settings.momentum == 0)
  directions = (v,) if momentum_free else (v, previous)
  size = len(directions)
  outputs, tangents = curvature.output_tangents(
      params, batch, jax.tree.map(
          lambda first, *rest: jnp.stack([first, *(r.astype(first.dtype) for r in rest)]),
          *directions), variables, rng)
  fisher = curvature.output_fisher(outputs, batch, tangents)
  flat = lambda x: x.reshape(size, -1).astype(jnp.float32)
  gram = jnp.array([[adaptive.tree_dot(a, b) for b in directions]
                    for a in directions])
  # Without λ: the model whose change ρ compares with the loss's.
  undamped = (curvature.over_replicas(sum(
      flat(t) @ flat(f).T for t, f in zip(jax.tree.leaves(tangents),
                                          jax.tree.leaves(fisher))))
              + l2_reg * gram)
  linear = jnp.stack([vg] + [adaptive.tree_dot(grads, d) for d in directions[1:]])
  padded = lambda x: jnp.pad(x, [(0, 2 - size)] * x.ndim)
  undamped, gram, linear = padded(undamped), padded(gram), padded(linear)
  alpha, mu_now, qmodel_change = adaptive.quadratic_coefficients(
      undamped + damping * gram, linear, lr, mu, gram[1, 1] > 0)
  return _Coefficients(alpha, mu_now, qmodel_change,
                       _Quadratic(undamped, linear, curvature.batch_loss(outputs, batch)))


def _fixed_coefficients(settings: Settings, lr: Any, mu: Any, vg: jax.Array,
                        qmodel_change: jax.Array) -> _Coefficients:
  """``α = -lr``, scaled down so that ``α² vᵀ g ≤ norm_constraint``; μ as
  given."""
  alpha = -jnp.asarray(lr, jnp.float32)
  if settings.norm_constraint is not None:
    alpha = alpha * adaptive.norm_constraint_scale(vg, lr, settings.norm_constraint)
  return _Coefficients(alpha, jnp.asarray(mu, jnp.float32), qmodel_change, None)


def _burned_in(moving: jax.Array, v: Any, previous: Any,
               coefficients: _Coefficients) -> Any:
  """``δ = α v + μ δ_prev``, zero before the burn-in ends (``moving``)."""
  alpha, mu = coefficients.alpha, coefficients.mu
  return jax.tree.map(
      lambda a, p: jnp.where(moving, alpha * a + mu * p, 0).astype(a.dtype),
      v, previous)


def _undamped_change(settings: Settings, coefficients: _Coefficients, delta: Any,
                     grads: Any, params: Any, batch: Any, variables: dict,
                     rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """``q₀(δ)`` (the model without λ) and the loss at ``params`` (over the
  replicas)."""
  if coefficients.quadratic is not None:  # the model along v and δ_prev is known
    quadratic = coefficients.quadratic
    return quadratic.change(coefficients.alpha, coefficients.mu), quadratic.loss
  curvature, l2_reg = settings.curvature, settings.l2_reg
  outputs, tangent = jax.jvp(
      lambda p: curvature.forward(p, batch, variables, rng), (params,), (delta,))
  fisher_tangent = curvature.output_fisher(outputs, batch, tangent)
  fisher_term = curvature.over_replicas(adaptive.tree_dot(tangent, fisher_tangent))
  return (adaptive.tree_dot(grads, delta)
          + 0.5 * (fisher_term + l2_reg * adaptive.tree_dot(delta, delta))), (
              curvature.batch_loss(outputs, batch))


def _reduction_ratio(settings: Settings, coefficients: _Coefficients, delta: Any,
                     grads: Any, params: Any, batch: Any, variables: dict,
                     rng: jax.Array | None, dtype: Any) -> jax.Array:
  """ρ: the loss's measured change over the undamped model's prediction;
  with the model built, on its examples (the first ``quadratic_batch_size``)."""
  curvature, l2_reg = settings.curvature, settings.l2_reg
  change, before = _undamped_change(settings, coefficients, delta, grads,
                                    params, batch, variables, rng)
  if coefficients.quadratic is not None:  # its loss is on the model's examples
    batch = _model_examples(settings, batch)
  moved = curvature.batch_loss(curvature.forward(
      optax.apply_updates(params, delta), batch, variables, rng), batch)
  # The user's loss holds the L2 term the model's l2_reg stands for:
  # η/2 (‖θ+δ‖² - ‖θ‖²) of the change is its.
  actual = (moved - before + l2_reg * (
      adaptive.tree_dot(params, delta) + 0.5 * adaptive.tree_dot(delta, delta)))
  # ρ compares an actual decrease with a predicted one: a step the model
  # does not predict to decrease the loss (a fixed learning rate that
  # overshoots) is a failed step, ρ = nan, whatever the loss did.
  return jnp.where(change < 0, actual / jnp.where(change < 0, change, 1.0),
                   _NAN).astype(dtype)  # float64 targets, x64


def _implausible(settings: Settings, coefficients: _Coefficients,
                 params: Any) -> jax.Array:
  """Whether the undamped model predicts this step to lower the loss by more
  than four times its value (with the L2 term, ``η/2 ‖θ‖²``), where no loss
  can be below 0 (`losses.PredictiveLoss.nonnegative`): whatever the loss
  does, such a step's ρ is below ¼, a poor step by the Levenberg-Marquardt
  rule's own bound, so it is measured: rejected, and λ raised, if the loss
  rose; else taken, and the next step measured (`_adapt_damping`).

  Between the scheduled measurements of ρ nothing else checks a step, and
  with λ at its floor the model's steps can grow without bound: on the
  convnet benchmark the automatic mode's loss went from 3.7 to 6890, 6.7e5
  and 2e32 in the three steps before the next measurement, their predicted
  decreases 141, 1.7e6 and 9e15 (benchmarks/STABILITY.md).
  """
  curvature = settings.curvature
  if coefficients.quadratic is None or not curvature.loss.nonnegative:
    return jnp.asarray(False)
  quadratic = coefficients.quadratic
  objective = quadratic.loss + 0.5 * settings.l2_reg * adaptive.tree_dot(params, params)
  return quadratic.change(coefficients.alpha, coefficients.mu) < -4.0 * objective


def _surprising(state: KFACState, coefficients: _Coefficients) -> jax.Array:
  """Whether the damped model predicts this solved step to lower the loss
  by more than `_SURPRISE` times the last step's predicted decrease (the
  first step's, and one after a step of no predicted change, always).

  The model is checked by ρ only on schedule; a step several times larger
  than the last one leaves the region where it was last checked, so it is
  measured as `_implausible`'s are (`_adapt_damping`).
  """
  if coefficients.quadratic is None:
    return jnp.asarray(False)
  return coefficients.qmodel_change < _SURPRISE * state.qmodel_change


def _adapt_damping(settings: Settings, state: KFACState, coefficients: _Coefficients,
                   moving: jax.Array, delta: Any, damping: jax.Array, grads: Any,
                   params: Any, batch: Any, variables: dict,
                   rng: jax.Array | None) -> tuple[Any, jax.Array, jax.Array]:
  """``(δ, ρ, λ)`` after the Levenberg-Marquardt rule, on its schedule.

  ρ is measured every ``damping_adaptation_interval`` steps, every step
  after a poor step (ρ < ¼ or non-finite) until a good one, so λ reacts
  within a few steps, and at any step whose model predicts a decrease
  more than four times the loss where the loss cannot go below 0
  (`_implausible`) or more than four times the last step's predicted
  decrease (`_surprising`); such a step moves λ by the rule only if its
  loss rose or it is due anyway. A measured step that raised the loss, made it
  non-finite or was not predicted to lower it is not taken: δ is zero, so
  the momentum restarts from zero.
  """
  scheduled = moving & (
      ((state.count - settings.num_burnin_steps)
       % settings.damping_adaptation_interval == 0) | ~(state.rho >= 0.25))
  due = scheduled | (moving & (_implausible(settings, coefficients, params)
                               | _surprising(state, coefficients)))
  rho = jax.lax.cond(
      due, lambda _: _reduction_ratio(settings, coefficients, delta, grads,
                                      params, batch, variables, rng,
                                      state.rho.dtype),
      lambda _: state.rho, None)
  # A step measured for its model's check alone raises λ only if its
  # loss rose: one whose loss fell, by less than the model said, keeps λ
  # (its ρ below ¼ has the next step measured by the rule). Raising λ at
  # each such step cost cnn_bn_dropout 40% of its 300-step loss and ended
  # long LM and convnet runs higher (benchmarks/STABILITY.md).
  ruled = jnp.where(scheduled | ~(rho >= 0.0), rho, jnp.maximum(rho, 0.25))
  new_damping = jnp.where(due, adaptive.levenberg_marquardt(
      damping, ruled, settings.damping_adaptation_decay,
      settings.damping_adaptation_interval, settings.min_damping,
      settings.max_damping), damping)
  rejected = due & ~(rho >= 0.0)
  delta = jax.tree.map(lambda d: jnp.where(rejected, jnp.zeros_like(d), d), delta)
  return delta, rho, new_damping
