"""Damped inverses by Newton-Schulz iterations: matrix products only."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

NEWTON_SCHULZ_MAX_ITERATIONS = 40

# The largest residual ‖I - (M + δI) X‖_F accepted from Newton-Schulz (else
# Cholesky) and from Cholesky (else eigh).
NEWTON_SCHULZ_ACCEPTED = 0.1


def newton_schulz_tolerance(dtype: Any) -> float:
  """The residual Newton-Schulz stops at: ``8 eps`` of ``dtype`` (9.5e-7
  for float32), round-off. So the result is as accurate as the dtype
  allows (the stall test of `newton_schulz_inverse` ends it earlier for
  ill-conditioned factors) and does not depend on the start, which keeps
  runs that differ only in their previous inverses alike."""
  return 8 * float(jnp.finfo(dtype).eps)


class NewtonSchulz(NamedTuple):
  """`newton_schulz_inverse`'s result."""
  inverse: jax.Array
  residual: jax.Array    # ‖I - (M + δI) X‖_F of the returned X
  iterations: jax.Array  # iterations run (the rejected last one included)


def newton_schulz_inverse(
    matrix: jax.Array, damping: jax.Array, previous: jax.Array | None = None, *,
    tolerance: float | None = None,
    max_iterations: int = NEWTON_SCHULZ_MAX_ITERATIONS) -> NewtonSchulz:
  """``(M + δI)⁻¹`` by Newton-Schulz iterations: matrix products only.

  With ``D = M + δI`` and the residual ``R_k = I - D X_k``,

  .. math::
    X_{k+1} = X_k (2I - D X_k) = X_k + X_k R_k, \\quad R_{k+1} = R_k^2,

  so the residual's eigenvalues square at every step: quadratic convergence
  once ``‖R‖ < 1``. The error of the result is ``D⁻¹ - X = D⁻¹ R`` (relative
  error ``‖R‖₂ ≤ ‖R‖_F`` in every direction). No LAPACK call: the products
  run on XLA's own threads (on CPU, LAPACK's OpenBLAS threads contend with
  XLA's on a busy machine).

  Start: ``previous`` (the last refresh's inverse: factors change little
  between refreshes, so a few iterations suffice) when its residual has
  Frobenius norm below 1, which guarantees convergence (the spectral
  radius is at most that norm); else ``I / ‖D‖_∞``: the max-row-sum norm
  bounds D's eigenvalues, so the residual's eigenvalues ``1 - λ_i/‖D‖_∞``
  lie in ``[0, 1)`` and shrink monotonically (about ``log₂ κ(D)`` more
  iterations). Iterates until ``‖R‖_F ≤ tolerance``, or until an iteration
  stops reducing it or, below 1e-2, fails to halve it (round-off,
  ``≈ κ(D) ε``, has taken over), keeping the best iterate; at most
  ``max_iterations``.

  Args:
    matrix: a symmetric PSD ``M`` (d, d).
    damping: δ > 0.
    previous: an approximate inverse to start from, or None.
    tolerance: the residual to stop at (default:
      `newton_schulz_tolerance` of the matrix's dtype).
    max_iterations: the most iterations.

  Returns:
    `NewtonSchulz`: the symmetrised inverse, its residual norm (callers fall
    back to another method when it is large; nan for non-finite input) and
    the iterations run.

  References:
    Schulz, "Iterative Berechnung der reziproken Matrix", ZAMM 1933;
    Pan & Schreiber, "An improved Newton iteration for the generalized
    inverse of a matrix", SIAM J. Sci. Stat. Comput. 1991 (the scaled
    identity start).
  """
  if tolerance is None:
    tolerance = newton_schulz_tolerance(matrix.dtype)
  identity = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  damped = matrix + damping * identity
  residual_of = lambda x: identity - damped @ x
  norm = lambda r: jnp.sqrt(jnp.sum(r * r))
  scale = 1 / jnp.max(jnp.sum(jnp.abs(damped), axis=1))
  start, r0 = scale * identity, identity - scale * damped
  if previous is not None:
    warm = previous.astype(matrix.dtype)
    warm_r = residual_of(warm)
    use = norm(warm_r) < 1
    start, r0 = jnp.where(use, warm, start), jnp.where(use, warm_r, r0)

  def running(carry):
    k, _, _, size, done = carry
    return (k < max_iterations) & ~done & (size > tolerance)

  def iterate(carry):
    k, x, r, size, _ = carry
    new_x = x + x @ r
    new_r = residual_of(new_x)
    new_size = norm(new_r)
    better = new_size < size
    # Below 1e-2 the residual squares at every step; a smaller gain means
    # round-off has taken over.
    stalled = (size < 1e-2) & (new_size > size / 2)
    pick = lambda new, old: jnp.where(better, new, old)
    return (k + 1, pick(new_x, x), pick(new_r, r), pick(new_size, size),
            ~better | stalled)

  size = norm(r0)  # counters derived from it: varying like it under shard_map
  k, x, _, size, _ = jax.lax.while_loop(
      running, iterate, (jnp.zeros_like(size, jnp.int32), start, r0, size,
                         jnp.zeros_like(size, bool)))
  return NewtonSchulz((x + x.T) / 2, size, k)
