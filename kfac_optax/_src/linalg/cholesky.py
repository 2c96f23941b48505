"""Inverses of symmetric positive-definite matrices by Cholesky, and on CPU
without waking OpenBLAS's threads.

On CPU, jax's Cholesky and triangular solves are LAPACK/BLAS calls into
scipy's OpenBLAS. Above a small size (on the 2-core test machine: a
Cholesky factor of 256 rows, any triangular solve) OpenBLAS splits a call
over threads of its own, which then spin for about 0.1 s of CPU waiting for
more work, on cores that XLA's thread pool already uses. Each refresh
therefore slowed the training steps after it: in the main example
(inverses every 50 steps of 2-3 ms) the mean K-FAC step was 3.6 ms with
LAPACK's inverse, 2.4 ms with `cholesky_inverse` (`benchmarks/RESULTS.md`,
"Wall-clock summary").

`cholesky_inverse` factorises by blocks: LAPACK sees only diagonal blocks of
at most `BLOCK` rows (small enough to stay on the calling thread), and the
panels, the trailing updates and the inverse of the factor are XLA matrix
products and XLA's own triangular solves, on XLA's threads.
"""

import jax
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import batching
from jax.interpreters import mlir
import jax.numpy as jnp

# Rows of the diagonal blocks handed to LAPACK. Measured on the 2-core
# machine, OpenBLAS's Cholesky stays on the calling thread up to 200 rows
# and wakes its pool from 256; blocks of 128 leave a margin. Against
# LAPACK's threaded inverse on a quiet machine: 785 rows 6.3 vs 7.5 ms,
# 2048 rows 113 vs 101 ms, 4608 rows 1.18 vs 1.00 s.
BLOCK = 128


def cholesky_inverse(matrix: jax.Array) -> jax.Array:
  """``matrix⁻¹`` for a symmetric positive-definite ``(d, d)`` ``matrix``.

  With ``L Lᵀ = matrix`` (`blocked_cholesky` on CPU, jax's own elsewhere),
  ``matrix⁻¹ = L⁻ᵀ L⁻¹``. Non-finite (NaN) where the factorisation fails.
  """
  if jax.default_backend() != "cpu":
    factor = jax.scipy.linalg.cho_factor(matrix, lower=True)
    return jax.scipy.linalg.cho_solve(
        factor, jnp.eye(matrix.shape[-1], dtype=matrix.dtype))
  # `zeros_like` varies over the mesh axes that `matrix` varies over (inside
  # shard_map), as the triangular solve needs of its two operands.
  identity = jnp.zeros_like(matrix) + jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  inverse_factor = triangular_solve(blocked_cholesky(matrix), identity)
  return inverse_factor.T @ inverse_factor


def blocked_cholesky(matrix: jax.Array, block: int = BLOCK) -> jax.Array:
  """The lower Cholesky factor ``L`` of ``matrix``, ``block`` columns at a time.

  Right-looking: with ``A = [[A₁₁, ·], [A₂₁, A₂₂]]`` and ``A₁₁`` of ``block``
  rows, ``L₁₁ = chol(A₁₁)`` (LAPACK), ``L₂₁ = A₂₁ L₁₁⁻ᵀ``, then the same for
  the Schur complement ``A₂₂ - L₂₁ L₂₁ᵀ``. NaN where ``matrix`` is not
  numerically positive definite (jax's Cholesky of that block is NaN, and
  the NaNs flow through the rest).
  """
  size = matrix.shape[-1]
  columns = []
  trailing = matrix
  for start in range(0, size, block):
    diagonal = jnp.linalg.cholesky(trailing[:block, :block])
    below = triangular_solve(diagonal, trailing[block:, :block], left_side=False,
                             transpose_a=True)
    above = jnp.zeros((start, diagonal.shape[1]), matrix.dtype)
    columns.append(jnp.concatenate([above, diagonal, below]))
    trailing = trailing[block:, block:] - below @ below.T
  return jnp.concatenate(columns, axis=1)


def triangular_solve(lower: jax.Array, b: jax.Array, *, left_side: bool = True,
                     transpose_a: bool = False) -> jax.Array:
  """``X`` with ``op(lower) X = b`` (``left_side``) or ``X op(lower) = b``,
  ``op`` the transpose if ``transpose_a``, ``lower`` lower triangular.

  `jax.lax.linalg.triangular_solve`'s operation lowered to XLA's own
  triangular solve on every backend (jax's is a BLAS call on CPU). Not
  differentiable (the factor inverses never are).
  """
  if 0 in b.shape:
    return b
  return _triangular_solve_p.bind(lower, b, left_side=left_side, lower=True,
                                  transpose_a=transpose_a, conjugate_a=False,
                                  unit_diagonal=False)


def _lowering(ctx, a, b, *, left_side, lower, transpose_a, conjugate_a,
              unit_diagonal):
  del ctx, conjugate_a  # real matrices only
  transpose = "TRANSPOSE" if transpose_a else "NO_TRANSPOSE"
  return [stablehlo.triangular_solve(
      a, b, left_side=left_side, lower=lower, unit_diagonal=unit_diagonal,
      transpose_a=stablehlo.TransposeAttr.get(transpose))]


def _eager(*args, **params):
  return jax.jit(lambda *args: _triangular_solve_p.bind(*args, **params))(*args)


def _batching_rule(args, dims, **params):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  a, b = (batching.bdim_at_front(x, d, size) for x, d in zip(args, dims))
  return _triangular_solve_p.bind(a, b, **params), 0


_triangular_solve_p = Primitive("kfac_optax_triangular_solve")
_triangular_solve_p.def_impl(_eager)
# jax's own rule: the output's shape, dtype, sharding and the mesh axes it
# varies over (inside shard_map), as for `jax.lax.linalg.triangular_solve`.
_triangular_solve_p.def_effectful_abstract_eval(
    jax.lax.linalg.triangular_solve_p.abstract_eval)
mlir.register_lowering(_triangular_solve_p, _lowering)
batching.primitive_batchers[_triangular_solve_p] = _batching_rule
