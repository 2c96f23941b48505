"""The first n examples of a batch, on which ``curvature_batch_size`` takes
the statistics and ``quadratic_batch_size`` builds the automatic mode's
quadratic model, and the check at ``init`` that the model runs on them."""

from typing import Any

import jax
import jax.numpy as jnp

from kfac_optax._src import param_boxes
from kfac_optax._src.curvature import explicit_axes
from kfac_optax._src.curvature import plan as plans
from kfac_optax._src.curvature import replicas


def _size(batch: Any, size: int, name: str) -> int:
  """The batch's size: its leaves' common leading axis, which the setting
  ``name=size`` slices."""
  leaves = jax.tree.leaves(batch)
  leading = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in leaves}
  if len(leading) != 1 or None in leading:
    shapes = [tuple(jnp.shape(leaf)) for leaf in leaves]
    raise ValueError(
        f"{name}={size} takes the first {size} examples of every "
        f"leaf of the batch, but its leaves have no common leading (batch) "
        f"axis: shapes {shapes[:8]}{' ...' if len(shapes) > 8 else ''}.\nFix: "
        f"give every leaf of the batch the examples on its first axis, or "
        f"{name}=None (the whole batch).")
  (batch_size,) = leading
  return batch_size


def first_examples(batch: Any, size: int | None,
                   name: str = "curvature_batch_size") -> Any:
  """The first ``size`` examples of ``batch`` (the setting ``name``; all of
  it for None): every leaf sliced on its leading axis."""
  if size is None:
    return batch
  batch_size = _size(batch, size, name)
  if size > batch_size:
    raise ValueError(
        f"{name}={size} exceeds the batch size {batch_size}.\n"
        f"Fix: {name} <= {batch_size}, or None (the whole batch).")
  return jax.tree.map(lambda leaf: leaf[:size], batch)


def check_model_runs(curvature: Any, params: Any, size: int | None,
                     name: str) -> None:
  """Raises naming the setting ``name`` when the model of ``curvature`` (a
  `Curvature`), which runs on its ``example_batch``, fails on the first
  ``size`` examples of it (checked where the example batch has more), as
  ``update`` would run it on the batch's."""
  if size is None:
    return
  whole = _size(curvature.example_batch, size, name)
  if size >= whole:
    return
  params = param_boxes.values(params)
  with explicit_axes.params_mesh(params):
    plans.check_runs_on_part(
        curvature.model, params, first_examples(curvature.example_batch, size, name),
        name, size, whole, replicas.names(curvature.axis_name))
