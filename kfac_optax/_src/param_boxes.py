"""Params in boxes: NNX Variables and Flax's partitioning metadata.

A params tree may hold its arrays in boxes: ``nnx.Variable`` (an NNX model's
``nnx.state(model, nnx.Param)``) or the ``nn.Partitioned`` and
``nn.LogicallyPartitioned`` boxes of ``nn.with_partitioning`` and
``nn.with_logical_partitioning`` (linen). K-FAC works on the arrays
(`values`): its plan keys every leaf by module path and param name, which a
box would lengthen. What it hands back, the updates and the params-shaped
parts of its state, goes back into the boxes of what it was given (`like`),
so that ``nn.get_partition_spec`` and ``nnx.get_partition_spec`` read the
same names from them as from the params. The boxes' names also tell K-FAC,
under Auto mesh axes, how each param lies on the mesh (`specs`).
"""

from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta


def _is_box(x: Any) -> bool:
  return isinstance(x, (nnx.Variable, meta.AxisMetadata))


def values(tree: Any) -> Any:
  """``tree`` with every box replaced by the array it holds (identity on a
  tree without boxes)."""
  return jax.tree.map(lambda x: _unboxed(x) if _is_box(x) else x, tree,
                      is_leaf=_is_box)


def _unboxed(box: Any) -> Any:
  if isinstance(box, nnx.Variable):
    return box.get_value()
  return values(box.unbox())  # a box may hold another


def like(reference: Any, tree: Any) -> Any:
  """``tree`` (arrays, `values`' structure) in ``reference``'s boxes: each
  array put in a copy of the box at its place in ``reference``, if any."""
  return jax.tree.map(lambda ref, value: _reboxed(ref, value) if _is_box(ref) else value,
                      reference, tree, is_leaf=_is_box)


def _reboxed(box: Any, value: Any) -> Any:
  if isinstance(box, nnx.Variable):
    return box.replace(value)
  inner = box.unbox()
  return box.replace_boxed(_reboxed(inner, value) if _is_box(inner) else value)


def declares_any(specs_tree: Any) -> bool:
  """Whether a tree like `specs`' result holds any PartitionSpec."""
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  return any(is_spec(x) for x in jax.tree.leaves(specs_tree, is_leaf=is_spec))


def specs(tree: Any) -> Any:
  """Each array's PartitionSpec as its box declares it (`values`'
  structure): an NNX Variable's sharding names, an ``nn.Partitioned`` box's
  names, an ``nn.LogicallyPartitioned`` box's through its rules or those of
  the context (``nn.logical_axis_rules``); None for an unboxed array or
  logical names without rules."""
  def spec(x):
    if not _is_box(x):
      return None
    if isinstance(x, nnx.Variable):
      metadata = x.get_metadata()
      names = metadata.get("out_sharding") or metadata.get("sharding_names")
    elif isinstance(x, nn.LogicallyPartitioned):
      rules = x.rules or nn.get_logical_axis_rules()
      names = nn.logical_to_mesh_axes(x.names, rules) if rules else None
    else:
      names = getattr(x, "names", None)
    return None if names is None else jax.sharding.PartitionSpec(*names)
  return jax.tree.map(spec, tree, is_leaf=_is_box)
