"""Tiled factors (``factor_block_size``) against explicit block-diagonal
Kronecker products."""

import jax
import numpy as np
import pytest

import kfac_optax
from tests import brute_force as bf


def block_diagonal(matrix, tile):
  """``matrix`` with every entry outside its diagonal ``tile × tile`` tiles
  zeroed (the last tile smaller)."""
  owner = np.arange(len(matrix)) // tile
  return np.where(owner[:, None] == owner[None, :], matrix, 0.0)


def tiny_kfac(**options):
  params, batch = bf.tiny_problem(n=6, d_in=5)
  tx = kfac_optax.scale_by_kfac(
      bf.TinyMLP().apply, kfac_optax.losses.softmax_cross_entropy(),
      example_batch=batch, damping=1e-2, estimation="empirical", **options)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(5), p.shape), params)
  return tx, params, batch, grads


@pytest.mark.parametrize("tile", [2, 3])
def test_update_matches_the_explicit_block_diagonal_kronecker(tile):
  """Tile 2: every factor tiled, 3-row ones into a tile of 2 and a padded
  one; tile 3: the 3-row factors whole, the others in two tiles."""
  tx, params, batch, grads = tiny_kfac(factor_block_size=tile)
  updates, state = jax.jit(lambda s: tx.update(grads, s, params, batch=batch))(
      tx.init(params))
  assert state.factors["hidden"].a.shape == (1, -(-6 // tile), tile, tile)

  expected, whole = {}, {}
  for name, (a, g) in bf.factors(params, batch, "empirical").items():
    tiled = [block_diagonal(f, tile) for f in (a, g)]
    # π from the tiles' traces, which are the whole factors'.
    np.testing.assert_allclose(bf.pi_damping(*tiled, 1e-2), bf.pi_damping(a, g, 1e-2))
    expected[name] = bf.kronecker_precondition(
        *tiled, grads[name]["kernel"], grads[name].get("bias"), 1e-2)
    whole[name] = bf.kronecker_precondition(
        a, g, grads[name]["kernel"], grads[name].get("bias"), 1e-2)
  assert bf.relative_error(updates, expected) < 1e-4
  assert bf.relative_error(updates, whole) > 1e-2  # the tiles mattered


def test_factors_no_larger_than_a_tile_stay_whole():
  tx, params, *_ = tiny_kfac(factor_block_size=6)
  state = tx.init(params)
  assert state.factors["hidden"].a.shape == (1, 6, 6)  # 5 inputs and the bias
  summary = str(kfac_optax.describe(tiny_kfac(factor_block_size=2)[0], params))
  assert "A 6 as 3 tiles 2×2 · G 4 as 2 tiles 2×2" in summary


def test_tiles_keep_diagonal_sides_and_the_damped_powers():
  """A diagonal input factor beside a tiled output one; `Curvature.multiply`
  with power -1 equals the preconditioned update."""
  params, batch = bf.tiny_problem(n=6, d_in=5)
  curvature = kfac_optax.Curvature(
      bf.TinyMLP().apply, kfac_optax.losses.softmax_cross_entropy(),
      example_batch=batch, estimation="empirical", factor_block_size=2,
      layer_overrides={"hidden": "kron_in_diag"})
  state = curvature.update(curvature.init(params), params, batch=batch, damping=1e-2)
  assert state.factors["hidden"].a.shape == (1, 6)
  assert curvature.describe(params).rows[0].factor_text() == "A diag 6 · G 4 as 2 tiles 2×2"
  a, g = bf.factors(params, batch, "empirical")["hidden"]
  a = np.diag(np.diag(a))
  v = jax.tree.map(lambda p: jax.random.normal(jax.random.key(3), p.shape), params)
  product = curvature.multiply(state, v, power=-1, damping=1e-2)
  expected = bf.kronecker_precondition(a, block_diagonal(g, 2), v["hidden"]["kernel"],
                                       v["hidden"]["bias"], 1e-2)
  assert bf.relative_error(product["hidden"], expected) < 1e-4


def test_factor_block_size_is_checked():
  for bad in (0, 2.5, "32"):
    with pytest.raises(ValueError, match="factor_block_size must be a positive Python int"):
      tiny_kfac(factor_block_size=bad)
  with pytest.raises(ValueError) as error:
    tiny_kfac(factor_block_size=64, factor_rank=8)
  assert str(error.value) == (
      "factor_rank=8 and factor_block_size=64 are two ways to make large factors "
      "cheap, and K-FAC applies one at a time. Fix: give one of them (None for "
      "the other): factor_block_size for sharded params, factor_rank for wide "
      "layers whose factors' spectra decay fast.")
