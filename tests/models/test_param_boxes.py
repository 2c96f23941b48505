"""Params in Flax's partitioning boxes (nn.Partitioned, nn.LogicallyPartitioned)
and NNX Variables: K-FAC reads the arrays in them, and its updates and its
momentum come back in the same boxes, as optax's own transformations do.

Before, boxed params were not understood: all boxed, every param silently got
the diagonal fallback; some boxed, init raised a wrong "no kernel param".
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kfac_optax

LOSS = kfac_optax.losses.softmax_cross_entropy()
X = jax.random.normal(jax.random.key(0), (8, 5))
BATCH = (X, jnp.arange(8) % 3)

BOXES = {
    "plain": lambda init, names: init,
    "partitioned": nn.with_partitioning,
    "logical": nn.with_logical_partitioning,
}


class MLP(nn.Module):
  """Two Dense layers whose kernels (not biases) may be boxed."""
  box: str

  @nn.compact
  def __call__(self, x):
    box = BOXES[self.box]
    h = nn.tanh(nn.Dense(4, kernel_init=box(nn.initializers.lecun_normal(),
                                            (None, "model")))(x))
    return nn.Dense(3, kernel_init=box(nn.initializers.lecun_normal(),
                                       ("model", None)))(h)


def three_updates(tx, model, params):
  """Three steps (statistics and a refresh each) from ``params``."""
  loss_fn = lambda p: LOSS.value(model.apply({"params": p}, X), BATCH)

  @jax.jit
  def step(params, state, key):
    grads = jax.grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params, batch=BATCH, rng=key)
    return nn.meta.replace_boxed(params, jax.tree.map(
        lambda p, u: p + u, nn.meta.unbox(params), nn.meta.unbox(updates))), state, updates
  state = tx.init(params)
  for i in range(3):
    params, state, updates = step(params, state, jax.random.key(i))
  return params, state, updates


def make(factory, model):
  return factory(model.apply, LOSS, example_batch=BATCH, inverse_update_period=1,
                 **({"learning_rate": 0.1} if factory is kfac_optax.kfac else {}))


@pytest.mark.parametrize("factory", [kfac_optax.kfac, kfac_optax.scale_by_kfac])
@pytest.mark.parametrize("box", ["partitioned", "logical"])
def test_boxed_params_train_as_plain_ones(box, factory):
  plain, boxed = MLP("plain"), MLP(box)
  params = boxed.init(jax.random.key(1), X)["params"]
  assert isinstance(params["Dense_0"]["kernel"], nn.Partitioned)
  assert not isinstance(params["Dense_0"]["bias"], nn.Partitioned)
  expected = three_updates(make(factory, plain), plain, nn.meta.unbox(params))
  actual = three_updates(make(factory, boxed), boxed, params)
  for want, got in zip(expected, actual):  # params, state (nan placeholders), updates
    jax.tree.map(lambda w, g: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-9),
                 want, nn.meta.unbox(got))
  # Updates come back boxed like the gradients, with the same names.
  assert nn.get_partition_spec(actual[2]) == nn.get_partition_spec(params)
  state = actual[1]
  assert sorted(state.factors if factory is kfac_optax.scale_by_kfac
                else state.curvature.factors) == ["Dense_0", "Dense_1"]  # no fallback
  if factory is kfac_optax.kfac:  # the momentum keeps the params' partitioning
    assert (nn.get_partition_spec(state.previous_update)
            == nn.get_partition_spec(params))


def test_boxed_params_are_described_as_plain_ones():
  boxed = MLP("partitioned")
  params = boxed.init(jax.random.key(1), X)["params"]
  assert (str(kfac_optax.describe(make(kfac_optax.kfac, boxed), params))
          == str(kfac_optax.describe(make(kfac_optax.kfac, MLP("plain")),
                                     nn.meta.unbox(params))))


class NNXMLP(nnx.Module):
  """`MLP` in NNX, kernels annotated with nnx.with_partitioning (or not)."""

  def __init__(self, rngs, partitioned=True):
    box = nnx.with_partitioning if partitioned else (lambda init, names: init)
    init = nnx.initializers.lecun_normal()
    self.Dense_0 = nnx.Linear(5, 4, kernel_init=box(init, (None, "model")),  # pylint: disable=invalid-name
                              rngs=rngs)
    self.Dense_1 = nnx.Linear(4, 3, kernel_init=box(init, ("model", None)),  # pylint: disable=invalid-name
                              rngs=rngs)

  def __call__(self, x):
    return self.Dense_1(nnx.tanh(self.Dense_0(x)))


def test_nnx_optimizer_state_has_the_params_partitioning():
  """As optax.adam's moments do, kfac's momentum (previous_update) carries
  the params' sharding metadata in nnx.Optimizer's state; a step trains as
  the unannotated model does."""
  mesh = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,))
  models = []
  with jax.set_mesh(mesh):
    for partitioned in (True, False):
      model = NNXMLP(nnx.Rngs(0), partitioned)
      optimizer = nnx.Optimizer(model, kfac_optax.kfac(
          model, LOSS, example_batch=BATCH, learning_rate=0.1), wrt=nnx.Param)

      @nnx.jit
      def step(model, optimizer):
        grads = nnx.grad(lambda m: LOSS.value(m(X), BATCH))(model)
        optimizer.update(model, grads, batch=BATCH, rng=jax.random.key(1))
      step(model, optimizer)
      models.append((model, optimizer))
  (boxed, boxed_optimizer), (plain, _) = models
  specs = nnx.get_partition_spec(nnx.state(boxed_optimizer))
  previous = specs["opt_state"]["previous_update"]
  assert previous["Dense_0"]["kernel"].get_value() == jax.P(None, "model")
  assert previous["Dense_1"]["kernel"].get_value() == jax.P("model", None)
  for layer in ("Dense_0", "Dense_1"):
    np.testing.assert_allclose(getattr(boxed, layer).kernel.get_value(),
                               getattr(plain, layer).kernel.get_value(), rtol=1e-6)
