"""Damped factor inverses kept at low rank (the ``factor_rank`` option).

A Kronecker factor ``M`` (d×d, PSD) is approximated by its top k
eigenpairs and the mean ρ of its other d - k eigenvalues,
``M ≈ U diag(μ) Uᵀ + ρ (I - U Uᵀ)`` (same trace as ``M``), whose damped
inverse is exactly

    (M + δI)⁻¹ ≈ U diag(1/(μ + δ) - 1/(ρ + δ)) Uᵀ + I / (ρ + δ).

Stored as ``U`` (d×k) and two small vectors, it multiplies a d×m matrix in
O(d k m) instead of O(d² m), and the refresh costs O(d² k) instead of
O(d³). Martens & Grosse's factors of wide layers (image pixels, im2col
patches) have fast-decaying spectra, where little is lost (measured in
benchmarks/RESULTS.md, "Low-rank factor inverses"). The eigenpairs come from
subspace iteration (Halko, Martinsson & Tropp 2011, Algorithm 4.4) started
from the previous refresh's basis, as in randomized K-FAC (Puiu 2022):
factors change little between refreshes.
"""

import itertools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

# Columns added to the k of the basis while iterating (Halko et al.'s
# oversampling): they let directions that move into the top k be found.
OVERSAMPLE = 8
# Products with M per refresh (each followed by `orthonormal_columns`).
ITERATIONS = 2


class LowRankInverse(NamedTuple):
  """``floor·I + basis diag(weights) basisᵀ``, the damped inverse of a factor
  kept at rank k (leading stack axes ``...`` on every field).

  Attributes:
    basis: ``(..., d, k)``, orthonormal columns: the factor's top-k
      eigenvectors (their estimates).
    weights: ``(..., k)``, ``1/(μ + δ) - floor`` for their eigenvalues μ.
    floor: ``(...)``, ``1/(ρ + δ)``: the inverse on the other directions.
  """
  basis: jax.Array
  weights: jax.Array
  floor: jax.Array

  @property
  def dtype(self):
    return self.floor.dtype


def applies(size: int, rank: int | None) -> bool:
  """Whether a full factor of ``size`` rows is inverted at ``rank`` (None:
  every factor exactly): only above it, where the rank truncates."""
  return rank is not None and size > rank


def identity(shape: tuple, rank: int, dtype) -> LowRankInverse:
  """The identity of ``shape`` ``(..., d, d)`` as a rank-``rank``
  `LowRankInverse` (the inverses in use before the first refresh)."""
  lead, size = shape[:-2], shape[-1]
  return LowRankInverse(jnp.zeros((*lead, size, rank), dtype),
                        jnp.zeros((*lead, rank), dtype), jnp.ones(lead, dtype))


def damped_inverse(matrix: jax.Array, damping: jax.Array,
                   previous_basis: jax.Array,
                   eigh: Callable[[jax.Array], Any] = jnp.linalg.eigh) -> LowRankInverse:
  """`LowRankInverse` of ``(matrix + damping·I)``, over leading stack axes.

  Args:
    matrix: ``(..., d, d)``, symmetric PSD.
    damping: ``(...)``, positive.
    previous_basis: ``(..., d, k)``, the basis in use (zeros before the
      first refresh: the iteration then starts from the k columns of
      ``matrix`` with the largest diagonal, as good a guess as any without
      a basis). k sets the rank; ``k < d``.
    eigh: ``jnp.linalg.eigh`` or an equivalent over the stack of the small
      projected matrices (`linalg` runs LAPACK one matrix at a time on CPU);
      the rest, matrix products and Gram-Schmidt, is batched over the stack.
  """
  size, rank = previous_basis.shape[-2:]
  extra = min(OVERSAMPLE, size - rank)
  # The largest-diagonal columns lie in the factor's range, near its top.
  diagonal = jnp.diagonal(matrix, axis1=-2, axis2=-1)
  largest = jnp.argsort(-diagonal, axis=-1)
  columns = jnp.take_along_axis(matrix, largest[..., None, :rank + extra], axis=-1)
  has_basis = jnp.any(previous_basis != 0, axis=(-2, -1), keepdims=True)
  start = jnp.where(has_basis, previous_basis, columns[..., :rank])
  basis = jnp.concatenate([start, columns[..., rank:]], axis=-1)
  for _ in range(ITERATIONS):
    basis = orthonormal_columns(matrix @ basis)
  # Rayleigh-Ritz: the best eigenpairs within the iterated subspace.
  ritz_values, ritz_vectors = eigh(_transpose(basis) @ matrix @ basis)
  top = jnp.maximum(ritz_values[..., -rank:], 0.0)
  trace = jnp.sum(diagonal, axis=-1)  # jnp.trace masks the whole matrix
  rest = jnp.maximum(trace - jnp.sum(top, axis=-1), 0.0) / (size - rank)
  floor = 1.0 / (rest + damping)
  return LowRankInverse(basis @ ritz_vectors[..., -rank:],
                        1.0 / (top + damping[..., None]) - floor[..., None], floor)


