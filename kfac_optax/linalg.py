"""Damped factor inverses and the π-adjusted split of the damping."""

import jax
import jax.numpy as jnp

INVERSE_METHODS = ("eigh", "cholesky")


def pi_adjusted_damping(
    mean_a: jax.Array, mean_g: jax.Array, damping: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Splits Tikhonov damping λ between two Kronecker factors.

  .. math::
    π = \\sqrt{\\frac{\\operatorname{tr}(A)/\\dim A}{\\operatorname{tr}(G)/\\dim G}},
    \\quad (A + π\\sqrt{λ} I) ⊗ (G + \\sqrt{λ}/π I)

  so that the damping added to each factor is proportional to its average
  eigenvalue (Martens & Grosse 2015, section 6.3). ``π = 1`` when either
  average is not positive (e.g. a layer whose statistics are still zero).

  Args:
    mean_a: ``tr(A) / dim A``, the input factor's average eigenvalue.
    mean_g: ``tr(G) / dim G``.
    damping: λ, a scalar.

  Returns:
    ``(π√λ, √λ/π)``: the damping for ``A`` and for ``G``.
  """
  usable = (mean_a > 0) & (mean_g > 0)
  pi = jnp.where(usable, jnp.sqrt(mean_a / jnp.where(usable, mean_g, 1.0)), 1.0)
  root = jnp.sqrt(damping)
  return pi * root, root / pi


def mean_eigenvalue(matrix: jax.Array) -> jax.Array:
  """``tr(M) / dim M``."""
  return jnp.trace(matrix) / matrix.shape[0]


def damped_inverse(matrix: jax.Array, damping: jax.Array, method: str) -> jax.Array:
  """``(M + damping·I)⁻¹`` for a symmetric positive semi-definite ``M``.

  Args:
    matrix: symmetric PSD matrix (float32).
    damping: positive scalar added to the diagonal.
    method: ``"eigh"`` (eigenvalues clipped at 0 before damping, robust to
      round-off negativity) or ``"cholesky"`` (faster, needs ``M + dI`` to be
      numerically positive definite).

  Returns:
    The inverse, same shape as ``matrix``. Non-finite if the factorisation
    failed; callers keep the previous inverse in that case.
  """
  if method == "eigh":
    eigenvalues, eigenvectors = jnp.linalg.eigh(matrix)
    scale = 1.0 / (jnp.maximum(eigenvalues, 0.0) + damping)
    return (eigenvectors * scale) @ eigenvectors.T
  if method == "cholesky":
    identity = jnp.eye(matrix.shape[0], dtype=matrix.dtype)
    factor = jax.scipy.linalg.cho_factor(matrix + damping * identity, lower=True)
    return jax.scipy.linalg.cho_solve(factor, identity)
  raise ValueError(f"inverse must be one of {INVERSE_METHODS}, got {method!r}")
