"""Newton-Schulz damped inverses against explicit float64 inverses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kfac_optax._src import linalg
from kfac_optax._src.linalg import damped
from kfac_optax._src.linalg import newton_schulz as newton_schulz_module
from tests import brute_force as bf

newton_schulz = jax.jit(newton_schulz_module.newton_schulz_inverse)
damped_inverse = jax.jit(damped.damped_inverse, static_argnums=2)


def spd(n, condition, seed=0):
  """A float32 SPD matrix with eigenvalues spread log-uniformly over ``condition``."""
  q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
  return jnp.asarray((q * np.logspace(0, -np.log10(condition), n)) @ q.T, jnp.float32)


def explicit(matrix, damping):
  matrix = np.asarray(matrix, np.float64)
  return np.linalg.inv(matrix + float(damping) * np.eye(len(matrix)))


# κ(M + δI) = 1e1, 1e3, 1e5: iterated to float32 round-off, ~κ ε.
@pytest.mark.parametrize("n,condition,tolerance", [
    (8, 1e1, 1e-6), (40, 1e3, 1e-4), (40, 1e5, 1e-2)])
def test_matches_the_explicit_inverse(n, condition, tolerance):
  matrix, damping = spd(n, condition), jnp.float32(1e-12)
  result = newton_schulz(matrix, damping)
  assert bf.relative_error(result.inverse, explicit(matrix, damping)) < tolerance
  assert float(result.residual) <= newton_schulz_module.NEWTON_SCHULZ_ACCEPTED
  np.testing.assert_array_equal(result.inverse, result.inverse.T)
  assert bf.relative_error(damped_inverse(matrix, damping, "newton_schulz"),
                           explicit(matrix, damping)) < tolerance


def test_a_warm_start_converges_in_few_iterations():
  """From the inverse of a nearby factor (new statistics close to the old)."""
  damping = jnp.float32(1e-3)
  old = spd(40, 1e3)
  noise = jnp.asarray(np.random.default_rng(1).normal(size=(40, 40)), jnp.float32)
  noise = (noise + noise.T) / jnp.linalg.norm(noise + noise.T, 2)
  new = 1.05 * old + 0.3 * damping * noise
  previous = newton_schulz(old, damping).inverse
  cold, warm = newton_schulz(new, damping), newton_schulz(new, damping, previous)
  for result in (cold, warm):
    assert bf.relative_error(result.inverse, explicit(new, damping)) < 1e-3
  assert int(warm.iterations) <= 4 < 10 <= int(cold.iterations)


@pytest.mark.parametrize("change", [1e-2, 0.1, 10.0, 100.0])
def test_a_damping_change_between_refreshes_still_converges(change):
  matrix = spd(40, 1e4)
  previous = newton_schulz(matrix, jnp.float32(1e-3)).inverse
  damping = jnp.float32(1e-3 * change)
  result = newton_schulz(matrix, damping, previous)
  assert bf.relative_error(result.inverse, explicit(matrix, damping)) < 1e-3
  assert float(result.residual) <= newton_schulz_module.NEWTON_SCHULZ_ACCEPTED


def test_a_useless_start_falls_back_to_the_scaled_identity():
  matrix, damping = spd(20, 1e2), jnp.float32(1e-2)
  for start in (jnp.eye(20) * 1e4, -jnp.eye(20), jnp.zeros((20, 20))):
    result = newton_schulz(matrix, damping, start)
    assert bf.relative_error(result.inverse, explicit(matrix, damping)) < 1e-3


def test_an_inaccurate_result_is_replaced_by_cholesky():
  """κ = 1e8 is beyond float32 Newton-Schulz: its residual stays large; a
  stack replaces it as `test_cholesky_falls_back_to_eigh_where_it_fails`."""
  matrix, damping = spd(40, 1e8), jnp.float32(1e-12)
  assert float(newton_schulz(matrix, damping).residual) > newton_schulz_module.NEWTON_SCHULZ_ACCEPTED
  np.testing.assert_array_equal(damped_inverse(matrix, damping, "newton_schulz"),
                                damped_inverse(matrix, damping, "cholesky"))
  # In a stack only that member is replaced; the warm start is padded.
  good, bad = spd(40, 1e2, seed=1), matrix
  tree = {"good": linalg.Damped(good[None], jnp.ones(1, jnp.float32)),
          "bad": linalg.Damped(bad[None], damping[None]),
          "small": linalg.Damped(good[None, :38, :38], jnp.ones(1, jnp.float32))}
  previous = {"good": jnp.eye(40)[None] / 2, "bad": jnp.eye(40)[None],
              "small": jnp.eye(38)[None] / 2}
  inverted = jax.jit(lambda t, p: linalg.invert_all(t, "newton_schulz", previous=p))(
      tree, previous)
  # Cholesky's residual is as large at κ = 1e8: the stack's chain ends in eigh.
  assert bf.relative_error(inverted["bad"][0], damped_inverse(bad, damping, "eigh")) < 1e-4
  for key in ("good", "small"):
    assert bf.relative_error(inverted[key][0], explicit(tree[key].matrix[0], 1.0)) < 1e-3


@pytest.mark.parametrize("damping", [1e-9, 1e-3])
def test_cholesky_falls_back_to_eigh_where_it_fails(damping):
  """A singular factor with a damping near float32's round-off of it:
  Cholesky's inverse is NaN (1e-9) or finite but far off (1e-3: residual
  above 1); in a stack, that member alone is inverted by eigh."""
  rows = 10 * np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
  singular, tiny = jnp.asarray(rows @ rows.T), jnp.float32(damping)
  cholesky = damped_inverse(singular, tiny, "cholesky")
  identity = jnp.eye(64)
  residual = jnp.linalg.norm(identity - (singular + tiny * identity) @ cholesky)
  assert not residual <= newton_schulz_module.NEWTON_SCHULZ_ACCEPTED
  good, one = spd(64, 1e2, seed=1), jnp.float32(1.0)
  tree = {"good": linalg.Damped(good[None], one[None]),
          "singular": linalg.Damped(singular[None], tiny[None])}
  inverted = jax.jit(lambda t: linalg.invert_all(t, "cholesky"))(tree)
  np.testing.assert_array_equal(inverted["good"][0], damped_inverse(good, one, "cholesky"))
  assert bf.relative_error(inverted["singular"][0],
                           damped_inverse(singular, tiny, "eigh")) < 1e-4


def test_non_finite_input_gives_a_non_finite_inverse():
  matrix = spd(8, 1e1).at[0, 0].set(jnp.nan)
  assert not np.isfinite(damped_inverse(matrix, jnp.float32(1e-2), "newton_schulz")).all()


def test_float64_is_iterated_to_its_round_off():
  with jax.enable_x64(True):
    matrix, damping = jnp.asarray(spd(40, 1e3), jnp.float64), jnp.float64(1e-3)
    result = newton_schulz_module.newton_schulz_inverse(matrix, damping)
    assert result.inverse.dtype == jnp.float64
    error = bf.relative_error(result.inverse, explicit(matrix, damping))
    assert error < 1e-11


def test_auto_is_cholesky():
  assert damped.resolve_inverse("auto") == "cholesky"
  assert damped.resolve_inverse("eigh") == "eigh"