def orthonormal_columns(y: jax.Array) -> jax.Array:
  """Orthonormal columns spanning those of ``y`` (``(..., d, n)``, over
  leading stack axes), and zero columns for its rank deficit (a factor of
  rank < n: few examples so far).

  Classical Gram-Schmidt with reorthogonalisation (each column projected
  off the earlier ones twice, which keeps them orthogonal to round-off:
  Giraud et al. 2005), one column per loop step for the whole stack. Not
  jax's QR: on CPU it is an OpenBLAS call whose threads then spin for
  ~0.1 s on the cores of the next training steps (see `cholesky`); nor an
  eigh of the Gram ``yᵀy``, which squares the columns' condition number
  (that of ``M`` on the subspace): in float32 it lost the weaker
  directions of image factors. A column whose remainder is below ``n·ε``
  of its norm is dependent: zero.
  """
  threshold = y.shape[-1] * jnp.finfo(y.dtype).eps

  def column(j, q):
    original = y[..., j]
    v = original
    for _ in range(2):  # q's columns from j on are still zero
      v = v - (q @ (_transpose(q) @ v[..., None]))[..., 0]
    norm = jnp.linalg.norm(v, axis=-1, keepdims=True)
    independent = norm > threshold * jnp.linalg.norm(original, axis=-1, keepdims=True)
    return q.at[..., j].set(jnp.where(independent, v / jnp.where(independent, norm, 1.0), 0.0))
  return jax.lax.fori_loop(0, y.shape[-1], column, jnp.zeros_like(y))


def _transpose(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, -1, -2)


def left_multiply(inverse, matrix: jax.Array) -> jax.Array:
  """``inverse @ matrix`` over leading stack axes; ``inverse`` a dense stack
  or a `LowRankInverse`."""
  if not isinstance(inverse, LowRankInverse):
    return inverse @ matrix
  projected = _transpose(inverse.basis) @ matrix
  return (inverse.floor[..., None, None] * matrix
          + inverse.basis @ (inverse.weights[..., None] * projected))


def right_multiply(matrix: jax.Array, inverse) -> jax.Array:
  """``matrix @ inverse`` over leading stack axes (the inverse is symmetric)."""
  if not isinstance(inverse, LowRankInverse):
    return matrix @ inverse
  projected = (matrix @ inverse.basis) * inverse.weights[..., None, :]
  return (inverse.floor[..., None, None] * matrix
          + projected @ _transpose(inverse.basis))


def sandwich(left: LowRankInverse, blocks: Sequence[jax.Array],
             right: LowRankInverse) -> list[jax.Array]:
  """``left @ V @ right`` for ``V`` the rows of ``blocks`` stacked in order
  (each ``(..., r_i, m)``, e.g. a kernel's rows and its bias row), returned
  as blocks of the same rows; ``V`` itself is never formed.

  With ``L = f_L I + B_L W_L B_Lᵀ``, ``R = f_R I + B_R W_R B_Rᵀ``,
  ``P = B_Lᵀ V`` and ``Q = V B_R``:

      L V R = f_L f_R V + [B_L | f_L Q W_R] [W_L (f_R P + P B_R W_R B_Rᵀ); B_Rᵀ],

  one product of inner size k_L + k_R after the two thin ones: fewer passes
  over params-sized arrays than `left_multiply` then `right_multiply` of
  the concatenated ``V`` (whose copy XLA made once per consumer), and such
  passes, not the O(d k m) products, set the cost on a CPU. With the
  narrower dtype-fit check, the deep autoencoder's rank-32 preconditioning
  went from 19 to 8 ms on 2 CPU cores (`benchmarks/preconditioning.py`).
  """
  rows = [block.shape[-2] for block in blocks]
  left_bases = jnp.split(left.basis, list(itertools.accumulate(rows))[:-1], axis=-2)
  projected = sum(_transpose(b) @ x for b, x in zip(left_bases, blocks))  # P
  right_basis_t = _transpose(right.basis)
  core = (projected @ right.basis) * right.weights[..., None, :]  # P B_R W_R
  top = left.weights[..., None] * (right.floor[..., None, None] * projected
                                   + core @ right_basis_t)
  rest = jnp.concatenate([top, right_basis_t], axis=-2)
  scale = (left.floor * right.floor)[..., None, None]
  return [scale * x + jnp.concatenate(
      [b, left.floor[..., None, None] * (x @ right.basis) * right.weights[..., None, :]],
      axis=-1) @ rest for b, x in zip(left_bases, blocks)]
