"""K-FAC's update under Explicit mesh axes: run with those axes made Auto.

Under Explicit mesh axes (``jax.make_mesh``'s default) every reshape, scan or
contraction over the batch-sharded axis, in the model's own layers too,
would need its output sharding named. K-FAC's pass runs with those axes made
Auto instead (`update_with_auto_axes`), so XLA propagates shardings and
all-reduces the statistics as under Auto axes; the updates and the state
keep their shardings.
"""

from typing import Any, Callable

import jax


def _explicit_mesh(trees: Any) -> jax.sharding.AbstractMesh | None:
  """The mesh whose Explicit axes (``jax.make_mesh``'s default) type the
  step: the context mesh (``jax.set_mesh``), else that of an argument's
  sharding (arrays placed on such a mesh outside any context); None if none."""
  meshes = [jax.sharding.get_abstract_mesh()] + [
      jax.typeof(leaf).sharding.mesh for leaf in jax.tree.leaves(trees)
      if isinstance(leaf, jax.Array)]
  return next((mesh for mesh in meshes if not mesh.empty and any(
      kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types)), None)


def _array_settings(settings: dict[str, Any]) -> dict[str, Any]:
  """The settings given as arrays (or trees of them, e.g. a jax.Array
  ``example_batch``): `optax.inject_hyperparams` passes its values so."""
  found = {}
  for name, value in settings.items():
    leaves = jax.tree.leaves(value) if name not in ("apply_fn", "loss", "mesh") else []
    if leaves and all(isinstance(leaf, jax.Array) for leaf in leaves):
      found[name] = value
  return found


def update_with_auto_axes(make: Callable[..., Any], settings: dict[str, Any],
                          direct: Callable[..., Any], grads: Any, state: Any,
                          params: Any, batch: Any, variables: dict, rng: Any):
  """``direct(grads, state, params, batch, variables, rng)``, K-FAC's update,
  with any Explicit mesh axes made Auto.

  With Explicit axes the transformation is rebuilt there,
  ``make(**settings)``, with the settings given as arrays as arguments, so
  they are made Auto too (closed over, an array typed by Explicit axes could
  not meet the Auto ones); inside, no axis is Explicit and its update runs
  ``direct``.
  """
  mesh = _explicit_mesh((grads, state, params, batch, variables, rng))
  if mesh is None:
    return direct(grads, state, params, batch, variables, rng)
  explicit = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                   if kind == jax.sharding.AxisType.Explicit)

  def update(grads, state, params, batch, variables, rng, arrays):
    return make(**{**settings, **arrays}).update(
        grads, state, params, batch=batch, variables=variables, rng=rng)
  out_sharding = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, (grads, state))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.sharding.auto_axes(update, axes=explicit, out_sharding=out_sharding)(
        grads, state, params, batch, variables, rng, _array_settings(settings))
