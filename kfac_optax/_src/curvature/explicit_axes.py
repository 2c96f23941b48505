"""K-FAC's update under Explicit mesh axes: its own math on Auto axes, the
model on the user's.

Under Explicit mesh axes (``jax.make_mesh``'s default) every contraction
over a sharded axis must name its output's sharding; K-FAC's statistics
contract the batch axis, its products the params' axes. So its update runs
with those axes made Auto (`update_with_auto_axes`): XLA propagates the
shardings and all-reduces the statistics as under Auto axes, and the
updates and the state keep their shardings.

The model itself runs as in the user's step (`in_model_axes`): with the
axes Explicit again and its params, batch and other collections typed by
the shardings they came with, so a model that names shardings itself
(``out_sharding=``, ``jax.sharding.reshard``) runs in K-FAC's passes too.
"""

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from kfac_optax._src import linalg
from kfac_optax._src import param_boxes
from kfac_optax._src import tree_paths


class ModelAxes(NamedTuple):
  """The user's Explicit axes, made Auto for K-FAC's update, and the
  PartitionSpecs the model's arguments had under them."""
  mesh: jax.sharding.AbstractMesh
  axes: tuple[str, ...]
  params: Any
  batch: Any
  variables: Any


_MODEL_AXES: contextvars.ContextVar[ModelAxes | None] = contextvars.ContextVar(
    "kfac_optax_model_axes", default=None)


# Under Auto axes: the mesh, its axes typed Explicit, and the params' specs
# their partitioning boxes declare (`param_boxes.specs`).
_DECLARED: contextvars.ContextVar[tuple[jax.sharding.AbstractMesh, Any] | None] = (
    contextvars.ContextVar("kfac_optax_declared_params", default=None))


def _has_explicit_axes(mesh: Any) -> bool:
  return jax.sharding.AxisType.Explicit in mesh.axis_types


def _explicit_mesh(trees: Any) -> jax.sharding.AbstractMesh | None:
  """The mesh whose Explicit axes (``jax.make_mesh``'s default) type the
  step: the context mesh (``jax.set_mesh``), else that of an argument's
  sharding (arrays placed on such a mesh outside any context); None if none."""
  meshes = [jax.sharding.get_abstract_mesh()] + [
      jax.typeof(leaf).sharding.mesh for leaf in jax.tree.leaves(trees)
      if isinstance(leaf, jax.Array)]
  return next((mesh for mesh in meshes
               if not mesh.empty and _has_explicit_axes(mesh)), None)


def _array_settings(settings: dict[str, Any]) -> dict[str, Any]:
  """The settings given as arrays (or trees of them, e.g. a jax.Array
  ``example_batch``): `optax.inject_hyperparams` passes its values so."""
  found = {}
  for name, value in settings.items():
    leaves = jax.tree.leaves(value) if name not in ("apply_fn", "loss", "mesh") else []
    if leaves and all(isinstance(leaf, jax.Array) for leaf in leaves):
      found[name] = value
  return found


def _specs(tree: Any) -> Any:
  """Each array's PartitionSpec (P() for one that has none, e.g. numpy)."""
  def spec(leaf):
    sharding = getattr(jax.typeof(leaf), "sharding", None) if isinstance(
        leaf, jax.Array) else getattr(leaf, "sharding", None)
    return getattr(sharding, "spec", P())
  return jax.tree.map(spec, tree)


def _names_axes_of(spec: Any, mesh: jax.sharding.AbstractMesh) -> bool:
  """Whether ``spec`` is a PartitionSpec over ``mesh``'s axes."""
  if not isinstance(spec, P):
    return False
  names = [a for entry in spec if entry is not None
           for a in (entry if isinstance(entry, tuple) else (entry,))]
  return set(names) <= set(mesh.axis_names)


