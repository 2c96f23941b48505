"""A damped factor, the π-adjusted split of the damping, and its powers.

A refresh inverts ``M + δI`` for every factor ``M`` of a block, with λ split
between a Kronecker block's two factors by π (`pi_adjusted_damping`).
`Damped` and `DampedDiagonal` carry a factor and its ``δ`` to
`stacked_inverses.invert_all`; `damped_inverse` and `damped_power` compute
one matrix's.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kfac_optax._src.linalg import cholesky
from kfac_optax._src.linalg import newton_schulz

INVERSE_METHODS = ("auto", "eigh", "cholesky", "newton_schulz")


class Damped(NamedTuple):
  """Symmetric PSD matrices ``(..., d, d)`` with ``damping`` (...) to add."""
  matrix: jax.Array
  damping: jax.Array


class DampedDiagonal(NamedTuple):
  """Diagonal matrices, stored as their non-negative diagonal, with ``damping``."""
  values: jax.Array
  damping: jax.Array


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
  """``tr(M) / dim M``; a vector stands for the diagonal matrix it holds."""
  if matrix.ndim == 1:
    return jnp.mean(matrix)
  # Not jnp.trace: it selects the diagonal by masking the whole matrix, a
  # pass over its d² entries at every refresh.
  return jnp.sum(jnp.diagonal(matrix)) / matrix.shape[0]


def resolve_inverse(method: str) -> str:
  """The inverse method ``"auto"`` stands for: ``"cholesky"`` on every backend.

  On CPU (`cholesky.cholesky_inverse`), in the main example's training step
  at the recommended periods (inverses every 50 steps), it was the fastest,
  on a quiet machine and with one extra busy process (mean step 2.12× and
  2.82× Adam's; eigh 3.35× and 4.50×, Newton-Schulz 3.61× and 4.45×), and
  one inverse of a 1024² factor took 15 ms (23 ms busy) against
  Newton-Schulz's 38 ms (69 ms) from a nearby start (benchmarks/RESULTS.md,
  "The inverse refresh on a busy CPU"). On an H200, a refresh of the large
  transformer LM's factors took 10.9 ms with Cholesky and about 280-380 ms
  with eigh, the large autoencoder's about 90-100 ms with eigh; with
  Cholesky the recipe's mean step on the four large GPU workloads was
  1.26-1.44× Adam's, against 1.96-3.36× with eigh (RESULTS.md, "GPU
  (H200): summary").
  """
  return "cholesky" if method == "auto" else method


def damped_inverse(matrix: jax.Array, damping: jax.Array, method: str) -> jax.Array:
  """``(M + damping·I)⁻¹`` for a symmetric positive semi-definite ``M``.

  Args:
    matrix: symmetric PSD matrix (float32 or float64).
    damping: positive scalar added to the diagonal.
    method: ``"eigh"`` (eigenvalues clipped at 0 before damping, robust to
      round-off negativity), ``"cholesky"`` (faster, needs ``M + dI`` to be
      numerically positive definite; `invert_all` falls back to eigh where
      it is not; `cholesky.cholesky_inverse`, which on CPU keeps OpenBLAS's
      threads from spinning after the refresh), ``"newton_schulz"`` (matrix
      products only, `newton_schulz.newton_schulz_inverse` from the scaled identity;
      Cholesky where its residual stays above ``newton_schulz.NEWTON_SCHULZ_ACCEPTED``)
      or ``"auto"`` (`resolve_inverse`).

  Returns:
    The inverse, same shape as ``matrix``. Non-finite if the factorisation
    failed; callers keep the previous inverse in that case.
  """
  method = resolve_inverse(method)
  if method == "eigh":
    eigenvalues, eigenvectors = jnp.linalg.eigh(matrix)
    scale = 1.0 / (jnp.maximum(eigenvalues, 0.0) + damping)
    return (eigenvectors * scale) @ eigenvectors.T
  if method == "cholesky":
    return cholesky.cholesky_inverse(
        matrix + damping * jnp.eye(matrix.shape[0], dtype=matrix.dtype))
  if method == "newton_schulz":
    inverse, residual, _ = newton_schulz.newton_schulz_inverse(matrix, damping)
    return jax.lax.cond(residual <= newton_schulz.NEWTON_SCHULZ_ACCEPTED, lambda: inverse,
                        lambda: damped_inverse(matrix, damping, "cholesky"))
  raise ValueError(f"inverse must be one of {INVERSE_METHODS}, got {method!r}")


def damped_power(matrix: jax.Array, damping: jax.Array, power: float,
                 method: str) -> jax.Array:
  """``(M + damping·I)^power`` for a symmetric PSD ``M``.

  ``power=-1`` uses `damped_inverse` with ``method``; ``power=1`` adds the
  damping; any other power goes through ``eigh`` (eigenvalues clipped at 0).
  """
  if power == -1:
    return damped_inverse(matrix, damping, method)
  identity = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  if power == 1:
    return matrix + damping * identity
  eigenvalues, eigenvectors = jnp.linalg.eigh(matrix)
  scale = (jnp.maximum(eigenvalues, 0.0) + damping) ** power
  return (eigenvectors * scale) @ eigenvectors.T
