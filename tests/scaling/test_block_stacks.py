"""Kronecker factors spread over the mesh: each device owns a share of the blocks.

A jitted ``init`` and step, given no shardings for the state, split every
stack of factors and inverses over all the devices of a ("data", "model")
mesh; the updates equal one device's (linen with logical partitioning, NNX
with its partitioning metadata); a checkpoint written on one mesh continues
on another.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kfac_optax
from benchmarks import sharded_state
from tests import brute_force as bf
from tests.scaling.test_distributed_inverses import SixteenFactorMLP

CONFIG = dict(vocab=64, width=32, depth=1, heads=4, kv_heads=2, mlp=64)
per_device_bytes = sharded_state.per_device_bytes


def mesh_of(shape):
  return jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:np.prod(shape)],
                       axis_types=(AxisType.Auto,) * 2)


def test_eight_equal_blocks_take_an_eighth_each():
  model = SixteenFactorMLP()
  x = jax.random.normal(jax.random.key(0), (32, 16))
  batch = (x, jnp.arange(32) % 16)
  params = model.init(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(model.apply, kfac_optax.losses.softmax_cross_entropy(),
                                example_batch=batch)
  whole = tx.init(params)
  curvature = lambda state: (state.factors, state.inverses)
  total = sum(x.nbytes for x in jax.tree.leaves(curvature(whole)))
  largest = 2 * max(sum(x.nbytes for x in jax.tree.leaves(whole.factors[key]))
                    for key in whole.factors)  # factors and inverses of a block

  with jax.set_mesh(mesh_of((2, 4))):
    init = jax.jit(tx.init).lower(params).compile()
    state = init(params)
    step = jax.jit(lambda s: tx.update(params, s, params, batch=batch,
                                      rng=jax.random.key(0))[1]).lower(
        state).compile()
  for shardings in (init.output_shardings, step.output_shardings):
    spread = per_device_bytes(curvature(state), curvature(shardings))
    assert spread == total // 8
    assert spread <= 1.25 * total / 8 + largest  # the bound
  assert {s.spec for s in jax.tree.leaves(step.output_shardings.factors.stacks)} == {
      P(("data", "model"))}


def sharded_lm(mesh):
  """The benchmark's decoder LM on ``mesh``: params boxed by Flax's logical
  partitioning and placed by FSDP + tensor-parallel rules, a batch over
  "data" (`sharded_state.setting_up`); kfac refreshing every step (no
  cond: a smaller program)."""
  model, loss, params, batch, _ = sharded_state.setting_up(
      CONFIG, tuple(mesh.devices.shape), batch_size=8, sequence=16)
  tx = kfac_optax.kfac(model.apply, loss, example_batch=batch, learning_rate=1e-2,
                       damping=1e-2, inverse_update_period=1)
  return model, params, batch, tx


def train(model, tx, params, state, batch, steps, first):
  """``steps`` K-FAC steps from step ``first``: (params, state, every update)."""
  @jax.jit
  def step(params, state, key):
    grads = jax.grad(lambda p: tx_loss(model, p, batch))(params)
    updates, state = tx.update(grads, state, params, batch=batch, rng=key)
    return optax.apply_updates(params, updates), state, updates
  out = []
  for i in range(first, first + steps):
    params, state, updates = step(params, state, jax.random.key(i))
    out.append(updates)
  return params, state, out


def tx_loss(model, params, batch):
  logits = model.apply({"params": params}, batch[0])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


@pytest.fixture(scope="module")
def one_device_run():
  """Three steps, each with a refresh, on one device."""
  with jax.set_mesh(mesh_of((1, 1))):
    model, params, batch, tx = sharded_lm(mesh_of((1, 1)))
    return train(model, tx, params, tx.init(params), batch, 3, 0)


@pytest.fixture(scope="module")
def two_by_four_run(tmp_path_factory):
  """The same three steps on a 2x4 mesh from a jitted init, the state after
  two of them saved with orbax: (updates, final state, checkpoint path)."""
  path = tmp_path_factory.mktemp("checkpoint") / "state"
  with jax.set_mesh(mesh_of((2, 4))):
    model, params, batch, tx = sharded_lm(mesh_of((2, 4)))
    initial = jax.jit(tx.init)(params)
    # kfac's momentum is placed as the params are, by a plain jitted init.
    assert jax.tree.leaves(jax.tree.map(
        lambda m, p: m.sharding.is_equivalent_to(p.sharding, p.ndim),
        initial.previous_update, params)) == [True] * len(jax.tree.leaves(params))
    params, state, updates = train(model, tx, params, initial, batch, 2, 0)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, {"params": params, "opt_state": state})
    checkpointer.wait_until_finished()
    _, state, last = train(model, tx, params, state, batch, 1, 2)
  return updates + last, state, path


def test_fsdp_tensor_parallel_updates_equal_one_device(two_by_four_run, one_device_run):
  updates, state, _ = two_by_four_run
  assert bf.relative_error(nn.meta.unbox(updates), jax.tree.map(
      np.asarray, nn.meta.unbox(one_device_run[2]))) < 1e-5
  stacks = state[0].factors.stacks
  assert {x.sharding.spec for x in jax.tree.leaves(stacks)} == {P(("data", "model"))}


@pytest.mark.parametrize("restored_on", [(4, 2), (2, 2)])
def test_checkpoint_continues_on_another_mesh(restored_on, two_by_four_run,
                                              one_device_run):
  """Restored on ``restored_on`` (8 -> 4 devices for (2, 2)) after two steps
  on 2x4, the third step equals the uninterrupted run's."""
  mesh = mesh_of(restored_on)
  with jax.set_mesh(mesh):
    model, fresh_params, batch, tx = sharded_lm(mesh)
    target = jax.eval_shape(lambda p: {"params": p, "opt_state": tx.init(p)}, fresh_params)
    shardings = {"params": jax.tree.map(lambda x: x.sharding, fresh_params),
                 "opt_state": kfac_optax.sharding.state_shardings(
                     target["opt_state"], mesh)}
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          target, shardings)
    # The stacks' trailing padding follows the mesh: orbax pads or trims it.
    restored = ocp.StandardCheckpointer().restore(two_by_four_run[2], target,
                                                  strict=False)
    _, state, updates = train(model, tx, restored["params"], restored["opt_state"],
                              batch, 1, 2)
  assert bf.relative_error(nn.meta.unbox(updates[0]), jax.tree.map(
      np.asarray, nn.meta.unbox(one_device_run[2][2]))) < 1e-5
  stacks = state[0].factors.stacks
  assert {x.sharding.spec for x in jax.tree.leaves(stacks)} == {P(("data", "model"))}


