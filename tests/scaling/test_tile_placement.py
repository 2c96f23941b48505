"""Tiled factors (``factor_block_size``) kept with the params' shards: under
FSDP + tensor parallelism each device holds and applies the tiles of its own
rows and columns, a sharded run equals one device's with the same tiles, and
a checkpoint continues on another mesh (the tiles do not depend on it)."""

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import kfac_optax
from kfac_optax._src import layouts
from kfac_optax._src.curvature import explicit_axes
from tests import brute_force as bf
from tests.scaling import test_block_stacks as stacks_test
from tests.scaling import test_explicit_axes as explicit_test

TILE = 8  # divides each device's rows and columns of the tiny decoders' kernels
ROWS, COLS = P(None, "data", None, None), P(None, "model", None, None)


def _tiled_specs(state):
  """Block key -> the PartitionSpecs of its two factors, one entry per axis."""
  spec = lambda x: P(*x.sharding.spec, *[None] * (x.ndim - len(x.sharding.spec)))
  return {key: tuple(spec(x) for x in jax.tree.leaves(value))
          for key, value in state.rest.items() if isinstance(value, tuple)}


def _nnx_train(mesh, steps=3):
  """`explicit_test._train`'s steps with tiles: the example's Decoder under
  Explicit axes, ``nnx.Optimizer``."""
  with jax.set_mesh(mesh):
    model, batch = explicit_test._tiny_decoder(mesh)
    loss = kfac_optax.losses.softmax_cross_entropy()
    tx = kfac_optax.kfac(model, loss, example_batch=batch, learning_rate=1e-2,
                         damping=1e-3, inverse_update_period=2, factor_block_size=TILE)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch, rng):
      grads = nnx.grad(lambda m: loss.value(m(batch[0]), batch))(model)
      optimizer.update(model, grads, batch=batch, rng=rng)
    before = explicit_test._specs(nnx.state(model, nnx.Param))
    for i in range(steps):
      step(model, optimizer, batch, jax.random.key(i))
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    after = explicit_test._specs(nnx.state(model, nnx.Param))
    return params, before, after, optimizer.opt_state.curvature


def test_explicit_axes_tiles_follow_the_params_and_equal_one_device():
  """The example's Decoder on 2x4, Explicit axes: after 3 steps with two
  refreshes its params equal one device's with the same tiles; each side's
  tiles are split as its kernel's rows or columns, where those hold whole
  tiles on each device (the key's 16 columns over 4 devices do not)."""
  one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
  expected, *_ = _nnx_train(one)
  actual, before, after, state = _nnx_train(jax.make_mesh((2, 4), ("data", "model")))
  assert bf.relative_error(actual, expected) < 1e-5
  assert after == before
  for found in (_tiled_specs(state.factors), _tiled_specs(state.inverses)):
    assert found["blocks/0/query"] == (ROWS, COLS)  # kernel P("data", "model")
    assert found["blocks/0/down"] == (COLS, ROWS)   # kernel P("model", "data")
    assert found["blocks/0/key"] == (ROWS, P(None, None, None, None))


