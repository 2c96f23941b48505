"""Batched, bucketed and mesh-distributed factor inverses; state shardings."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kfac_optax
from kfac_optax._src import linalg
from kfac_optax._src.linalg import stacked_inverses
from tests import brute_force as bf

LAPACK_TARGETS = {"eigh": "lapack_ssyevd", "cholesky": "lapack_spotrf"}


def test_bucket_sizes_pad_only_when_cheap():
  # 97 -> 100 costs (100/97)³ ≈ 1.10 and 32 -> 33 ≈ 1.10: padded; 64 -> 100
  # or 33 -> 64 would cost several times more, beyond 5% of all the work
  # (2.5e6): buckets of their own.
  assert stacked_inverses.bucket_sizes([32, 100, 64, 97, 33, 64]) == {
      100: 100, 97: 100, 64: 64, 33: 33, 32: 33}
  assert stacked_inverses.bucket_sizes([32, 100, 97], max_padding=1.0, budget=0.0) == {
      100: 100, 97: 97, 32: 32}


def test_bucket_sizes_pad_small_sizes_within_the_budget():
  # Forty 100s are 4e7 of work, 5% of it 2e6: padding one 20 (1e6 - 8e3)
  # and one 10 (1e6 - 1e3) to 100 fits, three 10s (3e6) do not.
  assert stacked_inverses.bucket_sizes([100] * 40 + [20, 10]) == {
      100: 100, 20: 100, 10: 100}
  assert stacked_inverses.bucket_sizes([100] * 40 + [10] * 3) == {100: 100, 10: 10}
  assert stacked_inverses.bucket_sizes([100] * 40 + [20, 10], budget=0.0) == {
      100: 100, 20: 20, 10: 10}
  # Only sizes up to SMALL_SIZE (128) use the budget: 200 -> 1000 would fit
  # in 5% of 4e10 but keeps its own bucket.
  assert stacked_inverses.bucket_sizes([1000] * 40 + [200]) == {1000: 1000, 200: 200}


def _psd(key, shape):
  x = jax.random.normal(key, (*shape[:-1], 2 * shape[-1]))
  return jnp.einsum("...ik,...jk->...ij", x, x) / shape[-1]


@pytest.mark.parametrize("method", ["eigh", "cholesky", "newton_schulz"])
@pytest.mark.parametrize("distributed", [False, True])
def test_invert_all_matches_explicit_inverses(method, distributed):
  keys = jax.random.split(jax.random.key(0), 4)
  tree = {
      "stack": linalg.Damped(_psd(keys[0], (3, 10, 10)), jnp.array([0.1, 1.0, 2.0])),
      "padded": linalg.Damped(_psd(keys[1], (2, 1, 9, 9)), jnp.full((2, 1), 0.5)),
      "alone": linalg.Damped(_psd(keys[2], (1, 4, 4)), jnp.array([0.3])),
      "kept": jnp.arange(3.0),
  }
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  stacks = linalg.stack_sharding(mesh) if distributed else None
  inverted = jax.jit(lambda t: linalg.invert_all(t, method, stacks))(tree)

  for key in ("stack", "padded", "alone"):
    matrix = np.asarray(tree[key].matrix, np.float64)
    damping = np.asarray(tree[key].damping, np.float64)
    expected = np.linalg.inv(matrix + damping[..., None, None] * np.eye(matrix.shape[-1]))
    assert inverted[key].shape == matrix.shape
    assert bf.relative_error(inverted[key], expected) < 1e-4, key
  np.testing.assert_array_equal(inverted["kept"], tree["kept"])


class SixteenFactorMLP(nn.Module):
  """Eight bias-free 16 -> 16 layers: sixteen 16x16 factors, one bucket."""

  @nn.compact
  def __call__(self, x):
    for _ in range(7):
      x = jnp.tanh(nn.Dense(16, use_bias=False)(x))
    return nn.Dense(16, use_bias=False)(x)


def _problem(inverse):
  model = SixteenFactorMLP()
  x = jax.random.normal(jax.random.key(0), (32, 16))
  batch = (x, jnp.arange(32) % 16)
  params = model.init(jax.random.key(1), x)["params"]
  tx = kfac_optax.scale_by_kfac(
      model.apply, kfac_optax.losses.softmax_cross_entropy(), example_batch=batch,
      estimation="empirical", inverse=inverse, inverse_update_period=1)
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)
  update = jax.jit(lambda state, batch: tx.update(grads, state, params, batch=batch))
  return tx.init(params), batch, update


@pytest.mark.parametrize("inverse", ["eigh", "cholesky"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_each_device_inverts_an_eighth_of_the_stack(inverse, axis_type):
  state, batch, update = _problem(inverse)
  expected, _ = update(state, batch)
  unsharded_hlo = update.lower(state, batch).compile().as_text()

  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  with jax.set_mesh(mesh):
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    state = jax.device_put(state, NamedSharding(mesh, P()))
    actual, _ = update(state, batch)
    sharded_hlo = update.lower(state, batch).compile().as_text()

  def factorisations(hlo):
    """(LAPACK factorisation calls, trip counts of the program's own loops).

    On CPU a stack is factorised one matrix at a time in a loop
    (`distributed.over_stack`), so the loop's trip count is the stack size. Only
    loops written as `while` count: XLA:CPU also runs some other ops as
    loops (a triangular solve over its rows; a scatter, with some of its
    code generators).
    """
    calls = [line for line in hlo.splitlines()
             if f'custom_call_target="{LAPACK_TARGETS[inverse]}' in line
             and "f32[16,16]" in line]
    written_loops = re.findall(
        r'op_name="[^"]*/while"[^\n]*known_trip_count":\{"n":"(\d+)"', hlo)
    return len(calls), set(written_loops)

  # The sixteen factors are one stack; sharded, each device factorises two
  # (Cholesky's loops: its own, and eigh's for the members where it fails).
  assert factorisations(unsharded_hlo) == (1, {"16"})
  assert factorisations(sharded_hlo) == (1, {"2"})
  assert bf.relative_error(actual, jax.tree.map(np.asarray, expected)) < 1e-4


def test_state_shardings_place_state_once():
  model = nn.Sequential([nn.Dense(512), nn.tanh, nn.Dense(8)])
  x = jnp.ones((16, 8))
  batch = (x, jnp.arange(16) % 8)
  params = model.init(jax.random.key(0), x)["params"]
  tx = kfac_optax.kfac(model.apply, kfac_optax.losses.softmax_cross_entropy(),
                       example_batch=batch, learning_rate=0.1)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):  # init under the mesh: the stacks split over it
    state = kfac_optax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  shardings = kfac_optax.sharding.state_shardings(state, mesh)
  factors = state.opt_state[0].factors
  # Two layers of different shapes: two stacks of one layer each, padded to
  # one slot per device, split over the devices; the rest replicated.
  assert [stack.g.shape for stack in factors.stacks] == [(8, 512, 512), (8, 8, 8)]
  assert factors["layers_0"].g.shape == (1, 512, 512)
  specs = shardings.opt_state[0]
  assert {s.spec for s in jax.tree.leaves((specs.factors.stacks, specs.inverses.stacks))
          } == {P(("data",))}
  assert specs.count.spec == P() and specs.factors.rest == {}
  assert jax.tree.structure(shardings) == jax.tree.structure(state)

  @jax.jit
  def step(state, batch, rng):
    grads = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, batch[0]) ** 2))(
        state.params)
    return state.apply_gradients(grads=grads, batch=batch, rng=rng)

  step = jax.jit(step, in_shardings=(shardings, NamedSharding(mesh, P("data")), None),
                 out_shardings=shardings, donate_argnums=0)
  placed = jax.device_put(state, shardings)
  placed = step(placed, jax.device_put(batch, NamedSharding(mesh, P("data"))),
                jax.random.key(1))
  assert jax.tree.map(lambda x: x.sharding, placed) == shardings
