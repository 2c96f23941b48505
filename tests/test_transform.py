"""scale_by_kfac against explicit per-example Jacobians, factors and solves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from tests import brute_force as bf

LOSS = kfac_optax.losses.softmax_cross_entropy()
DAMPING = 1e-2


def make_tx(**kwargs):
  params, batch = bf.tiny_problem()
  settings = dict(damping=DAMPING, inverse_update_period=1, ema_decay=0.9)
  settings.update(kwargs)
  return kfac_optax.scale_by_kfac(
      bf.TinyMLP().apply, LOSS, example_batch=batch, **settings), params


def random_grads(params, seed):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten(
      [jax.random.normal(k, v.shape) for k, v in zip(keys, leaves)])


@pytest.mark.parametrize("estimation", ["empirical", "exact"])
@pytest.mark.parametrize("inverse", ["eigh", "cholesky"])
def test_matches_brute_force_after_one_and_two_updates(estimation, inverse):
  tx, params = make_tx(estimation=estimation, inverse=inverse)
  _, batch1 = bf.tiny_problem(seed=1)
  _, batch2 = bf.tiny_problem(seed=2)
  grads1, grads2 = random_grads(params, 3), random_grads(params, 4)
  update = jax.jit(lambda g, s, b: tx.update(g, s, params, batch=b))

  state = tx.init(params)
  out1, state = update(grads1, state, batch1)
  expected1 = bf.factors(params, batch1, estimation)
  assert bf.relative_error(out1, bf.precondition(expected1, grads1, DAMPING)) < 1e-3

  out2, state = update(grads2, state, batch2)
  expected2 = bf.factors(params, batch2, estimation)
  rho = 0.9  # debiased EMA after two updates: (ρ B1 + B2) / (1 + ρ)
  ema = {k: tuple((rho * b1 + b2) / (1 + rho)
                  for b1, b2 in zip(expected1[k], expected2[k]))
         for k in bf.LAYERS}
  for name in bf.LAYERS:
    assert bf.relative_error(state.factors[name], ema[name]) < 1e-4
  assert bf.relative_error(out2, bf.precondition(ema, grads2, DAMPING)) < 1e-3
