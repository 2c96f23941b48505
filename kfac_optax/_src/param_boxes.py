"""Params in boxes: NNX Variables and Flax's partitioning metadata.

A params tree may hold its arrays in boxes: ``nnx.Variable`` (an NNX model's
``nnx.state(model, nnx.Param)``) or the ``nn.Partitioned`` and
``nn.LogicallyPartitioned`` boxes of ``nn.with_partitioning`` and
``nn.with_logical_partitioning`` (linen). K-FAC works on the arrays
(`values`): its plan keys every leaf by module path and param name, which a
box would lengthen. What it hands back, the updates and the params-shaped
parts of its state, goes back into the boxes of what it was given (`like`),
so that ``nn.get_partition_spec`` and ``nnx.get_partition_spec`` read the
same names from them as from the params.
"""

from typing import Any

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
