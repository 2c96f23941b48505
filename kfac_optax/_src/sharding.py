"""Placing K-FAC's state on a mesh: the sharding of every leaf.

Data parallelism itself needs nothing from here: with the batch sharded over
a mesh axis, XLA all-reduces the statistics. A jitted ``init`` and step
place the state themselves (the Kronecker factors' stacks split over the
mesh, `curvature.block_stacks`); `state_shardings` names the same placement
for ``in_shardings``/``out_shardings``, so that it stays fixed across steps.
"""

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from kfac_optax._src.curvature.block_stacks import BlockStacks


def state_shardings(tree: Any, mesh: jax.sharding.Mesh, params: Any = None) -> Any:
  """The `NamedSharding` of every leaf of a state holding K-FAC's state.

  Pass the result as ``in_shardings``/``out_shardings`` of the jitted step
  (and to `jax.device_put` once) so the state is placed once and never
  resharded between steps. Works on a `ScaleByKFACState`, on the state of an
  optax chain or of `kfac`, and on a whole `TrainState`.

  Each stack of Kronecker factors and inverses is split along its slots over
  every axis of ``mesh`` (where the slots divide into its size: a state made
  for another mesh is replicated). With ``params``, every part of ``tree``
  shaped like the params (a `TrainState`'s params, `kfac`'s momentum,
  optax's moments) gets the params' shardings. Every other leaf is
  replicated.

  Args:
    tree: a pytree (arrays or ``jax.ShapeDtypeStruct``) that may contain
      K-FAC states.
    mesh: the device mesh.
    params: None, or the params' shardings: a tree of `jax.sharding.Sharding`
      (or of arrays placed by them) with the params' structure.

  Returns:
    A pytree of `NamedSharding` with the structure of ``tree``.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  split = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
  if params is not None:
    params = jax.tree.map(lambda x: getattr(x, "sharding", x), params,
                          is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    params_structure = jax.tree.structure(params)

  def params_shaped(node):
    return params is not None and jax.tree.structure(node) == params_structure

  def sharding_of(node):
    if isinstance(node, BlockStacks):
      stacks = jax.tree.map(
          lambda x: split if x.shape[0] % mesh.size == 0 else replicated, node.stacks)
      return node.replace(stacks, jax.tree.map(lambda _: replicated, node.rest))
    if params_shaped(node):
      return params
    return replicated

  return jax.tree.map(sharding_of, tree, is_leaf=lambda x: isinstance(x, BlockStacks)
                      or params_shaped(x))
