"""Curvature blocks: statistics, damped inverses and preconditioning.

A block owns a group of parameter leaves and approximates their Fisher block.
It turns captured layer data into a batch estimate of its statistics, turns
(EMA-averaged) statistics into damped inverses, and applies those inverses to
the gradient leaves it owns. Blocks know nothing about flax: they see arrays
and the names of the parameter leaves of their layer.

Conventions (DESIGN.md section 4): L is the number of loss terms, a row is one
position of one example at which a layer is applied, and every output gradient
``g`` is the gradient of the *summed* per-term NLL, one per output cotangent
``k`` (see `losses.output_cotangents`).
"""

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from kfac_optax import linalg

_HIGHEST = jax.lax.Precision.HIGHEST


class KroneckerFactors(NamedTuple):
  """``A`` (input second moment) and ``G`` (output-gradient second moment)."""
  a: jax.Array
  g: jax.Array


@dataclasses.dataclass(frozen=True)
class KroneckerBlock:
  """A dense layer ``s = a W + b``: Fisher block ``≈ A ⊗ G``.

  .. math::
    \\bar a = [a, 1],\\quad A = \\frac{1}{R}\\sum_{rows} \\bar a \\bar a^T,\\quad
    G = \\frac{1}{L}\\sum_k \\sum_{rows} g_k g_k^T

  with ``R`` the number of rows. The gradient ``V = [∇W; ∇b]`` of shape
  ``(d_in + 1, d_out)`` is preconditioned as
  ``U = (A + π√λ I)⁻¹ V (G + √λ/π I)⁻¹``.

  Attributes:
    in_dim: ``d_in``, the kernel's first axis.
    out_dim: ``d_out``, the kernel's second axis.
    has_bias: whether the layer has a bias (adds the homogeneous coordinate).
  """

  in_dim: int
  out_dim: int
  has_bias: bool

  @classmethod
  def for_dense(cls, layer_params: dict) -> "KroneckerBlock":
    in_dim, out_dim = layer_params["kernel"].shape
    return cls(in_dim, out_dim, "bias" in layer_params)

  @property
  def param_names(self) -> tuple[str, ...]:
    return ("kernel", "bias") if self.has_bias else ("kernel",)

  def init(self) -> tuple[KroneckerFactors, KroneckerFactors]:
    """Zero statistics and identity "inverses" (used until the first refresh)."""
    size = self.in_dim + self.has_bias
    zeros = KroneckerFactors(jnp.zeros((size, size)), jnp.zeros((self.out_dim,) * 2))
    identities = KroneckerFactors(jnp.eye(size), jnp.eye(self.out_dim))
    return zeros, identities

  def statistics(
      self,
      inputs: Sequence[jax.Array],
      output_grads: Sequence[jax.Array],
      num_terms: int,
  ) -> KroneckerFactors:
    """Batch estimates of ``A`` and ``G`` from every call of the layer.

    Args:
      inputs: per call, the layer input ``(..., d_in)``.
      output_grads: per call, ``(K, ..., d_out)`` gradients of the summed NLL.
      num_terms: L.
    """
    rows = jnp.concatenate(
        [x.reshape(-1, self.in_dim).astype(jnp.float32) for x in inputs])
    if self.has_bias:
      rows = jnp.concatenate([rows, jnp.ones((rows.shape[0], 1), rows.dtype)], 1)
    grads = jnp.concatenate(
        [g.reshape(-1, self.out_dim).astype(jnp.float32) for g in output_grads])
    a = jnp.matmul(rows.T, rows, precision=_HIGHEST) / rows.shape[0]
    g = jnp.matmul(grads.T, grads, precision=_HIGHEST) / num_terms
    return KroneckerFactors(a, g)

  def inverses(self, factors: KroneckerFactors, damping: jax.Array,
               method: str) -> KroneckerFactors:
    damping_a, damping_g = linalg.pi_adjusted_damping(factors.a, factors.g, damping)
    return KroneckerFactors(linalg.damped_inverse(factors.a, damping_a, method),
                            linalg.damped_inverse(factors.g, damping_g, method))

  def precondition(self, inverses: KroneckerFactors, grads: dict) -> dict:
    """Maps ``{"kernel": ∇W[, "bias": ∇b]}`` to its preconditioned leaves."""
    stacked = grads["kernel"].astype(jnp.float32)
    if self.has_bias:
      stacked = jnp.concatenate([stacked, grads["bias"][None].astype(jnp.float32)])
    result = inverses.a @ stacked @ inverses.g
    out = {"kernel": result[:self.in_dim].astype(grads["kernel"].dtype)}
    if self.has_bias:
      out["bias"] = result[self.in_dim].astype(grads["bias"].dtype)
    return out


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

  def statistics(self, param_grads: dict, num_terms: int) -> dict:
    """``param_grads``: leaf -> ``(K, *leaf_shape)`` summed-NLL gradients."""
    return {k: jnp.sum(jnp.square(param_grads[k].astype(jnp.float32)), 0) / num_terms
            for k in self.names}

  def inverses(self, fisher: dict, damping: jax.Array, method: str) -> dict:
    del method  # a diagonal needs no factorisation
    return {k: 1.0 / (fisher[k] + damping) for k in self.names}

  def precondition(self, inverses: dict, grads: dict) -> dict:
    return {k: (grads[k] * inverses[k]).astype(grads[k].dtype) for k in self.names}


BLOCK_KINDS = {"dense": KroneckerBlock.for_dense}
