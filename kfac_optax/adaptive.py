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
  """``Σ_leaves <x, y>`` in float32."""
  return sum(jnp.vdot(a.astype(jnp.float32), b.astype(jnp.float32))
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


def quadratic_coefficients(curvature: jax.Array, linear: jax.Array,
                           learning_rate: Any, momentum: Any,
                           use_previous: jax.Array
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The step ``δ = α v + μ p`` that minimises the quadratic model.

  With directions ``v`` (preconditioned gradient) and ``p`` (previous step),
  ``M_ij = d_iᵀ (F + (λ+η) I) d_j`` and ``b_i = ∇hᵀ d_i``, the model along
  them is ``q(c) = bᵀc + ½ cᵀ M c``. Coefficients given as numbers are kept
  (``α = -learning_rate``, ``μ = momentum``); ``None`` ones are solved for:
  both free is the 2x2 system ``M c = -b``, one free a 1x1 solve given the
  other. Without a previous step (``use_previous`` false, e.g. the first
  update) ``μ = 0`` and only α is solved.

  Args:
    curvature: M, (2, 2).
    linear: b, (2,).
    learning_rate: a number, or None to solve for α.
    momentum: a number, or None to solve for μ.
    use_previous: whether ``p`` is non-zero.

  Returns:
    ``(α, μ, q(c))``: the coefficients and the model's predicted change.
  """
  m, b = curvature, linear
  safe = lambda x: jnp.where(x > 0, x, 1.0)
  if learning_rate is None and momentum is None:
    joint = jnp.linalg.solve(jnp.where(use_previous, m, jnp.diag(jnp.stack(
        [m[0, 0], 1.0]))), -jnp.where(use_previous, b, b * jnp.array([1.0, 0.0])))
    alpha, mu = joint[0], joint[1]
  elif learning_rate is None:
    mu = jnp.where(use_previous, momentum, 0.0)
    alpha = -(b[0] + m[0, 1] * mu) / safe(m[0, 0])
  else:
    alpha = -jnp.asarray(learning_rate, jnp.float32)
    if momentum is None:
      mu = jnp.where(use_previous, -(b[1] + m[1, 0] * alpha) / safe(m[1, 1]), 0.0)
    else:
      mu = jnp.asarray(momentum, jnp.float32)
  c = jnp.stack([alpha, mu]).astype(jnp.float32)
  return alpha, mu, b @ c + 0.5 * c @ m @ c


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
