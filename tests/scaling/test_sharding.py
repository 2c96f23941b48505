"""Data parallelism: a batch sharded over a mesh gives the unsharded updates."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kfac_optax
from tests import brute_force as bf
from tests.models.test_capture import SequenceNet
from tests.optimizer.test_adaptive import grads_at
from tests.curvature.test_masks import TokenNet, batch as token_batch


class ConvNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(nn.relu(nn.Conv(4, (3, 3))(x)))
    return nn.Dense(3)(h.reshape(h.shape[0], -1))


def cases():
  """(name, model, batch, loss, inputs getter, estimation)."""
  softmax = kfac_optax.losses.softmax_cross_entropy()
  return {
      "mlp-fisher": (bf.TinyMLP(), bf.tiny_problem(n=16)[1], softmax, None, "fisher"),
      "sequence-fallback": (
          SequenceNet(), (jax.random.normal(jax.random.key(0), (16, 7, 2)),
                          jnp.arange(16) % 4), softmax, None, "fisher"),
      # 11 channels: kernel rows 33 wide, so the input factor is `conv_gram`'s.
      "conv-norm-exact": (
          ConvNet(), (jax.random.normal(jax.random.key(0), (16, 6, 6, 11)),
                      jnp.arange(16) % 3), softmax, None, "exact"),
      "embed-masked": (
          TokenNet(), token_batch(0, lengths=tuple(range(1, 9)) * 2),
          kfac_optax.losses.softmax_cross_entropy(
              targets=lambda b: b["y"], mask=lambda b: b["mask"]),
          lambda b: b["ids"], "empirical"),
  }


def two_updates_unsharded_and_sharded(tx, params, grads, data, axis_type):
  """Two jitted updates on ``data`` on one device, and on 8 devices with
  the batch sharded: ``(expected, actual, the sharded run's state)``."""

  def two_updates(state, batch):
    out = []
    for rng in jax.random.split(jax.random.key(5), 2):
      updates, state = tx.update(grads, state, params, batch=batch, rng=rng)
      out.append(updates)
    return out, state

  expected, _ = jax.jit(two_updates)(tx.init(params), data)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  with jax.set_mesh(mesh):
    sharded = jax.device_put(data, NamedSharding(mesh, P("data")))
    replicated = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
    actual, state = jax.jit(two_updates)(replicated, sharded)
  return jax.tree.map(np.asarray, expected), actual, state


# nn.Embed's lookup of batch-sharded ids cannot run under Explicit axes,
# in the user's own step neither (test_a_model_that_explicit_axes_refuse...).
@pytest.mark.parametrize("case, axis_type", [
    *[(case, AxisType.Explicit) for case in sorted(cases()) if case != "embed-masked"],
    ("mlp-fisher", AxisType.Auto), ("conv-norm-exact", AxisType.Auto),
    ("embed-masked", AxisType.Auto)])
def test_sharded_batch_gives_unsharded_updates(case, axis_type):
  model, data, loss, inputs, estimation = cases()[case]
  params = model.init(jax.random.key(1), inputs(data) if inputs else data[0])["params"]
  tx = kfac_optax.kfac(model.apply, loss, example_batch=data, inputs=inputs,
                       estimation=estimation, learning_rate=0.1,
                       inverse_update_period=1)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)
  expected, actual, state = two_updates_unsharded_and_sharded(
      tx, params, grads, data, axis_type)
  assert bf.relative_error(actual, expected) < 1e-4
  assert int(state[0].count) == 2


def test_a_model_that_explicit_axes_refuse_is_named_with_the_fix():
  """K-FAC runs the model under the user's Explicit axes, as the user's step
  does: a model that cannot run there (nn.Embed's gather of batch-sharded
  ids) is named, with the fix, not sent to the batch's structure."""
  model, data, loss, inputs, _ = cases()["embed-masked"]
  params = model.init(jax.random.key(1), inputs(data))["params"]
  tx = kfac_optax.kfac(model.apply, loss, example_batch=data, inputs=inputs,
                       estimation="empirical", learning_rate=0.1)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh), pytest.raises(ValueError) as error:
    jax.jit(lambda s, b: tx.update(params, s, params, batch=b))(
        tx.init(params), jax.device_put(data, NamedSharding(mesh, P("data"))))
  message = str(error.value)
  assert message.startswith(
      "apply_fn cannot run on batch under the mesh's Explicit axes, where "
      "K-FAC runs it as your own step does: Use `.at[...].get(out_sharding=)`")
  assert message.endswith(
      "\nFix: name the sharding JAX asks for in the model (out_sharding=, "
      "jax.sharding.reshard), or make the mesh axes Auto (jax.make_mesh(..., "
      "axis_types=(jax.sharding.AxisType.Auto, ...))).")


