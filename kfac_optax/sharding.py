"""Mesh-aware helpers: distributing factor inverses, placing the optimizer state.

Data parallelism itself needs nothing from here: with the batch sharded over a
mesh axis, XLA all-reduces the statistics. These helpers spread the inverse
refresh over the devices and keep the state's placement fixed across steps.
"""

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kfac_optax.curvature import ScaleByKFACState

# Below this many bytes a factor array is replicated even when
# `state_shardings(shard_factors=True)`: gathering it would cost more than it saves.
MIN_SHARDED_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class StackSharding:
  """Shards a stack of matrices along its leading axis over every mesh axis.

  Attributes:
    axes: the mesh axis names the stack axis is split over.
    num_shards: the product of their sizes; stacks are padded to a multiple.
    mesh: a concrete mesh, or ``None`` to use the context mesh (``jax.set_mesh``).
  """

  axes: tuple[str, ...]
  num_shards: int
  mesh: jax.sharding.Mesh | None = None

  def map(self, f: Callable[..., jax.Array], *stacks: jax.Array) -> jax.Array:
    """``f`` on each device's ``1/num_shards`` of the stacks, then all-gathered."""
    spec = PartitionSpec(self.axes)
    local = jax.shard_map(f, mesh=self.mesh, in_specs=spec, out_specs=spec)(*stacks)
    replicated = (PartitionSpec() if self.mesh is None
                  else NamedSharding(self.mesh, PartitionSpec()))
    return jax.lax.with_sharding_constraint(local, replicated)


def stack_sharding(mesh: jax.sharding.Mesh | None) -> StackSharding | None:
  """How inverse stacks are distributed: over ``mesh``, else the context mesh.

  Returns ``None`` (no distribution) without a mesh or on a single device.
  Inside a context mesh `StackSharding.map` uses it (as an abstract mesh),
  which also holds under `jax.sharding.auto_axes` (see
  `transform._update_with_auto_axes`).
  """
  context = jax.sharding.get_abstract_mesh()
  if not context.empty:
    axes, size, concrete = context.axis_names, context.size, None
  elif mesh is not None:
    axes, size, concrete = mesh.axis_names, mesh.size, mesh
  else:
    return None
  if size == 1:
    return None
  return StackSharding(tuple(axes), size, concrete)


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