def update_with_auto_axes(make: Callable[..., Any], settings: dict[str, Any],
                          direct: Callable[..., Any], grads: Any, state: Any,
                          params: Any, batch: Any, variables: dict, rng: Any,
                          declared: Any = None):
  """``direct(grads, state, params, batch, variables, rng)``, K-FAC's update,
  with any Explicit mesh axes made Auto.

  With Explicit axes the transformation is rebuilt there,
  ``make(**settings)``, with the settings given as arrays as arguments, so
  they are made Auto too (closed over, an array typed by Explicit axes could
  not meet the Auto ones); inside, no axis is Explicit and its update runs
  ``direct``, its model passes under the axes and shardings of the
  arguments here (`in_model_axes`). Under Auto axes the params' specs that
  their partitioning metadata declares (``declared``, `param_boxes.specs`,
  None where unknown) stand in for the types in `params_typed_spec`.
  """
  mesh = _explicit_mesh((grads, state, params, batch, variables, rng))
  if mesh is None:
    with declared_specs(declared):
      return direct(grads, state, params, batch, variables, rng)
  explicit = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                   if kind == jax.sharding.AxisType.Explicit)
  model_axes = ModelAxes(mesh, explicit, _specs(params), _specs(batch),
                         _specs(variables))

  def update(grads, state, params, batch, variables, rng, arrays):
    return make(**{**settings, **arrays}).update(
        grads, state, params, batch=batch, variables=variables, rng=rng)
  out_sharding = _specs((grads, state))
  with jax.sharding.use_abstract_mesh(mesh), _model_axes(model_axes), linalg.rows_typed():
    return jax.sharding.auto_axes(update, axes=explicit, out_sharding=out_sharding)(
        grads, state, params, batch, variables, rng, _array_settings(settings))


@contextlib.contextmanager
def _model_axes(found: ModelAxes) -> Iterator[None]:
  token = _MODEL_AXES.set(found)
  try:
    yield
  finally:
    _MODEL_AXES.reset(token)


def _fitting(spec: P, shape: tuple[int, ...], mesh: jax.sharding.AbstractMesh) -> P:
  """``spec`` without the axes that do not divide their dimension (e.g. a
  batch sliced to ``curvature_batch_size``)."""
  def fits(names, size):
    names = names if isinstance(names, tuple) else (names,)
    return size % math.prod(mesh.shape[name] for name in names) == 0
  return P(*(names if names is None or fits(names, size) else None
             for names, size in zip(spec, shape)))


def in_model_axes(fn: Callable[..., Any], params: Any, batch: Any,
                  variables: Any, keys: Any, typed: dict | None = None) -> Any:
  """``fn(params, batch, variables, keys)``: a pass of the model, under the
  user's Explicit axes where `update_with_auto_axes` made them Auto.

  There params and variables get the shardings they came with; a batch of
  the update batch's structure gets that batch's (another, e.g.
  ``example_batch``, those its arrays have, else replicated); keys are
  replicated, and ``typed["specs"]`` (if given) is set to the
  PartitionSpecs the axes gave the result (how the activations K-FAC
  captured lie on the mesh). Elsewhere ``fn`` runs as it is.
  """
  found = _MODEL_AXES.get()
  if found is None:
    return fn(params, batch, variables, keys)
  same = jax.tree.structure(batch) == jax.tree.structure(found.batch)
  specs = (found.params, found.batch if same else _specs(batch), found.variables)
  shaped = jax.tree.map(
      lambda spec, leaf: _fitting(spec, jax.numpy.shape(leaf), found.mesh),
      specs, (params, batch, variables), is_leaf=lambda x: isinstance(x, P))
  in_sharding = (*shaped, jax.tree.map(lambda _: P(), keys))

  def recorded(*args):
    result = fn(*args)
    if typed is not None:
      typed["specs"] = _specs(result)
    return result
  return jax.sharding.explicit_axes(recorded, axes=found.axes, in_sharding=in_sharding)(
      params, batch, variables, keys)