def test_user_train_step_under_explicit_mesh():
  """grads + K-FAC update + apply in one jitted step, batch sharded P("data")."""
  model, data, loss, _, _ = cases()["mlp-fisher"]
  params = model.init(jax.random.key(1), data[0])["params"]
  tx = kfac_optax.kfac(model.apply, loss, example_batch=data, learning_rate=0.1)

  @jax.jit
  def step(params, opt_state, batch, rng):
    grads = jax.grad(lambda p: loss.value(model.apply({"params": p}, batch[0]), batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params, batch=batch, rng=rng)
    return optax.apply_updates(params, updates), opt_state

  expected, _ = step(params, tx.init(params), data, jax.random.key(3))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    actual, _ = step(jax.device_put(params, NamedSharding(mesh, P())),
                     jax.device_put(tx.init(params), NamedSharding(mesh, P())),
                     jax.device_put(data, NamedSharding(mesh, P("data"))),
                     jax.random.key(3))
  assert bf.relative_error(actual, jax.tree.map(np.asarray, expected)) < 1e-5



@pytest.mark.parametrize("context", [False, True], ids=["no-set-mesh", "set-mesh"])
def test_explicit_arrays_from_the_user_outside_the_arguments(context):
  """Arrays on an Explicit mesh reach K-FAC's pass with or without
  `jax.set_mesh`: the batch, a sharded `example_batch`, and the values that
  `optax.inject_hyperparams` gives the transformation as settings."""
  model, data, loss, _, _ = cases()["mlp-fisher"]
  params = model.init(jax.random.key(1), data[0])["params"]
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)

  def run(example_batch, batch, put=lambda tree: tree):
    tx = optax.inject_hyperparams(
        kfac_optax.kfac, static_args=("apply_fn", "loss", "num_samples"))(
        model.apply, loss, example_batch=example_batch, learning_rate=0.1,
        damping=lambda count: 1e-2 * 0.5 ** count, inverse_update_period=1)

    @jax.jit
    def two_updates(state, batch):
      out = []
      for rng in jax.random.split(jax.random.key(5), 2):
        updates, state = tx.update(grads, state, params, batch=batch, rng=rng)
        out.append(updates)
      return out
    return two_updates(put(tx.init(params)), batch)

  expected = run(data, data)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh) if context else contextlib.nullcontext():
    sharded = jax.device_put(data, NamedSharding(mesh, P("data")))
    actual = run(sharded, sharded, lambda tree: jax.device_put(tree, NamedSharding(mesh, P())))
  assert bf.relative_error(actual, jax.tree.map(np.asarray, expected)) < 1e-4


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_sub_batch_settings_on_a_sharded_batch_give_the_unsharded_updates(axis_type):
  """curvature_batch_size and quadratic_batch_size slice a batch that the
  mesh shards: the first 4 of 16 examples sit on 2 of the 8 devices."""
  model, data, loss, _, _ = cases()["mlp-fisher"]
  params = model.init(jax.random.key(1), data[0])["params"]
  tx = kfac_optax.kfac(model.apply, loss, example_batch=data, momentum=None,
                       curvature_batch_size=4, quadratic_batch_size=4,
                       inverse_update_period=1, num_burnin_steps=0)
  grads = grads_at(params, data)  # the true gradient: the steps are accepted
  expected, actual, state = two_updates_unsharded_and_sharded(
      tx, params, grads, data, axis_type)
  assert bf.relative_error(actual, expected) < 1e-4
  assert int(state[0].count) == 2
  assert all(np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(actual))  # accepted
