"""A model that names its own shardings under Explicit mesh axes (kernels
placed by Flax's partitioning metadata, activations by ``out_sharding=``,
``jax.sharding.reshard``) trains with K-FAC on an FSDP + tensor-parallel
mesh as on one device: K-FAC runs the model in its passes under the same
axes as the user's step."""

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import kfac_optax
from benchmarks import collectives
from examples import sharded_transformer
from tests import brute_force as bf


def _specs(tree):
  """Each array's PartitionSpec; nnx.Optimizer's state holds them in
  Variables."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  array = lambda x: x.get_value() if is_variable(x) else x
  return jax.tree.map(lambda x: jax.typeof(array(x)).sharding.spec, tree,
                      is_leaf=is_variable)


def _tiny_decoder(mesh):
  """The example's Decoder (tiny) and a batch split over "data", made under
  ``mesh`` (call inside ``jax.set_mesh(mesh)``)."""
  model = sharded_transformer.Decoder(width=32, depth=1, heads=4, kv_heads=2,
                                      mlp=64, rngs=nnx.Rngs(0))
  ids = np.arange(8 * 17).reshape(8, 17) * 7 % 256
  return model, jax.device_put((ids[:, :-1], ids[:, 1:]), jax.NamedSharding(mesh, P("data")))


def _train(mesh, steps=3):
  """``steps`` K-FAC steps of the example's Decoder (tiny) on ``mesh``:
  (params, their specs before and after, the K-FAC state)."""
  with jax.set_mesh(mesh):
    model, batch = _tiny_decoder(mesh)
    loss = kfac_optax.losses.softmax_cross_entropy()
    tx = kfac_optax.kfac(model, loss, example_batch=batch, learning_rate=1e-2,
                         damping=1e-3, inverse_update_period=2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch, rng):
      grads = nnx.grad(lambda m: loss.value(m(batch[0]), batch))(model)
      optimizer.update(model, grads, batch=batch, rng=rng)
    before = _specs(nnx.state(model, nnx.Param))
    for i in range(steps):
      step(model, optimizer, batch, jax.random.key(i))
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    return params, before, _specs(nnx.state(model, nnx.Param)), optimizer.opt_state


def test_explicit_fsdp_tensor_parallel_model_equals_one_device():
  """Decoder on 2x4 ("data", "model"), Explicit axes: after 3 steps with
  two refreshes its params equal one device's; their shardings are those
  the model gave them; the factors are split over all 8 devices."""
  one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
  expected, *_ = _train(one)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}
  actual, before, after, state = _train(mesh)
  assert bf.relative_error(actual, expected) < 1e-5
  assert after == before
  assert before["blocks"][0]["query"]["kernel"] == P("data", "model")
  assert before["blocks"][0]["down"]["kernel"] == P("model", "data")
  stacks = jax.tree.leaves(_specs(state.curvature.factors.stacks))
  assert stacks and all(spec[0] == ("data", "model") for spec in stacks)
  assert _specs(state.previous_update) == before  # the momentum



def test_describe_outside_the_mesh_runs_under_the_params_mesh():
  """describe() after the `with jax.set_mesh` block: the model's
  out_sharding= names need its mesh, which the params carry."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  with jax.set_mesh(mesh):
    model = sharded_transformer.Decoder(width=32, depth=1, heads=4, kv_heads=2,
                                        mlp=64, rngs=nnx.Rngs(0))
    ids = jax.device_put(np.zeros((8, 16), np.int32), jax.NamedSharding(mesh, P("data")))
    tx = kfac_optax.kfac(model, kfac_optax.losses.softmax_cross_entropy(),
                         example_batch=(ids, ids), learning_rate=1e-2)
  summary = kfac_optax.describe(tx, nnx.state(model, nnx.Param))
  assert summary.shares()["kronecker"] > 0.5
  assert {row.path for row in summary.rows} >= {"blocks/0/query", "readout"}


def _step_collective_bytes(mesh, make_tx):
  """Per-device collective bytes of the Decoder's compiled step (tiny) on
  ``mesh``, and the optimizer state."""
  with jax.set_mesh(mesh):
    model, batch = _tiny_decoder(mesh)
    loss = kfac_optax.losses.softmax_cross_entropy()
    optimizer = nnx.Optimizer(model, make_tx(model, loss, batch), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch, rng):
      model, optimizer = nnx.merge(graphdef, state)
      grads = nnx.grad(lambda m: loss.value(m(batch[0]), batch))(model)
      optimizer.update(model, grads, batch=batch, rng=rng)
      return nnx.state((model, optimizer))
    hlo = jax.jit(step).lower(state, batch, jax.random.key(0)).compile().as_text()
  return collectives.step_bytes(hlo).total(), optimizer.opt_state


def test_explicit_gradients_reach_their_owners_by_all_to_all():
  """Under Explicit axes each gradient matrix goes to the device owning its
  slot and back by all-to-all (`linalg.owner_routing`): a step without
  statistics or refresh sends at most SGD's step plus twice each device's
  share of the stacks there and back, where all-gathering the stacks (as
  XLA moved them before) sent 7x the SGD step's bytes more."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  never = 10**9
  kfac_bytes, state = _step_collective_bytes(mesh, lambda model, loss, batch: kfac_optax.kfac(
      model, loss, example_batch=batch, learning_rate=1e-2, damping=1e-3,
      stats_update_period=never, inverse_update_period=never))
  sgd_bytes, _ = _step_collective_bytes(
      mesh, lambda *_: optax.sgd(1e-2, momentum=0.9))
  share = sum(4 * a.shape[0] * a.shape[1] * g.shape[1] / mesh.size
              for a, g in state.curvature.factors.stacks)  # one stack of V, per device
  assert kfac_bytes - sgd_bytes <= 2 * 2 * share
