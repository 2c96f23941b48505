"""Layers and params the loss's outputs do not depend on: init refuses them
(their Fisher block is zero), naming the fix; ``"skip"`` leaves them
unpreconditioned."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kfac_optax
from kfac_optax._src.curvature import reach

LOSS = kfac_optax.losses.softmax_cross_entropy()
X = jax.random.normal(jax.random.key(0), (8, 5))
BATCH = (X, jax.random.randint(jax.random.key(1), (8,), 0, 3))


def test_the_walk_cuts_at_stop_gradient_and_reads_inner_calls():
  def fn(a, b, c, d, e):
    inner = jax.jit(lambda x, y: 2.0 * x)(c, d)  # d unused inside the call
    return jax.nn.relu(a) + jax.lax.stop_gradient(b) + inner + 0.0 * e

  # e reaches through a multiplication by zero: the walk reads structure, so
  # it is reached (conservative), as a custom_jvp call's inputs (relu) are.
  assert reach.unreached(fn, *[1.0] * 5) == [False, True, False, True, False]
  assert reach.unreached(lambda t: t["x"] @ jnp.ones(3),
                         {"x": jnp.ones(3), "y": jnp.ones(2)}) == [False, True]


def test_remat_and_scan_are_reached():
  def fn(a, b):
    rematted = jax.checkpoint(lambda x, y: x * 2.0)(a, b)
    summed = jax.lax.scan(lambda c, x: (c + x, None), 0.0, jnp.stack([b, b]))[0]
    return rematted, summed
  # b is not used by the remat'd function, but the scan reads it.
  assert reach.unreached(lambda a, b: fn(a, b)[0], 1.0, 2.0) == [False, True]
  assert reach.unreached(fn, 1.0, 2.0) == [False, False]


class ActorCritic(nn.Module):
  """Flax's PPO example's shape: a shared trunk, a policy and a value head."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(16, name="hidden")(x))
    log_std = self.param("log_std", nn.initializers.zeros, (1,))
    value = nn.Dense(1, name="value")(h) * jnp.exp(log_std)
    return nn.log_softmax(nn.Dense(3, name="policy")(h)), value


class Detached(nn.Module):
  """A layer whose output reaches the logits only through stop_gradient."""

  @nn.compact
  def __call__(self, x):
    frozen = jax.lax.stop_gradient(nn.Dense(3, name="frozen")(x))
    return nn.Dense(3, name="head")(x) + frozen


def test_a_head_the_loss_does_not_read_is_refused_naming_the_fix():
  model = ActorCritic()
  params = model.init(jax.random.key(2), X)["params"]
  tx = kfac_optax.kfac(model.apply, LOSS, example_batch=BATCH,
                       outputs=lambda out: out[0], learning_rate=1e-2)
  with pytest.raises(ValueError) as error:
    tx.init(params)
  message = str(error.value)
  assert "'value' (layer)" in message and "'log_std' (param)" in message
  assert "'hidden'" not in message and "'policy'" not in message
  assert "layer_overrides={'': 'skip', 'value': 'skip'}" in message
  assert "losses.joint(policy_loss, value_loss" in message
  # Modelling both heads reaches every layer and param.
  both = kfac_optax.losses.joint(
      LOSS, kfac_optax.losses.squared_error(targets=lambda b: b[0][:, :1]))
  kfac_optax.kfac(model.apply, both, example_batch=BATCH,
                  learning_rate=1e-2).init(params)


def test_a_layer_behind_stop_gradient_is_refused():
  model = Detached()
  params = model.init(jax.random.key(2), X)["params"]
  with pytest.raises(ValueError, match=r"depend on 'frozen' \(layer\):"):
    kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH).init(params)


def test_skipped_heads_pass_their_gradient_through():
  """With the value head and log_std skipped, their part of the update is
  the gradient itself; the policy's and the trunk's are preconditioned."""
  model = ActorCritic()
  params = model.init(jax.random.key(2), X)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, LOSS, example_batch=BATCH,
                                outputs=lambda out: out[0],
                                layer_overrides={"value": "skip", "": "skip"})
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  updates, _ = tx.update(grads, tx.init(params), params, batch=BATCH,
                         rng=jax.random.key(3))
  for leaf in (updates["value"]["kernel"], updates["value"]["bias"],
               updates["log_std"]):
    np.testing.assert_array_equal(leaf, 0.5)
  assert not np.allclose(updates["policy"]["kernel"], 0.5)
  kinds = {row.path: row.kind for row in kfac_optax.describe(tx, params).rows}
  assert kinds["value"] == kinds[""] == "skipped"


class NNXActorCritic(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(5, 16, rngs=rngs)
    self.policy = nnx.Linear(16, 3, rngs=rngs)
    self.value = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.hidden(x))
    return self.policy(h), self.value(h)


def test_nnx_heads_are_checked_too():
  model = NNXActorCritic(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  tx = kfac_optax.kfac(model, LOSS, example_batch=BATCH,
                       outputs=lambda out: out[0], learning_rate=1e-2)
  with pytest.raises(ValueError, match=r"depend on 'value' \(layer\):"):
    tx.init(params)
  skipping = kfac_optax.kfac(model, LOSS, example_batch=BATCH,
                             outputs=lambda out: out[0], learning_rate=1e-2,
                             layer_overrides={"value": "skip"})
  skipping.init(params)
