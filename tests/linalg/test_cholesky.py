"""Blocked inverses of SPD matrices and XLA triangular solves (`linalg.cholesky`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_optax._src.linalg import cholesky
from tests import brute_force as bf


def _spd(size, seed=0, damping=1e-3):
  """A rank-deficient Gram matrix plus ``damping·I`` (condition ~1e4)."""
  x = np.random.default_rng(seed).standard_normal((size // 2 + 1, size))
  return (x.T @ x / size + damping * np.eye(size)).astype(np.float32)


@pytest.mark.parametrize("size", [7, 8, 9, 30])
def test_sweep_inverse_is_the_inverse(size):
  # Blocks of 8: one pivot, one, two and four (30 = 4 blocks of 8 less 2 padding rows).
  matrix = _spd(size)
  inverse = jax.jit(lambda m: cholesky.sweep_inverse(m, block=8))(matrix)
  assert bf.relative_error(inverse, np.linalg.inv(matrix.astype(np.float64))) < 1e-4
  np.testing.assert_array_equal(inverse, np.asarray(inverse).T)


@pytest.mark.parametrize("size", [5, 129])
def test_cholesky_inverse_matches_explicit_inverse(size):
  matrix = _spd(size)
  expected = np.linalg.inv(matrix.astype(np.float64))
  assert bf.relative_error(jax.jit(cholesky.cholesky_inverse)(matrix), expected) < 1e-4


def test_cholesky_inverse_is_nan_where_not_positive_definite():
  matrix = np.eye(140, dtype=np.float32)
  matrix[135, 135] = -1.0  # in the second block
  assert np.isnan(jax.jit(cholesky.cholesky_inverse)(matrix)).any()


@pytest.mark.parametrize("left_side", [True, False])
@pytest.mark.parametrize("transpose_a", [True, False])
def test_triangular_solve_solves(left_side, transpose_a):
  lower = np.linalg.cholesky(_spd(6).astype(np.float64))
  b = np.random.default_rng(1).standard_normal((6, 4) if left_side else (4, 6))
  x = np.asarray(jax.jit(lambda a, b: cholesky.triangular_solve(
      a, b, left_side=left_side, transpose_a=transpose_a))(
          lower.astype(np.float32), b.astype(np.float32)), np.float64)
  op = lower.T if transpose_a else lower
  np.testing.assert_allclose(op @ x if left_side else x @ op, b, atol=1e-4)


def test_triangular_solve_under_vmap():
  lowers = np.stack([np.linalg.cholesky(_spd(6, seed)) for seed in range(3)])
  bs = np.random.default_rng(2).standard_normal((3, 6, 2)).astype(np.float32)
  both = jax.vmap(cholesky.triangular_solve)(lowers, bs)
  only_b = jax.vmap(cholesky.triangular_solve, in_axes=(None, 2), out_axes=2)(
      lowers[0], bs.transpose(1, 2, 0))
  for i in range(3):
    np.testing.assert_allclose(lowers[i] @ both[i], bs[i], atol=1e-4)
    np.testing.assert_allclose(lowers[0] @ only_b[..., i], bs[i], atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path")
def test_lapack_sees_only_small_blocks_on_cpu_in_one_loop():
  # What keeps OpenBLAS's threads asleep: no BLAS triangular solve, and
  # LAPACK's Cholesky only of blocks of at most `BLOCK` rows; and what keeps
  # the compile short: one Cholesky call, in a loop over the three pivots.
  size = 2 * cholesky.BLOCK + 3
  hlo = jax.jit(cholesky.cholesky_inverse).lower(
      jnp.zeros((size, size))).compile().as_text()
  calls = [line for line in hlo.splitlines() if "custom_call_target=" in line]
  assert not any("trsm" in line for line in calls)
  potrf = [line for line in calls if "potrf" in line]
  rows = {int(n) for line in potrf for n in re.findall(r"f32\[(\d+),\d+\]", line)}
  assert len(potrf) == 1 and rows == {-(-size // 3)}
