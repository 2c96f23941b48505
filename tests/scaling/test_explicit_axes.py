"""A model that names its own shardings under Explicit mesh axes (kernels
placed by Flax's partitioning metadata, activations by ``out_sharding=``,
``jax.sharding.reshard``) trains with K-FAC on an FSDP + tensor-parallel
mesh as on one device: K-FAC runs the model in its passes under the same
axes as the user's step."""

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import kfac_optax
from examples import sharded_transformer
from tests import brute_force as bf


def _specs(tree):
  """Each array's PartitionSpec; nnx.Optimizer's state holds them in
  Variables."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  array = lambda x: x.get_value() if is_variable(x) else x
  return jax.tree.map(lambda x: jax.typeof(array(x)).sharding.spec, tree,
                      is_leaf=is_variable)


def _train(mesh, steps=3):
  """``steps`` K-FAC steps of the example's Decoder (tiny) on ``mesh``:
  (params, their specs before and after, the K-FAC state)."""
  with jax.set_mesh(mesh):
    model = sharded_transformer.Decoder(width=32, depth=1, heads=4, kv_heads=2,
                                        mlp=64, rngs=nnx.Rngs(0))
    ids = np.arange(8 * 17).reshape(8, 17) * 7 % 256
    batch = jax.device_put((ids[:, :-1], ids[:, 1:]),
                           jax.NamedSharding(mesh, P("data")))
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
