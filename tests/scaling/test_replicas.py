"""A step written per device (pmap, shard_map) with ``axis_name``: every
replica keeps one state and takes the step of one device on the whole batch."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kfac_optax

REPLICAS = 2
STEPS = 3  # statistics and inverses every 2: steps with and without them


class NormNet(nn.Module):
  """Flax's ImageNet ResNet's pattern: BatchNorm synchronised over the
  replicas' axis (``axis_name=None`` on one device)."""
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(6)(x)
    h = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(h)
    return nn.Dense(3)(jnp.tanh(h))


def _problem():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8 * REPLICAS, 5)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 3, size=(8 * REPLICAS,)))
  variables = NormNet().init(jax.random.key(0), x)
  return (x, y), variables["params"], {"batch_stats": variables["batch_stats"]}


MODES = {
    "fixed": dict(learning_rate=0.1, momentum=0.9),
    # ρ from a jvp along the step, the losses before and after it
    "fixed-adaptive-damping": dict(learning_rate=0.1, momentum=0.9,
                                   adaptive_damping=True),
    # α, μ from the 2×2 quadratic model; ρ from it and the losses
    "automatic": dict(learning_rate=None, momentum=None),
    # α alone from the 1×1 model along v (one tangent)
    "automatic-no-momentum": dict(learning_rate=None, momentum=0.0),
}


def _kfac(model, mode, axis_name=None):
  # Empirical statistics: the labels, not samples, so that shares of the
  # batch and the whole batch meet the same targets.
  return kfac_optax.kfac(
      model.apply, kfac_optax.losses.softmax_cross_entropy(),
      example_batch=_problem()[0], estimation="empirical", damping=1e-2,
      stats_update_period=2, inverse_update_period=2, axis_name=axis_name,
      **MODES[mode])


def _step(model, tx, gradient_mean):
  """One training step; ``gradient_mean(loss_fn, params)`` is how the
  step's form takes the whole batch's gradient."""
  def loss_fn(params, variables, batch):
    logits, _ = model.apply({"params": params, **variables}, batch[0],
                            mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

  def step(params, state, variables, batch):
    grads = gradient_mean(functools.partial(loss_fn, variables=variables, batch=batch),
                          params)
    updates, state = tx.update(grads, state, params, batch=batch,
                               variables=variables, rng=jax.random.key(0))
    return optax.apply_updates(params, updates), state
  return step


def _local_grad(loss_fn, params):
  return jax.grad(loss_fn)(params)


def _one_device(mode):
  batch, params, variables = _problem()
  model = NormNet()
  tx = _kfac(model, mode)
  step = jax.jit(_step(model, tx, _local_grad))
  state = tx.init(params)
  for _ in range(STEPS):
    params, state = step(params, state, variables, batch)
  return params, state


def _assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_pmap_replicas_take_the_whole_batch_step(mode):
  batch, params, variables = _problem()
  model = NormNet(axis_name="batch")
  tx = _kfac(model, mode, axis_name="batch")
  pmean_grad = lambda f, p: jax.lax.pmean(_local_grad(f, p), "batch")
  step = jax.pmap(_step(model, tx, pmean_grad), axis_name="batch",
                  devices=jax.devices()[:REPLICAS])
  replicate = lambda tree: jax.tree.map(lambda a: jnp.stack([a] * REPLICAS), tree)
  shares = jax.tree.map(lambda a: a.reshape(REPLICAS, -1, *a.shape[1:]), batch)
  p, state = replicate(params), replicate(tx.init(params))
  for _ in range(STEPS):
    p, state = step(p, state, replicate(variables), shares)
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)
  for tree in (p, state.curvature.factors):  # one state on every replica
    for leaf in jax.tree.leaves(tree):
      np.testing.assert_array_equal(leaf[0], leaf[1])
  want_params, want_state = _one_device(mode)
  _assert_close(first(p), want_params)
  _assert_close(first(state.curvature.factors), want_state.curvature.factors)
  _assert_close(first((state.rho, state.damping)), (want_state.rho, want_state.damping))
  assert float(jnp.max(jnp.abs(want_params["Dense_0"]["kernel"]
                               - params["Dense_0"]["kernel"]))) > 1e-2  # it moved


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_replicas_take_the_whole_batch_step(check_vma):
  batch, params, variables = _problem()
  model = NormNet(axis_name="batch")
  tx = _kfac(model, "automatic", axis_name="batch")
  mesh = jax.make_mesh((REPLICAS,), ("batch",), devices=jax.devices()[:REPLICAS])
  if check_vma:
    # The gradient of replicated params sums over the axis: the mean loss's
    # gradient is the whole batch's.
    mean_grad = lambda f, p: jax.grad(lambda q: jax.lax.pmean(f(q), "batch"))(p)
  else:  # untyped, each device's gradient is its own, as under pmap
    mean_grad = lambda f, p: jax.lax.pmean(_local_grad(f, p), "batch")
  # out_specs P(): the new params and state must be one on every device.
  step = jax.jit(jax.shard_map(_step(model, tx, mean_grad), mesh=mesh,
                               in_specs=(P(), P(), P(), P("batch")),
                               out_specs=(P(), P()), check_vma=check_vma))
  put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
  p, state = put(params, P()), put(tx.init(params), P())
  for _ in range(STEPS):
    p, state = step(p, state, put(variables, P()), put(batch, P("batch")))
  want_params, want_state = _one_device("automatic")
  _assert_close(p, want_params)
  _assert_close(state.curvature.factors, want_state.curvature.factors)


