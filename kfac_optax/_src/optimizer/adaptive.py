"""K-FAC's own step controls: norm constraint, quadratic model, LM damping.

All three use the local quadratic model of the loss around the parameters,

.. math::
  q(δ) = ∇h^T δ + \\tfrac12 δ^T (F + (λ + η) I) δ

with ``F`` the exact Fisher (= GGN) on the batch, λ the damping and η the
coefficient of the user's L2 term (``l2_reg``).
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax


def tree_dot(x: Any, y: Any) -> jax.Array:
  """``Σ_leaves <x, y>`` in float32.

  An elementwise product and a sum, not ``jnp.vdot``: vdot ravels its
  operands, which for a leaf split over two mesh axes makes XLA gather one
  axis first; the product keeps each leaf's layout and only partial sums
  are reduced."""
  return sum(jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))
             for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


def norm_constraint_scale(fisher_norm: jax.Array, learning_rate: jax.Array,
                          max_norm: Any) -> jax.Array:
  """``min(1, sqrt(c / (lr² vᵀg)))``: bounds the step's squared Fisher norm by c.

  With ``v = F̂⁻¹ g`` the approximate squared Fisher norm of the step
  ``lr·v`` is ``lr² vᵀ F̂ v = lr² vᵀ g`` (Ba et al. 2017, section 5).
  """
  squared = jnp.square(learning_rate) * jnp.maximum(fisher_norm, 0.0)
  return jnp.minimum(1.0, jnp.sqrt(max_norm / jnp.maximum(squared, 1e-30)))


def norm_constraint(inner: optax.GradientTransformation, max_norm: float,
                    learning_rate: optax.ScalarOrSchedule
                    ) -> optax.GradientTransformationExtraArgs:
  """Scales ``inner``'s output so the step's approximate Fisher norm is bounded.

  .. math::
    v = \\text{inner}(g),\\quad
    \\text{out} = v · \\min\\Big(1, \\sqrt{c / (lr^2\\, v^T g)}\\Big)

  ``inner`` is `scale_by_kfac` (or a chain starting with it), so ``vᵀg =
  vᵀ F̂ v``; after the learning rate the step ``lr·out`` has
  ``lr² outᵀ F̂ out ≤ c``. Place it where `scale_by_kfac` would go, e.g.
  ``optax.chain(norm_constraint(scale_by_kfac(...), c, lr), optax.trace(0.9),
  optax.scale_by_learning_rate(lr))``.

  Args:
    inner: the preconditioning transformation.
    max_norm: c, the bound on ``lr² vᵀ F̂ v``.
    learning_rate: the learning rate the update will be scaled by (a float
      or a schedule of this transformation's step count).

  Returns:
    A transformation whose state is ``(count, inner state)``.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return (jnp.zeros([], jnp.int32), inner.init(params))

  def update_fn(grads, state, params=None, **extra_args):
    count, inner_state = state
    preconditioned, inner_state = inner.update(grads, inner_state, params, **extra_args)
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    scale = norm_constraint_scale(tree_dot(preconditioned, grads), lr, max_norm)
    scaled = jax.tree.map(lambda v: (v * scale).astype(v.dtype), preconditioned)
    return scaled, (optax.safe_increment(count), inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# Momentum the quadratic model may choose: below 0 a step undoes part of the
# last one; above 1 the steps grow geometrically. Both were seen when the 2x2
# system was nearly singular (momentum swinging between -3e8 and 9).
MOMENTUM_RANGE = (0.0, 1.0)
# The 2x2 system is used only when 1 - r² > this, with r the cosine of v and
# the previous step under M: nearly parallel directions make it singular in
# float32, and the learning rate alone then loses (almost) nothing.
MIN_INDEPENDENCE = 1e-3


def quadratic_coefficients(curvature: jax.Array, linear: jax.Array,
                           learning_rate: Any, momentum: Any,
                           use_previous: jax.Array
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The step ``δ = α v + μ p`` that minimises the quadratic model, safeguarded.

  With directions ``v`` (preconditioned gradient) and ``p`` (previous step),
  ``M_ij = d_iᵀ (F + (λ+η) I) d_j`` and ``b_i = ∇hᵀ d_i``, the model along
  them is ``q(c) = bᵀc + ½ cᵀ M c``. Coefficients given as numbers are kept
  (``α = -learning_rate``, ``μ = momentum``); ``None`` ones are solved for.
  A solved μ minimises q over ``μ ∈ MOMENTUM_RANGE``: since
  ``φ(μ) = min_α q(α, μ)`` is a convex parabola, that is the unconstrained
  optimum ``μ* = (m₀₁b₀ - m₀₀b₁) / det M`` clipped to the range, with α
  re-solved for it, ``α = -(b₀ + m₀₁μ) / m₀₀``. Safeguards:

  - without a previous step (``use_previous`` false), or when ``v`` and ``p``
    are nearly parallel under M (``det M ≤ MIN_INDEPENDENCE · m₀₀ m₁₁``),
    μ = 0 and α alone is solved;
  - with α solved, a step the model does not predict to decrease the loss
    (``q(c) ≥ 0`` or non-finite, from round-off or a non-finite M) is not
    taken: ``α = μ = 0``.

  Args:
    curvature: M, (2, 2).
    linear: b, (2,).
    learning_rate: a number, or None to solve for α.
    momentum: a number, or None to solve for μ.
    use_previous: whether ``p`` is non-zero.

  Returns:
    ``(α, μ, q(c))``: the coefficients and the model's predicted change.
  """
  m00, m11 = curvature[0, 0], curvature[1, 1]
  m01 = 0.5 * (curvature[0, 1] + curvature[1, 0])
  b0, b1 = linear[0], linear[1]
  safe = lambda x: jnp.where(x > 0, x, 1.0)
  clip = lambda mu: jnp.clip(mu, *MOMENTUM_RANGE)
  det = m00 * m11 - jnp.square(m01)
  if momentum is not None:
    mu = jnp.where(use_previous, jnp.asarray(momentum, jnp.float32), 0.0)
  elif learning_rate is None:
    independent = use_previous & (det > MIN_INDEPENDENCE * m00 * m11)
    mu = jnp.where(independent, clip((m01 * b0 - m00 * b1) / safe(det)), 0.0)
  else:
    mu = jnp.where(use_previous & (m11 > 0), clip(
        -(b1 - m01 * jnp.asarray(learning_rate, jnp.float32)) / safe(m11)), 0.0)
  if learning_rate is None:
    alpha = -(b0 + m01 * mu) / safe(m00)
  else:
    alpha = -jnp.asarray(learning_rate, jnp.float32)
  c = jnp.stack([alpha, mu]).astype(jnp.float32)
  change = linear @ c + 0.5 * c @ curvature @ c
  if learning_rate is None:
    take = jnp.isfinite(change) & (change < 0)
    alpha, mu = jnp.where(take, alpha, 0.0), jnp.where(take, mu, 0.0)
    change = jnp.where(take, change, 0.0)
  return alpha, mu, change


def levenberg_marquardt(damping: jax.Array, rho: jax.Array, decay: Any,
                        interval: Any, min_damping: Any, max_damping: Any
                        ) -> jax.Array:
  """Martens & Grosse (2015, section 6.5): λ from the reduction ratio ρ.

  .. math::
    ω = \\text{decay}^{\\text{interval}},\\quad
    λ ← \\operatorname{clip}\\big(λ · \\{ω^{-1}\\ \\text{if}\\ ρ < ¼;\\
        ω\\ \\text{if}\\ ρ > ¾;\\ 1\\}, λ_{min}, λ_{max}\\big)

  A non-finite ρ counts as a failed step (λ grows).
  """
  omega = jnp.power(decay, interval)
  factor = jnp.where(~jnp.isfinite(rho) | (rho < 0.25), 1.0 / omega,
                     jnp.where(rho > 0.75, omega, 1.0))
  return jnp.clip(damping * factor, min_damping, max_damping)
