"""benchmarks/collectives.py: the collective bytes read from compiled HLO,
against programs whose collectives are known."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import collectives
from benchmarks import sharded_state


def compiled(f, *args, **shardings):
  return jax.jit(f, **shardings).lower(*args).compile()


def test_a_sum_over_a_split_axis_is_one_all_reduce_and_a_branch_apart():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  split = jax.sharding.NamedSharding(mesh, jax.P("d"))

  def f(x, flag):
    total = jnp.sum(x, 0)  # each device's partial sums: f32[4], all-reduced
    twice = jax.lax.cond(flag > 0, lambda: jnp.sum(2 * x, 0), lambda: jnp.zeros(4))
    return total, twice
  program = compiled(f, jax.ShapeDtypeStruct((16, 4), jnp.float32),
                     jax.ShapeDtypeStruct((), jnp.int32), in_shardings=(split, None))
  sent = collectives.step_bytes(program.as_text())
  assert sent.always == {**{kind: 0 for kind in sent.always}, "all-reduce": 16}
  assert sent.conditional == {**{kind: 0 for kind in sent.always}, "all-reduce": 16}


def test_gathering_a_split_array_counts_the_whole_array_per_device():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  split = jax.sharding.NamedSharding(mesh, jax.P("d"))
  whole = jax.sharding.NamedSharding(mesh, jax.P())
  program = compiled(lambda x: x * 2, jax.ShapeDtypeStruct((16, 4), jnp.float32),
                     in_shardings=split, out_shardings=whole)
  assert collectives.step_bytes(program.as_text()).total() == 16 * 4 * 4


def test_per_device_bytes_of_split_and_replicated_arrays():
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  arrays = [np.zeros((8, 4), np.float32), np.zeros((3,), np.float64)]
  shardings = [jax.sharding.NamedSharding(mesh, jax.P("a", "b")),
               jax.sharding.NamedSharding(mesh, jax.P())]
  assert sharded_state.per_device_bytes(arrays, shardings) == 4 * 1 * 4 + 3 * 8