class PartitionedMLP(nnx.Module):
  """Kernels sharded by NNX's partitioning metadata: FSDP + tensor parallel."""

  def __init__(self, rngs, use_bias=True):
    split = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
    self.first = nnx.Linear(16, 32, kernel_init=split("data", "model"), rngs=rngs,
                            use_bias=use_bias)
    self.last = nnx.Linear(32, 8, kernel_init=split("model", None), rngs=rngs,
                           use_bias=use_bias)

  def __call__(self, x):
    return self.last(jnp.tanh(self.first(x)))


def nnx_run(mesh, use_bias=True):
  """Three steps of `nnx.Optimizer` with kfac on ``mesh``: (params, opt)
  (the params as placed, not copied to the host)."""
  x = jax.random.normal(jax.random.key(0), (32, 16))
  loss = kfac_optax.losses.softmax_cross_entropy()
  with jax.set_mesh(mesh):
    model = PartitionedMLP(nnx.Rngs(0), use_bias)
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), nnx.get_partition_spec(state))))
    batch = jax.device_put((x, jnp.arange(32) % 8), NamedSharding(mesh, P("data")))
    opt = nnx.Optimizer(model, kfac_optax.kfac(
        model, loss, example_batch=batch, learning_rate=0.05,
        inverse_update_period=1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, key):
      grads = nnx.grad(lambda m: loss.value(m(batch[0]), batch))(model)
      opt.update(model, grads, batch=batch, rng=key)
    for i in range(3):
      step(model, opt, jax.random.key(i))
  return nnx.state(model, nnx.Param), opt


def test_nnx_optimizer_fsdp_tensor_parallel_equals_one_device():
  expected, _ = nnx_run(mesh_of((1, 1)))
  actual, opt = nnx_run(mesh_of((2, 4)))
  assert bf.relative_error(jax.tree.map(np.asarray, actual),
                           jax.tree.map(np.asarray, expected)) < 1e-5
  stacks = opt.opt_state.curvature.factors.stacks
  assert {x.sharding.spec for x in jax.tree.leaves(stacks)} == {P(("data", "model"))}
  specs = lambda tree: [x.sharding.spec for x in jax.tree.leaves(tree)]
  assert specs(opt.opt_state.previous_update) == specs(actual) == [
      P("model"), P("data", "model"), P(), P("model")]


def test_gradients_reach_their_owners_by_the_layouts_boxes_declare(monkeypatch):
  """Auto axes, kernels without biases: their partitioning metadata names
  the gradient matrices' layouts, so they go to their owners by all-to-all
  (`linalg.at_owners`, one call per stack), and the run equals one
  device's."""
  from kfac_optax._src import linalg  # pylint: disable=import-outside-toplevel
  expected, _ = nnx_run(mesh_of((1, 1)), use_bias=False)
  routed = []
  at_owners = linalg.at_owners
  monkeypatch.setattr(linalg, "at_owners", lambda *a, **k: routed.append(
      k.get("back", True)) or at_owners(*a, **k))
  actual, _ = nnx_run(mesh_of((2, 4)), use_bias=False)
  assert routed.count(True) == 2  # the two layers' stacks, traced once
  assert bf.relative_error(jax.tree.map(np.asarray, actual),
                           jax.tree.map(np.asarray, expected)) < 1e-5
