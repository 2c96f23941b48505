"""Normalisation layers: diagonal blocks from exact per-example gradients."""

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_optax
from tests.nnx_twins import APIS, model_for

LOSS = kfac_optax.losses.softmax_cross_entropy()
DAMPING = 1e-2


def net_with(make_norm):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = make_norm(name="norm")(nn.Dense(4)(x))
      return nn.Dense(3)(jnp.tanh(h).reshape(h.shape[0], -1))
  return Net()


class NNXNet(nnx.Module):
  """`net_with`'s net in NNX, for inputs (N, 2, 3), with the same paths."""

  def __init__(self, make_norm, rngs):
    self.Dense_0 = nnx.Linear(3, 4, rngs=rngs)  # pylint: disable=invalid-name
    self.norm = make_norm(rngs)
    self.Dense_1 = nnx.Linear(8, 3, rngs=rngs)  # pylint: disable=invalid-name

  def __call__(self, x):
    h = self.norm(self.Dense_0(x))
    return self.Dense_1(jnp.tanh(h).reshape(h.shape[0], -1))


NORMS = {  # id: (the linen norm, its NNX twin or None where NNX has none)
    "layer": (nn.LayerNorm, lambda rngs: nnx.LayerNorm(4, rngs=rngs)),
    "rms": (nn.RMSNorm, lambda rngs: nnx.RMSNorm(4, rngs=rngs)),
    "group": (lambda name: nn.GroupNorm(num_groups=2, name=name),
              lambda rngs: nnx.GroupNorm(4, num_groups=2, rngs=rngs)),
    "instance": (nn.InstanceNorm, lambda rngs: nnx.InstanceNorm(4, rngs=rngs)),
    # NNX's LayerNorm has one feature axis.
    "layer-two-axes": (lambda name: nn.LayerNorm(
        feature_axes=(-2, -1), reduction_axes=(-2, -1), name=name), None),
    "layer-no-bias": (lambda name: nn.LayerNorm(use_bias=False, name=name),
                      lambda rngs: nnx.LayerNorm(4, use_bias=False, rngs=rngs)),
}


@pytest.mark.parametrize("norm, api", [
    (norm, api) for norm, (_, twin) in NORMS.items() for api in APIS
    if api == "linen" or twin])
def test_norm_matches_per_example_gradients(norm, api):
  make_norm, make_twin = NORMS[norm]
  model = net_with(make_norm)
  x = jax.random.normal(jax.random.key(0), (5, 2, 3))  # per-position norm
  y = jnp.arange(5) % 3
  params = model.init(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(
      model_for(api, model, lambda rngs: NNXNet(make_twin, rngs), params), LOSS,
      example_batch=(x, y), estimation="empirical", damping=DAMPING)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
  out, state = jax.jit(lambda s: tx.update(grads, s, params, batch=(x, y)))(
      tx.init(params))

  def example_loss(p, xn, yn):
    return LOSS.value(model.apply({"params": p}, xn[None]), (xn[None], yn[None]))
  per_example = jax.vmap(jax.grad(example_loss), (None, 0, 0))(params, x, y)
  for name, leaf in per_example["norm"].items():
    fisher = np.sum(np.square(np.asarray(leaf, np.float64)), 0) / len(x)
    np.testing.assert_allclose(state.factors["norm"][name], fisher, rtol=1e-4,
                               atol=1e-9)
    np.testing.assert_allclose(out["norm"][name], 0.3 / (fisher + DAMPING),
                               rtol=1e-4)
  assert set(state.factors["norm"]) == set(params["norm"])
  assert "<diagonal>" not in state.factors  # every leaf has a structured block


class BatchNormNet(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Dense(4, name="dense")(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=0.5, name="bn")(h)
    return nn.Dense(3, name="head")(jnp.tanh(h))


def test_batch_norm_statistics_and_batch_stats_threading():
  model = BatchNormNet()
  x = jax.random.normal(jax.random.key(0), (6, 3))
  y = jnp.arange(6) % 3
  variables = model.init(jax.random.key(1), x)
  params, batch_stats = variables["params"], variables["batch_stats"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=(x, y),
                                estimation="empirical", damping=DAMPING)

  @jax.jit
  def step(params, batch_stats, opt_state):
    def loss_fn(p):
      logits, new_vars = model.apply({"params": p, "batch_stats": batch_stats},
                                     x, mutable=["batch_stats"])
      return LOSS.value(logits, (x, y)), new_vars["batch_stats"]
    (_, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params, batch=(x, y),
                                   variables={"batch_stats": batch_stats})
    return optax.apply_updates(params, updates), new_stats, opt_state

  _, new_stats, state = step(params, batch_stats, tx.init(params))
  # The user's step owns batch_stats: K-FAC's pass does not change them.
  h = np.asarray(x, np.float64) @ np.asarray(params["dense"]["kernel"]) + np.asarray(
      params["dense"]["bias"])
  np.testing.assert_allclose(new_stats["bn"]["mean"], 0.5 * h.mean(0), rtol=1e-5)

  # Explicit x̂ (batch statistics) and output gradients g of the summed NLL.
  x_hat = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)
  scale, bias, head = params["bn"]["scale"], params["bn"]["bias"], params["head"]
  def summed_nll(perturbation):
    out = jnp.asarray(x_hat, jnp.float32) * scale + bias + perturbation
    logits = jnp.tanh(out) @ head["kernel"] + head["bias"]
    return jnp.sum(LOSS.nll(logits, y))
  g = np.asarray(jax.grad(summed_nll)(jnp.zeros((6, 4))), np.float64)
  np.testing.assert_allclose(state.factors["bn"]["scale"],
                             np.sum((g * x_hat) ** 2, 0) / 6, rtol=1e-3)
  np.testing.assert_allclose(state.factors["bn"]["bias"], np.sum(g ** 2, 0) / 6,
                             rtol=1e-3)


class PlainRMSNorm(nn.Module):
  """An RMSNorm of one's own, with flax's attribute names: scale, no bias."""
  use_scale: bool = True

  @nn.compact
  def __call__(self, x):
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)
    if not self.use_scale:
      return y
    return y * self.param("scale", nn.initializers.ones, (x.shape[-1],))


def test_a_norm_without_bias_registers_with_bias_none():
  """register_layer(cls, "norm", bias=None) is accepted (it was refused as a
  param name for a kind that takes none) and gives nn.RMSNorm's block."""
  kfac_optax.register_layer(PlainRMSNorm, "norm", bias=None)
  x = jax.random.normal(jax.random.key(0), (5, 2, 3))
  batch = (x, jnp.arange(5) % 3)
  factors = []
  for make_norm in (PlainRMSNorm, nn.RMSNorm):
    model = net_with(make_norm)
    params = model.init(jax.random.key(1), x)["params"]
    tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=batch,
                                  estimation="empirical")
    state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params),
                      params, batch=batch)[1]
    factors.append(state.factors)
  assert set(factors[0]) == set(factors[1]) == {"Dense_0", "norm", "Dense_1"}
  np.testing.assert_allclose(factors[0]["norm"]["scale"], factors[1]["norm"]["scale"],
                             rtol=1e-5)