def test_a_plain_step_moves_no_gradient():
  """Without statistics or refresh, the tiled step sends what SGD's does
  plus less than the params per device (the key and value projections'
  columns, not whole tiles per device); whole factors, whose gradients go
  to their owners and back, send more than five times that."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  never = 10**9

  def kfac(factor_block_size):
    return lambda model, loss, batch: kfac_optax.kfac(
        model, loss, example_batch=batch, learning_rate=1e-2, damping=1e-3,
        stats_update_period=never, inverse_update_period=never,
        factor_block_size=factor_block_size)
  tiled, _ = explicit_test._step_collective_bytes(mesh, kfac(TILE))
  whole, _ = explicit_test._step_collective_bytes(mesh, kfac(None))
  sgd, _ = explicit_test._step_collective_bytes(mesh, lambda *_: optax.sgd(1e-2, momentum=0.9))
  with jax.set_mesh(mesh):
    model, _ = explicit_test._tiny_decoder(mesh)
    params = nnx.state(model, nnx.Param)
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
  assert 0 <= tiled - sgd < per_device
  assert whole - sgd > 5 * per_device


def _linen_run(mesh, steps, first=0, start=None):
  """`stacks_test.sharded_lm` with tiles (Auto axes, params in logical
  boxes): (params, state, updates) after ``steps`` steps from ``start``
  (None: a jitted init's)."""
  with jax.set_mesh(mesh):
    model, params, batch, _ = stacks_test.sharded_lm(mesh)
    tx = kfac_optax.kfac(model.apply, kfac_optax.losses.softmax_cross_entropy(),
                         example_batch=batch, learning_rate=1e-2, damping=1e-2,
                         inverse_update_period=1, factor_block_size=TILE)
    if start is not None:
      params, state = start
    else:
      state = jax.jit(tx.init)(params)
    return stacks_test.train(model, tx, params, state, batch, steps, first)


@pytest.fixture(scope="module")
def linen_one_device():
  return _linen_run(stacks_test.mesh_of((1, 1)), 3)


def test_logical_boxes_place_the_tiles_and_checkpoints_move(tmp_path, linen_one_device):
  """Auto axes, the rules in the params' boxes: 2 steps on 2x4 equal one
  device's with the tiles split like the kernels; saved with orbax and
  restored on 4x2 (its own tile placement, from a jitted init's shardings),
  the third step equals the uninterrupted run's."""
  params, state, updates = _linen_run(stacks_test.mesh_of((2, 4)), 2)
  assert bf.relative_error(nn.meta.unbox(updates), jax.tree.map(
      np.asarray, nn.meta.unbox(linen_one_device[2][:2]))) < 1e-5
  tiles = _tiled_specs(state[0].factors)
  assert tiles["DecoderBlock_0/DenseGeneral_0"] == (ROWS, COLS)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", {"params": params, "opt_state": state})
  checkpointer.wait_until_finished()

  mesh = stacks_test.mesh_of((4, 2))
  with jax.set_mesh(mesh):
    model, fresh, batch, _ = stacks_test.sharded_lm(mesh)
    tx = kfac_optax.kfac(model.apply, kfac_optax.losses.softmax_cross_entropy(),
                         example_batch=batch, learning_rate=1e-2, damping=1e-2,
                         inverse_update_period=1, factor_block_size=TILE)
    init = jax.jit(tx.init).lower(fresh).compile()
    target = {"params": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), fresh),
              "opt_state": jax.tree.map(
                  lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                  jax.eval_shape(tx.init, fresh), init.output_shardings)}
    restored = checkpointer.restore(tmp_path / "state", target)
  _, state, last = _linen_run(mesh, 1, 2, (restored["params"], restored["opt_state"]))
  assert bf.relative_error(nn.meta.unbox(last[0]), jax.tree.map(
      np.asarray, nn.meta.unbox(linen_one_device[2][2]))) < 1e-5
  assert _tiled_specs(state[0].factors)["DecoderBlock_0/DenseGeneral_0"] == (ROWS, COLS)


def test_an_einsum_kernel_matrix_keeps_its_sharding_type():
  """Flax's Einsum with heads before head_dim (Gemma's attention output,
  ``NHD``, heads over "model" and the output over "data"): its kernel
  matrix has a typed layout under Explicit axes, so its tiles are placed."""
  layout = layouts.EinsumLayout("BTNH", "NHD", "BTD", (
      ("B", 2), ("D", 16), ("H", 8), ("N", 4), ("T", 3)))
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  spec = explicit_axes.typed_spec(layout.kernel_matrix, jax.numpy.zeros((4, 8, 16)),
                                  P("model", None, "data"), mesh.abstract_mesh)
  assert spec == P(None, "model", "data")
