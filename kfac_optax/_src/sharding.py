"""Placing K-FAC's state on a mesh: the sharding of every leaf.

Data parallelism itself needs nothing from here: with the batch sharded over
a mesh axis, XLA all-reduces the statistics. `state_shardings` keeps the
state's placement fixed across steps (``in_shardings``/``out_shardings``);
the inverse refresh spreads itself over the mesh (`linalg.distributed`).
"""

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kfac_optax._src.curvature.state import ScaleByKFACState

# Below this many bytes a factor array is replicated even when
# `state_shardings(shard_factors=True)`: gathering it would cost more than it saves.
MIN_SHARDED_BYTES = 1 << 20


def state_shardings(tree: Any, mesh: jax.sharding.Mesh, *,
                    shard_factors: bool = False) -> Any:
  """The `NamedSharding` of every leaf of a state holding K-FAC's state.

  Pass the result as ``in_shardings``/``out_shardings`` of the jitted step
  (and to `jax.device_put` once) so the state is placed once and never
  resharded between steps. Works on a `ScaleByKFACState`, on the state of an
  optax chain or of `kfac`, and on a whole `TrainState`.

  Args:
    tree: a pytree (arrays or ``jax.ShapeDtypeStruct``) that may contain
      `ScaleByKFACState` nodes.
    mesh: the device mesh.
    shard_factors: also split the leading (stack) axis of each large factor
      statistic (at least ``MIN_SHARDED_BYTES``, axis divisible by the mesh
      size) over all mesh axes; every other leaf is replicated. The inverses
      stay replicated: every device multiplies by all of them each step.

  Returns:
    A pytree of `NamedSharding` with the structure of ``tree``.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  split = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))

  def factor_sharding(leaf):
    shape, dtype = np.shape(leaf), np.dtype(leaf.dtype)
    large = np.prod(shape) * dtype.itemsize >= MIN_SHARDED_BYTES
    divisible = len(shape) > 0 and shape[0] % mesh.size == 0
    return split if shard_factors and large and divisible else replicated

  def sharding_of(node):
    if isinstance(node, ScaleByKFACState):
      return jax.tree.map(lambda _: replicated, node)._replace(
          factors=jax.tree.map(factor_sharding, node.factors),
          inverses=jax.tree.map(lambda _: replicated, node.inverses))
    return replicated

  return jax.tree.map(sharding_of, tree,
                      is_leaf=lambda x: isinstance(x, ScaleByKFACState))
