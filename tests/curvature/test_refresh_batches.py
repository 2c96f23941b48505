"""The refresh on one device: every layer's factors inverted in batches by
size across layers (one compiled inversion per size batch), each inverse
the damped factor's, with the damping split by π."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from kfac_optax._src import linalg
from kfac_optax._src.linalg import stacked_inverses
from tests import brute_force as bf


class Mlp(nn.Module):
  """Layers of three distinct shapes: factors of sizes 7, 11, 11 (inputs
  with bias) and 10, 10, 6 (outputs), three size batches."""

  @nn.compact
  def __call__(self, x):
    x = jnp.tanh(nn.Dense(10)(x))
    x = jnp.tanh(nn.Dense(10)(x))
    return nn.Dense(6)(x)


def _refreshed(damping=0.1):
  model = Mlp()
  x = np.random.default_rng(0).standard_normal((16, 6)).astype(np.float32)
  batch = (x, np.arange(16) % 6)
  params = model.init(jax.random.key(0), x)["params"]
  curvature = kfac_optax.Curvature(
      model.apply, kfac_optax.losses.softmax_cross_entropy(), example_batch=batch,
      estimation="empirical", inverse="cholesky")
  update = jax.jit(lambda state: curvature.update(state, params, batch=batch,
                                                  damping=damping))
  state = curvature.init(params)
  return update, state, update(state)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU inversion")
def test_one_compiled_inversion_per_size_batch():
  update, state, _ = _refreshed()
  hlo = update.lower(state).compile().as_text()
  sizes = [7, 11, 11, 10, 10, 6]
  batches = set(stacked_inverses.bucket_sizes(sizes).values())
  # 11, 10 and 7: none within 1.25x of another's work, and 6 padded to 7
  # for 7³ - 6³ = 127, within 5% of the refresh's 5221.
  assert batches == {11, 10, 7}
  assert hlo.count('custom_call_target="lapack_spotrf_ffi"') == len(batches)


def test_every_inverse_is_its_damped_factor_inverse():
  damping = 0.1
  *_, state = _refreshed(damping)
  for key in state.factors:
    a, g = (np.asarray(x[0], np.float64) for x in state.factors[key])
    a_inverse, g_inverse = state.inverses[key]
    damping_a, damping_g = linalg.pi_adjusted_damping(
        np.trace(a) / len(a), np.trace(g) / len(g), damping)
    assert bf.relative_error(
        a_inverse[0], np.linalg.inv(a + float(damping_a) * np.eye(len(a)))) < 1e-4
    assert bf.relative_error(
        g_inverse[0], np.linalg.inv(g + float(damping_g) * np.eye(len(g)))) < 1e-4
