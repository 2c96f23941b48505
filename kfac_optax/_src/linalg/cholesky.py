"""Inverses of symmetric positive-definite matrices, and on CPU without
waking OpenBLAS's threads or unrolling a loop per block.

On CPU, jax's Cholesky and triangular solves are LAPACK/BLAS calls into
scipy's OpenBLAS. Above a small size (on the 2-core test machine: a
Cholesky factor of 256 rows, any triangular solve) OpenBLAS splits a call
over threads of its own, which then spin for about 0.1 s of CPU waiting for
more work, on cores that XLA's thread pool already uses. Each refresh
therefore slowed the training steps after it: in the main example
(inverses every 50 steps of 2-3 ms) the mean K-FAC step was 3.6 ms with
LAPACK's inverse, 2.4 ms with a blocked inverse that hands LAPACK only
small blocks (`benchmarks/RESULTS.md`, "Wall-clock summary").

`cholesky_inverse` on CPU is such a blocked inverse, a symmetric block
Gauss-Jordan sweep (`sweep_inverse`): LAPACK sees only pivot blocks of at
most `BLOCK` rows, everything else is XLA matrix products and XLA's own
triangular solves. Its steps all have one shape, so it is one
`lax.fori_loop` whose body compiles once. Against the blocked Cholesky
factor it replaced (unrolled over its shrinking trailing blocks), on 2
cores: the first call, compile included, 4.4 s at 2048 rows and 12.7 s at
4096, the sweep's 0.6 and 2.1 s; one inverse 0.28 and 3.1 s, the sweep's
0.20 and 1.6 s (benchmarks/RESULTS.md, "Compile time of the training step").
"""

import jax
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import batching
from jax.interpreters import mlir
import jax.numpy as jnp

# Rows of the pivot blocks handed to LAPACK. Measured on the 2-core
# machine, OpenBLAS's Cholesky stays on the calling thread up to 200 rows
# and wakes its pool from 256; blocks of 128 leave a margin.
BLOCK = 128


def cholesky_inverse(matrix: jax.Array) -> jax.Array:
  """``matrix⁻¹`` for a symmetric positive-definite ``(d, d)`` ``matrix``.

  jax's Cholesky solve off CPU; on CPU `sweep_inverse`. Non-finite (NaN)
  where the factorisation fails.
  """
  if jax.default_backend() != "cpu":
    factor = jax.scipy.linalg.cho_factor(matrix, lower=True)
    return jax.scipy.linalg.cho_solve(
        factor, jnp.eye(matrix.shape[-1], dtype=matrix.dtype))
  return sweep_inverse(matrix)


def sweep_inverse(matrix: jax.Array, block: int = BLOCK) -> jax.Array:
  """``matrix⁻¹`` by a symmetric block Gauss-Jordan sweep, pivots of at most
  ``block`` rows.

  With ``P`` the pivot block of rows ``K`` and ``C`` the rest of its
  columns, sweeping on ``K`` maps

  .. math::
    \\begin{pmatrix} P & Cᵀ \\\\ C & S \\end{pmatrix} ↦
    \\begin{pmatrix} -P⁻¹ & (C P⁻¹)ᵀ \\\\ C P⁻¹ & S - C P⁻¹ Cᵀ \\end{pmatrix};

  sweeping on every block in turn gives ``-matrix⁻¹``. Each pivot is a
  Schur complement of ``matrix``, positive definite when ``matrix`` is, so
  no pivoting is needed. With ``L`` LAPACK's Cholesky factor of ``P`` and
  ``W = C L⁻ᵀ``, the update is ``S - W Wᵀ`` and ``C P⁻¹ = W L⁻¹``: the
  Schur complement is a blocked Cholesky's trailing update, as accurate
  (forming ``P⁻¹`` first lost up to 10× the accuracy at condition 10⁴).
  About ``2d³`` flops, nearly all in ``(d, b) × (b, d)`` products. The
  matrix is padded with an identity block to ``n`` blocks of equal size
  ``b`` (``n = ⌈d / block⌉``, under ``n`` padding rows), which leaves the
  leading block of the inverse unchanged. NaN where ``matrix`` is not
  numerically positive definite (a pivot's Cholesky is NaN, and the NaNs
  flow through the rest).
  """
  size = matrix.shape[-1]
  num_blocks = -(-size // block)
  if num_blocks == 1:
    inverse_factor = _inverse_cholesky_factor(matrix)
    return inverse_factor.T @ inverse_factor
  rows = -(-size // num_blocks)
  padded = num_blocks * rows
  swept = jnp.pad(matrix, ((0, padded - size), (0, padded - size))) + jnp.diag(
      jnp.arange(padded) >= size).astype(matrix.dtype)
  index = jnp.arange(padded)

  def sweep(k, a):
    start = k * rows
    inverse_factor = _inverse_cholesky_factor(
        jax.lax.dynamic_slice(a, (start, start), (rows, rows)))
    pivot_rows = (index >= start) & (index < start + rows)
    others = jnp.where(pivot_rows[:, None], 0.0,
                       jax.lax.dynamic_slice(a, (0, start), (padded, rows)))
    whitened = others @ inverse_factor.T
    column = jax.lax.dynamic_update_slice(
        whitened @ inverse_factor, -inverse_factor.T @ inverse_factor, (start, 0))
    a = a - whitened @ whitened.T
    a = jax.lax.dynamic_update_slice(a, column, (0, start))
    return jax.lax.dynamic_update_slice(a, column.T, (start, 0))

  inverse = -jax.lax.fori_loop(0, num_blocks, sweep, swept)[:size, :size]
  return 0.5 * (inverse + inverse.T)


def _inverse_cholesky_factor(matrix: jax.Array) -> jax.Array:
  """``L⁻¹`` with ``L`` LAPACK's Cholesky factor of a small ``matrix``."""
  # `zeros_like` varies over the mesh axes that `matrix` varies over (inside
  # shard_map), as the triangular solve needs of its two operands.
  identity = jnp.zeros_like(matrix) + jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
  return triangular_solve(jnp.linalg.cholesky(matrix), identity)


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
