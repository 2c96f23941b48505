"""Data-parallel replicas of one step inside ``jax.pmap`` or ``jax.shard_map``.

A step written per device (``pmap``, ``shard_map`` over a batch axis) gives
each device a share of the batch, and the step averages the gradients over
the axes that split it (``lax.pmean``). K-FAC measures more than the
gradient on the batch: the factors' statistics, and in the automatic mode
the quadratic model's curvature and the loss before and after the step.
Each of these is a mean over the batch's examples (or loss terms), so with
equal shares

    (1/R) Σ_r (1/n) Σ_{i ∈ share r} s_i = (1/(R n)) Σ_i s_i,

the mean over the R replicas of their share's mean is the whole batch's
mean: averaged over ``axis_name`` with ``lax.pmean``, every replica keeps
the same state and takes the step one device would take on the whole batch
(`tests/scaling/test_replicas.py`). Without the average each device would
keep its own share's factors, and replicas that started equal would drift
apart (``update`` refuses to run so; see `axes`).
"""

from typing import Any

import jax

AxisName = str | tuple[str, ...] | None


def check_axis_name(axis_name: Any) -> None:
  """``axis_name`` is None, an axis name or a tuple of them, else a
  `ValueError`."""
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  if axis_name is not None and not (  # "" names no axis: a typo, not ()
      isinstance(names, tuple) and all(isinstance(n, str) and n for n in names)):
    raise ValueError(
        "axis_name must be None, the name of the pmap/shard_map axis that "
        "splits the batch (as given to lax.pmean for the gradients), or a "
        f"tuple of names, got {axis_name!r}")


def axes(axis_name: AxisName) -> tuple[str, ...]:
  """The axes to average over: ``axis_name`` as a tuple.

  Raises:
    ValueError: inside manual mesh axes (``pmap``, ``shard_map``) with
      ``axis_name`` None: whether the devices are replicas of one step or
      independent models is not in the arrays' types under ``pmap``, and
      guessing wrong would either mix independent models or let replicas
      drift apart without a sign.
  """
  if axis_name is None:
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if manual:
      raise ValueError(
          f"K-FAC's update runs inside jax.pmap or jax.shard_map (manual "
          f"mesh axes {manual}), but axis_name is not set: each device would "
          "keep the statistics of its own share of the batch, and replicas "
          "of one step would drift apart.\nFix: axis_name= the axes your step "
          f"averages its gradients over (lax.pmean), e.g. axis_name="
          f"{manual[0]!r}; or axis_name=() for independent models, one per "
          "device.")
  return names(axis_name)


def check_context() -> None:
  """A `NotImplementedError` inside ``shard_map`` over some of the mesh's
  axes only: there the model's arrays are typed by manual and Auto axes at
  once, which K-FAC's abstract passes of the model (its discovery under
  ``jax.eval_shape``) cannot carry (JAX 0.10 asserts)."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = mesh.manual_axes
  if manual and len(manual) < len(mesh.axis_names):
    others = tuple(a for a in mesh.axis_names if a not in manual)
    raise NotImplementedError(
        f"K-FAC's update runs inside jax.shard_map over the mesh axes {manual} "
        f"only, the axes {others} left to XLA: not supported.\nFix: write the "
        "step with jax.jit and shardings (a batch sharded over the data axis, "
        "docs/scaling.md, \"Data parallel\" and \"Sharded jobs\"), or "
        "shard_map over every axis of the mesh.")


def names(axis_name: AxisName) -> tuple[str, ...]:
  """``axis_name`` as a tuple of names (None: none)."""
  if axis_name is None:
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def per_device(tree: Any, like: Any) -> Any:
  """Each leaf of ``tree`` typed as varying over every manual axis some
  leaf of ``like`` varies over (``shard_map``'s types; under ``pmap`` they
  name none, and nothing changes).

  Under ``shard_map`` a derivative with respect to an input that does not
  vary over an axis is summed over it (the transpose of its implicit
  broadcast). K-FAC differentiates with respect to its zero perturbations
  of the layers' outputs, the fallback's params (capture) and the params
  (`Curvature.exact_product`): typed as varying like the batch, their
  derivatives stay each device's own, as `mean` expects.
  """
  varying = set()
  for leaf in jax.tree.leaves(like):
    varying |= _varying(leaf)

  def vary(leaf):
    missing = tuple(sorted(varying - _varying(leaf)))
    return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf
  return jax.tree.map(vary, tree)


def _varying(leaf: Any) -> frozenset:
  return jax.typeof(leaf).manual_axis_type.varying


def mean(tree: Any, over: tuple[str, ...]) -> Any:
  """Each leaf of ``tree`` averaged over the axes ``over`` (a batch mean
  on each replica becomes the whole batch's mean)."""
  if not over:
    return tree
  return jax.tree.map(lambda leaf: jax.lax.pmean(leaf, over), tree)
