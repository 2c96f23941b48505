"""Diagonal blocks: the fallback for params no layer block owns, and norms.

Both precondition ``∇ / (F + λ)`` with a diagonal Fisher ``F``: the
fallback's from the batch gradient of the summed NLL, a normalisation
layer's exactly, from per-example gradients of its scale and bias.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kfac_optax._src import linalg
from kfac_optax._src import losses


@dataclasses.dataclass(frozen=True)
class DiagonalBlock:
  """Diagonal Fisher for parameter leaves that no structured block owns.

  .. math::
    F = \\frac{1}{L} \\sum_k \\Big(\\sum_{n} ∇_θ \\ell_{n,k}\\Big)^2,
    \\qquad U = ∇ / (F + λ)

  i.e. the squared batch gradient of the summed NLL (per output cotangent
  ``k``) divided by L, which equals ``L · (∇ mean NLL)²``. With targets
  sampled from the model the cross-example terms vanish in expectation, so
  this is an unbiased estimate of the diagonal Fisher ``(1/L) Σ_n (∇ℓ_n)²``.

  Attributes:
    shapes: leaf key -> shape, for every leaf this block owns.
  """

  shapes: dict

  @property
  def names(self) -> tuple:
    return tuple(self.shapes)

  def init(self) -> tuple[dict, dict]:
    """Zero statistics and unit inverses (used until the first refresh)."""
    zeros = {k: jnp.zeros(s, jnp.float32) for k, s in self.shapes.items()}
    ones = {k: jnp.ones(s, jnp.float32) for k, s in self.shapes.items()}
    return zeros, ones

  def statistics(self, param_grads: dict, terms: losses.Terms) -> dict:
    """``param_grads``: leaf -> ``(K, *leaf_shape)`` summed-NLL gradients."""
    return {k: jnp.sum(jnp.square(linalg.at_least_float32(param_grads[k])), 0) / terms.count
            for k in self.names}

  def damped(self, fisher: dict, damping: jax.Array) -> dict:
    """Each leaf's diagonal Fisher with the damping (`linalg.invert_all`)."""
    return {k: linalg.DampedDiagonal(fisher[k], damping) for k in self.names}

  def precondition(self, inverses: dict, grads: dict) -> dict:
    return {k: grads[k].astype(inverses[k].dtype) * inverses[k] for k in self.names}


@dataclasses.dataclass(frozen=True)
class NormBlock(DiagonalBlock):
  """Scale and bias of a normalisation layer: diagonal Fisher, exact.

  .. math::
    F = \\frac{1}{L} \\sum_k \\sum_n (∇θ_{n,k})^2,\\quad U = ∇ / (F + λ)

  with the per-example gradients ``∇scale_n = Σ_positions g ⊙ x̂`` and
  ``∇bias_n = Σ_positions g`` formed from the captured normalised input.

  Attributes:
    layout: where the feature axes are (`layouts.NormLayout`).
  """

  layout: Any = None

  @property
  def param_names(self) -> tuple[str, ...]:
    return self.names

  def statistics(self, inputs, output_grads, terms) -> dict:
    sums = {name: 0.0 for name in self.names}
    for x_hat, g in zip(inputs, output_grads):
      mask = terms.support().mask_for(x_hat.shape)
      if mask is not None:  # masked positions add nothing
        g = g * mask
      x_hat = self.layout.per_example(linalg.at_least_float32(x_hat))  # (N, P, F)
      g = jax.vmap(self.layout.per_example)(linalg.at_least_float32(g))  # (K, N, P, F)
      per_example = {"scale": jnp.einsum("knpf,npf->knf", g, x_hat),
                     "bias": jnp.sum(g, 2)}
      for name in self.names:
        sums[name] = sums[name] + per_example[name]
    return {name: jnp.sum(jnp.square(sums[name]), (0, 1)).reshape(
        self.shapes[name]) / terms.count for name in self.names}