def typed_spec(fn: Callable[[Any], jax.Array], arg: Any, specs: Any,
               mesh: jax.sharding.AbstractMesh | None = None) -> P | None:
  """The PartitionSpec the user's Explicit axes (or ``mesh``'s) give
  ``fn(arg)``, each array of ``arg`` typed by its PartitionSpec in ``specs``
  (a tree like ``arg``); None outside Explicit axes, or where the types name
  no sharding (jax's ShardingTypeError)."""
  if mesh is None:
    found = _MODEL_AXES.get()
    if found is None:
      return None
    mesh = found.mesh
  typed = jax.tree.map(
      lambda spec, leaf: jax.ShapeDtypeStruct(
          leaf.shape, leaf.dtype, sharding=jax.sharding.NamedSharding(
              mesh, _fitting(spec, leaf.shape, mesh))),
      specs, arg, is_leaf=lambda x: isinstance(x, P))
  try:
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.eval_shape(fn, typed).sharding.spec
  except Exception as error:  # pylint: disable=broad-exception-caught
    if type(error).__name__ == "ShardingTypeError":  # jax's, not public
      return None
    raise


def params_typed_spec(fn: Callable[[dict], jax.Array],
                      leaves: dict[tuple[str, ...], jax.Array]) -> P | None:
  """`typed_spec` of ``fn(leaves)``, each of ``leaves`` (params-shaped, by
  leaf path) typed as the param at its path was when `update_with_auto_axes`
  made the axes Auto, or, under Auto axes, as its box declared it.

  How a gradient matrix ``[∇W; ∇b]`` lies on the mesh, so that it can be
  moved to its owner by hand (`linalg.owner_routing`). None where no types
  or boxes name the params' shardings, or where the types name no sharding
  (a bias row joined to a kernel whose rows are split).
  """
  found, declared = _MODEL_AXES.get(), _DECLARED.get()
  if found is not None:
    mesh, params = found.mesh, found.params
  elif declared is not None:
    mesh, params = declared
  else:
    return None
  specs, _ = tree_paths.flatten(params, is_leaf=lambda x: isinstance(x, P))
  if not all(isinstance(specs.get(path), P) for path in leaves):
    return None
  return typed_spec(fn, leaves, {path: specs[path] for path in leaves}, mesh)


@contextlib.contextmanager
def declared_specs(declared: Any) -> Iterator[None]:
  """Under Auto axes of the context mesh, the params' specs their boxes
  declare (``declared``, `param_boxes.specs`) stand in for types in
  `params_typed_spec`; nothing where they name none of its axes."""
  context = jax.sharding.get_abstract_mesh()
  declared = None if context.empty else jax.tree.map(
      lambda spec: spec if _names_axes_of(spec, context) else None, declared,
      is_leaf=lambda x: isinstance(x, P))
  if not param_boxes.declares_any(declared):
    yield
    return
  typed = context.update_axis_types(
      {name: jax.sharding.AxisType.Explicit for name in context.axis_names})
  token = _DECLARED.set((typed, declared))
  try:
    yield
  finally:
    _DECLARED.reset(token)


@contextlib.contextmanager
def params_specs(params: Any, declared: Any) -> Iterator[None]:
  """Outside an update (``init``), the params' specs for
  `params_typed_spec`: their types under Explicit axes, else the specs
  their boxes declare (`declared_specs`)."""
  mesh = _explicit_mesh(params)
  if mesh is None:
    with declared_specs(declared):
      yield
    return
  token = _DECLARED.set((mesh, _specs(params)))
  try:
    yield
  finally:
    _DECLARED.reset(token)


def params_mesh(params: Any) -> contextlib.AbstractContextManager:
  """The mesh of params placed with Explicit axes, made the context for a
  pass of the model outside any (``init`` or ``describe`` after the ``with
  jax.set_mesh`` block): a model whose layers name shardings
  (``out_sharding=``) is typed only under its mesh."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  # Placed arrays name their concrete mesh, which eager work needs (a key
  # made outside a trace); traced ones only its abstract one.
  placed = [leaf.sharding.mesh for leaf in jax.tree.leaves(params)
            if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
            and isinstance(leaf.sharding, jax.sharding.NamedSharding)
            and _has_explicit_axes(leaf.sharding.mesh)]
  if placed:
    return jax.set_mesh(placed[0])
  mesh = _explicit_mesh(params)
  return contextlib.nullcontext() if mesh is None else (
      jax.sharding.use_abstract_mesh(mesh))