def test_exact_product_is_the_whole_batch_product_under_shard_map():
  batch, params, variables = _problem()
  curvature = kfac_optax.Curvature(
      NormNet(axis_name="batch").apply, kfac_optax.losses.softmax_cross_entropy(),
      example_batch=batch, estimation="empirical", axis_name="batch")
  vector = jax.tree.map(lambda a: jnp.ones_like(a) / a.size, params)
  mesh = jax.make_mesh((REPLICAS,), ("batch",), devices=jax.devices()[:REPLICAS])
  product = jax.jit(jax.shard_map(
      lambda p, b: curvature.exact_product(p, b, vector, variables), mesh=mesh,
      in_specs=(P(), P("batch")), out_specs=P()))(
          jax.device_put(params, NamedSharding(mesh, P())),
          jax.device_put(batch, NamedSharding(mesh, P("batch"))))
  one_device = kfac_optax.Curvature(
      NormNet().apply, kfac_optax.losses.softmax_cross_entropy(),
      example_batch=batch, estimation="empirical")
  _assert_close(product, one_device.exact_product(params, batch, vector, variables))


def test_independent_models_keep_their_own_statistics():
  """``axis_name=()``: each device's statistics are its share's."""
  batch, params, variables = _problem()
  model = NormNet()
  tx = _kfac(model, "fixed", axis_name=())
  step = jax.pmap(_step(model, tx, _local_grad), axis_name="batch",
                  devices=jax.devices()[:REPLICAS])
  shares = jax.tree.map(lambda a: a.reshape(REPLICAS, -1, *a.shape[1:]), batch)
  replicate = lambda tree: jax.tree.map(lambda a: jnp.stack([a] * REPLICAS), tree)
  _, state = step(replicate(params), replicate(tx.init(params)),
                  replicate(variables), shares)
  one = jax.jit(_step(model, tx, _local_grad))
  for r in range(REPLICAS):
    _, want = one(params, tx.init(params), variables,
                  jax.tree.map(lambda a, r=r: a[r], shares))
    _assert_close(jax.tree.map(lambda a, r=r: a[r], state.curvature.factors),
                  want.curvature.factors)


def test_shard_map_over_some_axes_only_is_named():
  batch, params, variables = _problem()
  model = NormNet(axis_name="data")
  tx = _kfac(model, "fixed", axis_name="data")
  mesh = jax.make_mesh((2, 2), ("data", "model"), (AxisType.Auto, AxisType.Auto),
                       devices=jax.devices()[:4])
  step = jax.jit(jax.shard_map(
      _step(model, tx, lambda f, p: jax.grad(lambda q: jax.lax.pmean(f(q), "data"))(p)),
      mesh=mesh, in_specs=(P(), P(), P(), P("data")), out_specs=(P(), P()),
      axis_names={"data"}))
  put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
  with pytest.raises(NotImplementedError, match=r"over the mesh axes \('data',\) only"):
    step(put(params, P()), put(tx.init(params), P()), put(variables, P()),
         put(batch, P("data")))


def test_inside_pmap_without_axis_name_is_an_error():
  batch, params, variables = _problem()
  model = NormNet()
  tx = _kfac(model, "fixed")
  step = jax.pmap(_step(model, tx, _local_grad), axis_name="batch",
                  devices=jax.devices()[:REPLICAS])
  replicate = lambda tree: jax.tree.map(lambda a: jnp.stack([a] * REPLICAS), tree)
  shares = jax.tree.map(lambda a: a.reshape(REPLICAS, -1, *a.shape[1:]), batch)
  with pytest.raises(ValueError, match=r"axis_name='batch'"):
    step(replicate(params), replicate(tx.init(params)), replicate(variables), shares)


@pytest.mark.parametrize("bad", [3, ["batch"], ("batch", 1), "", ("batch", "")])
def test_axis_name_must_be_names(bad):
  with pytest.raises(ValueError, match="axis_name must be"):
    _kfac(NormNet(), "fixed", axis_name=bad)
