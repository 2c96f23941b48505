"""Low-precision models: statistics, inverses and preconditioning in float32."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax
from jax.sharding import NamedSharding, PartitionSpec as P
from tests import brute_force as bf


class Net(nn.Module):
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    kwargs = dict(dtype=self.dtype, param_dtype=self.dtype)
    x = jnp.tanh(nn.Conv(4, (3, 3), **kwargs)(x))
    x = nn.LayerNorm(**kwargs)(x).reshape(x.shape[0], -1)
    return nn.Dense(5, **kwargs)(x)


def _update(dtype, mesh=None):
  """One jitted K-FAC update of ``Net(dtype)``: (params, grads, updates, state).

  With a ``mesh`` the batch is sharded over it and the params replicated.
  """
  x = jax.random.normal(jax.random.key(0), (16, 6, 6, 2)).astype(dtype)
  batch = (x, jnp.arange(16) % 5)
  model, loss = Net(dtype), kfac_optax.losses.softmax_cross_entropy()
  params = jax.tree.map(lambda p: p.astype(dtype),
                        Net().init(jax.random.key(1), x.astype(jnp.float32))["params"])
  # A small damping makes the inverses ill-conditioned: preconditioning with
  # inverses rounded to the parameter dtype would be far off.
  tx = kfac_optax.scale_by_kfac(model.apply, loss, example_batch=batch,
                                estimation="empirical", damping=1e-3)
  grads = jax.grad(lambda p: loss.value(model.apply({"params": p}, x), batch))(params)
  state = tx.init(params)
  update = jax.jit(lambda g, s, p, b: tx.update(g, s, p, batch=b))
  if mesh is None:
    return (params, grads, *update(grads, state, params, batch))
  with jax.set_mesh(mesh):
    replicated = lambda tree: jax.device_put(tree, NamedSharding(mesh, P()))
    updates, state = update(replicated(grads), replicated(state), replicated(params),
                            jax.device_put(batch, NamedSharding(mesh, P("data"))))
  return params, grads, updates, state


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_params_get_float32_curvature(dtype):
  params, grads, updates, state = _update(dtype)

  # Updates come back in the parameter dtype; everything K-FAC keeps is float32.
  assert all(u.dtype == dtype for u in jax.tree.leaves(updates))
  assert {leaf.dtype for leaf in jax.tree.leaves((state.factors, state.inverses))} == {
      jnp.dtype(jnp.float32)}

  # The Dense block's update is the float32 inverses applied to the
  # low-precision gradient, rounded once to the parameter dtype.
  inverse = state.inverses["Dense_0"]
  v = np.concatenate([np.asarray(grads["Dense_0"]["kernel"], np.float64),
                      np.asarray(grads["Dense_0"]["bias"], np.float64)[None]])
  expected = (np.asarray(inverse.a[0], np.float64) @ v
              @ np.asarray(inverse.g[0], np.float64))
  actual = np.concatenate([updates["Dense_0"]["kernel"],
                           updates["Dense_0"]["bias"][None]]).astype(np.float64)
  assert bf.relative_error(actual, expected) < 1e-2
  assert np.all(np.isfinite(actual))

  # The statistics agree with a float32 model's up to the rounding of the
  # low-precision activations and gradients.
  _, _, _, reference = _update(jnp.float32)
  assert bf.relative_error(state.factors, jax.tree.map(np.asarray, reference.factors)) < 5e-2


def test_low_precision_sharded_matches_one_device():
  """bfloat16 under an 8-device mesh (batch split, inverses distributed).

  Auto axes: under Explicit ones the model runs as in the user's step, where
  XLA fuses, and so rounds, its bfloat16 otherwise than on one device, and
  this test's ill-conditioned inverses (damping 1e-3) magnify that rounding.
  """
  _, _, expected, reference = _update(jnp.bfloat16)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  _, _, updates, state = _update(jnp.bfloat16, mesh)
  assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(updates))
  # Only the order of float32 reductions over the batch differs.
  assert bf.relative_error(state.factors, jax.tree.map(np.asarray, reference.factors)) < 1e-4
  assert bf.relative_error(updates, jax.tree.map(np.asarray, expected)) < 2e-3


def test_float16_update_at_tiny_damping_is_scaled_to_fit():
  """Batch 2, width 256, λ = 1e-12: the float32 product exceeds float16's range
  (65504); the whole update is scaled by one factor to 1/16 of it, counted."""

  class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
      kwargs = dict(dtype=jnp.float16, param_dtype=jnp.float16)
      return nn.Dense(10, **kwargs)(jnp.tanh(nn.Dense(256, **kwargs)(x)))

  x = jax.random.normal(jax.random.key(0), (2, 64)).astype(jnp.float16)
  batch, model = (x, jnp.array([1, 2])), Wide()
  loss = kfac_optax.losses.softmax_cross_entropy()
  params = model.init(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, loss, example_batch=batch,
                                estimation="empirical", damping=1e-12)
  grads = jax.grad(lambda p: loss.value(model.apply({"params": p}, x), batch))(params)
  updates, state = jax.jit(lambda g, s: tx.update(g, s, params, batch=batch))(
      grads, tx.init(params))

  assert all(u.dtype == jnp.float16 for u in jax.tree.leaves(updates))
  assert all(np.all(np.isfinite(np.asarray(u, np.float32))) for u in jax.tree.leaves(updates))
  assert int(kfac_optax.stats(state)["rescaled_updates"]) == 1
  # The direction is the float32 inverses' product, scaled by one factor.
  expected = {}
  for name in ("Dense_0", "Dense_1"):
    inverse, g = state.inverses[name], grads[name]
    v = np.concatenate([np.asarray(g["kernel"], np.float64),
                        np.asarray(g["bias"], np.float64)[None]])
    expected[name] = (np.asarray(inverse.a[0], np.float64) @ v
                      @ np.asarray(inverse.g[0], np.float64))
  peak = max(np.abs(e).max() for e in expected.values())
  limit = float(np.finfo(np.float16).max) / 16
  assert peak > 16 * limit  # it would overflow without the scaling
  for name, e in expected.items():
    actual = np.concatenate([updates[name]["kernel"], updates[name]["bias"][None]])
    # float16 rounding: 2^-11 relative to each entry, plus the float32 products.
    np.testing.assert_allclose(actual.astype(np.float64), e * limit / peak,
                               rtol=2e-3, atol=2e-3 * limit)


@pytest.mark.parametrize("settings", [{}, dict(learning_rate=0.1, adaptive_damping=True)],
                         ids=["automatic", "fixed lr, adaptive damping"])
def test_float64_targets_under_x64_give_a_float32_rho(settings):
  """NumPy's float64 targets make the squared error's loss change float64
  under x64; ρ stays in its float32 state (lax.cond needs one type)."""
  with jax.enable_x64(True):
    model = nn.Dense(2)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)
    batch = (x, np.random.default_rng(1).standard_normal((4, 2)))  # float64
    params = model.init(jax.random.key(0), x)["params"]
    loss = kfac_optax.losses.squared_error()
    grads = jax.grad(lambda p: loss.value(model.apply({"params": p}, x), batch))(params)
    tx = kfac_optax.kfac(model.apply, loss, example_batch=batch, **settings)
    _, state = tx.update(grads, tx.init(params), params, batch=batch,
                         rng=jax.random.key(1))
    assert state.rho.dtype == jnp.float32 and np.isfinite(float(state.rho))


def test_float64_params_keep_float64_curvature():
  with jax.enable_x64(True):
    params, batch = bf.tiny_problem()
    params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
    batch = (batch[0].astype(jnp.float64), batch[1])
    loss = kfac_optax.losses.softmax_cross_entropy()
    damping = 1e-3
    tx = kfac_optax.scale_by_kfac(bf.TinyMLP().apply, loss, example_batch=batch,
                                  estimation="empirical", damping=damping)
    grads = jax.grad(lambda p: loss.value(bf.TinyMLP().apply({"params": p}, batch[0]),
                                          batch))(params)
    updates, state = jax.jit(lambda g, s: tx.update(g, s, params, batch=batch))(
        grads, tx.init(params))
    leaves = jax.tree.leaves((updates, state.factors, state.inverses, state.damping))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.float64)}

    # A depends on the float64 forward pass alone: float64 agreement.
    expected = bf.factors(params, batch, "empirical")
    for name in bf.LAYERS:
      a = np.asarray(state.factors[name].a[0])
      np.testing.assert_allclose(a, expected[name][0], rtol=0,
                                 atol=1e-13 * np.abs(expected[name][0]).max())
    # The update solves with the state's own factors to float64 precision
    # (float32 inverses would be off by ~1e-7 times the condition number).
    own = {name: (np.asarray(state.factors[name].a[0]), np.asarray(state.factors[name].g[0]))
           for name in bf.LAYERS}
    assert bf.relative_error(updates, bf.precondition(own, grads, damping)) < 1e-10
