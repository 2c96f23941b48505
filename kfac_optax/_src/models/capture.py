"""The front-end contract: K-FAC's collections, what discovery finds, the vjp.

A model front-end (`linen_capture`, `nnx_capture`) runs the user's model so
that each call of a captured layer (`registry`)

- records its input in the collection ``kfac_inputs`` (one tuple entry per
  call, so shared modules keep every call), and
- adds a zero perturbation from the collection ``kfac_perturbations`` to its
  output (one variable per call), so that the gradient with respect to the
  perturbation is the gradient with respect to the layer output.

A layer kind may name other methods to capture the same way (``nn.Embed``'s
``attend``, the output projection of tied embeddings); their entries carry
the method name (``kfac_in_attend``, ``kfac_attend_out_0``).

While `marking_calls` is on (the reach walk's trace), the perturbation is
added by a call named after the layer (`perturbed`), so that a walk of the
jaxpr can tell the layer's output from any other use of its params.

Both travel as flax collections (for NNX, Variables of the layers), never
Python lists, so they follow the module through lifted transforms the way
any other variable does. Everything after capture is shared: `Discovered`
(what one abstract trace finds), `capture` (one forward pass and one vjp),
`Captured` (its result). This module knows nothing about curvature blocks
or inverses.
"""

import contextlib
import contextvars
import functools
import re
from typing import Any, Callable, Iterator, NamedTuple

import jax
from flax import traverse_util


INPUTS = "kfac_inputs"


PERTURBATIONS = "kfac_perturbations"


CALL = "__call__"


_INPUT_NAME = re.compile(r"kfac_in(?:_(\w+))?$")


_OUTPUT_NAME = re.compile(r"kfac_(?:(\w+)_)?out_(\d+)$")


Path = tuple[str, ...]


def input_name(method: str) -> str:
  """The ``kfac_inputs`` entry of a method's calls (a tuple, one per call)."""
  return "kfac_in" if method == CALL else f"kfac_in_{method}"


def output_name(method: str, call: int) -> str:
  """The ``kfac_perturbations`` variable of one call of a method."""
  return f"kfac_out_{call}" if method == CALL else f"kfac_{method}_out_{call}"


_MARKING = contextvars.ContextVar("kfac_marking_calls", default=False)


@contextlib.contextmanager
def marking_calls() -> Iterator[None]:
  """Within: `perturbed` adds each perturbation in a call `marker_name`
  names (a trace-time mode: the jaxpr then shows where each layer call's
  output leaves it)."""
  token = _MARKING.set(True)
  try:
    yield
  finally:
    _MARKING.reset(token)


def marking() -> bool:
  """Whether `marking_calls` is on."""
  return _MARKING.get()


def marker_name(path: Path) -> str:
  """The name of the marked call that adds the perturbations of ``path``."""
  return f"kfac_perturbed[{'/'.join(map(str, path))}]"


@functools.cache
def _marked_add(name: str) -> Callable[[Any, Any], Any]:
  def add(output, perturbation):
    return output + perturbation
  add.__name__ = name
  return jax.jit(add)


def perturbed(output: Any, perturbation: Any, path: Path) -> Any:
  """``output + perturbation`` for a call of the layer at ``path``; while
  `marking_calls`, in a call named `marker_name` ``(path)``."""
  if not marking():
    return output + perturbation
  return _marked_add(marker_name(path))(output, perturbation)


class Uncaptured(NamedTuple):
  """The layout recorded for a layer call that its kind cannot express (see
  `registry.configured`): the call runs unhooked and the layer's params get
  the diagonal fallback. ``settings``: the call's configuration."""
  settings: tuple[tuple[str, Any], ...]


def uncaptured(kind: Any, args: tuple, kwargs: dict) -> Uncaptured:
  return Uncaptured(tuple(sorted(kind.call_settings(args, kwargs).items())))


class ModelError(ValueError):
  """A model or params that a front-end's own check rejects (an NNX model's
  params that do not fit it, randomness it cannot get); its message names
  the cause and the fix."""


def call_input(hooks: Any, kind: Any, module: Any, method: str, args: tuple,
               kwargs: dict, output: Any) -> Any:
  """The input a captured call records, for linen's and NNX's hooks alike.

  ``__call__`` records its kind's ``captured_input``, computed with
  ``hooks.busy`` set so that the module calls it makes itself are not
  captured as calls of their own; other methods (``attend``) record their
  first argument.
  """
  if method != CALL:
    return args[0] if args else next(iter(kwargs.values()))
  hooks.busy = True
  try:
    return kind.captured_input(module, args, kwargs, output)
  finally:
    hooks.busy = False


def record_layout(found: dict[Path, Any], path: Path, layout: Any) -> None:
  """Keeps a layer call's layout; every call of one module must share it."""
  if found.setdefault(path, layout) != layout:
    raise ValueError(
        f"the layer at {'/'.join(path)!r} is called with inputs that need "
        f"different curvature layouts ({found[path]} and {layout}); K-FAC "
        "keeps one block per module")


class Discovered(NamedTuple):
  """What one abstract trace of the model finds.

  Attributes:
    layouts: module path -> layout (see `layouts`), for every layer call the
      interceptor saw (`Uncaptured` for calls it ran unhooked).
    num_calls: module path -> how many calls reached the collections. A path
      in ``layouts`` but not here ran inside a lifted transform (nn.scan,
      nn.vmap, ...) that did not carry K-FAC's collections.
    other_methods: module path -> the names of its other captured methods
      that were called (e.g. ``("attend",)`` for a tied embedding).
    output_shapes: module path -> output shape as the layer itself saw it;
      the collections' arrays have extra leading axes where a lifted
      transform stacked them (e.g. the layer axis of nn.scan).
    param_shapes: module path -> {param name: shape as the layer itself saw
      it}; the params tree has extra leading axes only for the transforms
      that stacked the params too (nn.scan over layers, not over time).
    perturbations: abstract (ShapeDtypeStruct) ``kfac_perturbations``
      collection, to be filled with zeros for `capture`.
    outputs: the model's abstract return value.
  """
  layouts: dict[Path, Any]
  num_calls: dict[Path, int]
  other_methods: dict[Path, tuple[str, ...]]
  output_shapes: dict[Path, tuple[int, ...]]
  param_shapes: dict[Path, dict[str, tuple[int, ...]]]
  perturbations: Any
  outputs: Any


def by_method(collection: Any) -> dict[str, dict[Path, tuple[Any, ...]]]:
  """A ``kfac_inputs`` or ``kfac_perturbations`` tree -> {method: {path: calls}}."""
  grouped: dict[str, dict[Path, dict[int, Any]]] = {}
  for key, value in traverse_util.flatten_dict(collection).items():
    path, name = key[:-1], key[-1]
    if match := _INPUT_NAME.match(name):
      calls = dict(enumerate(value))
    else:
      match = _OUTPUT_NAME.match(name)
      calls = {int(match.group(2)): value}
    by_path = grouped.setdefault(match.group(1) or CALL, {})
    by_path.setdefault(path, {}).update(calls)
  return {method: {path: tuple(calls[i] for i in sorted(calls))
                   for path, calls in by_path.items()}
          for method, by_path in grouped.items()}


def by_layer(collection: Any, method: str = CALL) -> dict[Path, tuple[Any, ...]]:
  """A ``kfac_inputs`` or ``kfac_perturbations`` tree -> {path: per-call tuple}."""
  return by_method(collection).get(method, {})


class Captured(NamedTuple):
  """Result of one capture pass.

  Attributes:
    outputs: the model output.
    inputs: module path -> per-call layer inputs.
    output_grads: module path -> per-call output gradients, each with a
      leading axis of size K (one per cotangent).
    primal_grads: gradients of the extra primals, leading axis K.
    other_methods: method name -> (inputs, output_grads) of the calls of
      that method (e.g. ``"attend"``), laid out like the fields above.
  """
  outputs: Any
  inputs: dict[Path, tuple[jax.Array, ...]]
  output_grads: dict[Path, tuple[jax.Array, ...]]
  primal_grads: Any
  other_methods: dict[str, tuple[dict, dict]]


def abstract_output(output: jax.Array, stack: tuple[int, ...] = ()) -> jax.ShapeDtypeStruct:
  """A layer output's perturbation, abstract: its shape and dtype behind the
  ``stack`` axes a lifted transform adds, and the sharding Explicit mesh
  axes give the output (see `zeros`)."""
  sharding = getattr(jax.typeof(output), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    sharding = None
  else:
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*[None] * len(stack), *sharding.spec))
  return jax.ShapeDtypeStruct(stack + jax.numpy.shape(output),
                              jax.numpy.result_type(output), sharding=sharding)


def zeros(perturbations: Any) -> Any:
  """The zero ``kfac_perturbations`` for their abstract shapes: each with
  its layer output's sharding where Explicit mesh axes typed it, so that the
  output gradients keep that sharding too."""
  def zero(shape):
    spec = getattr(shape.sharding, "spec", None)
    explicit = spec is not None and jax.sharding.AxisType.Explicit in (
        jax.sharding.get_abstract_mesh().axis_types)
    return jax.numpy.zeros(shape.shape, shape.dtype,
                           out_sharding=spec if explicit else None)
  return jax.tree.map(zero, perturbations)


def capture(
    model: Callable[[Any, Any], tuple[Any, Any]],
    primals: Any,
    perturbations: Any,
    cotangents_fn: Callable[[Any], jax.Array],
) -> Captured:
  """One forward pass and one (vmapped) vjp through the hooked model.

  Args:
    model: ``(primals, perturbations) -> (outputs, kfac_inputs collection)``.
    primals: extra differentiable inputs (parameters whose gradients the
      caller wants per cotangent, e.g. those of the diagonal fallback).
    perturbations: the zero ``kfac_perturbations`` collection.
    cotangents_fn: ``outputs -> (K, *outputs.shape)`` output cotangents
      (for outputs of several arrays, one such per array).

  Returns:
    The captured inputs and gradients, see `Captured`.
  """
  outputs, vjp_fn, inputs = jax.vjp(model, primals, perturbations, has_aux=True)
  cotangents = cotangents_fn(outputs)
  if len(jax.tree.leaves(cotangents)[0]) == 1:
    # Unbatched, the backward pass computes what the user's own backward does
    # in the same shapes (e.g. max-pooling's argmax), so XLA can share it.
    primal_grads, perturbation_grads = jax.tree.map(
        lambda g: g[None], vjp_fn(jax.tree.map(lambda c: c[0], cotangents)))
  else:
    primal_grads, perturbation_grads = jax.vmap(vjp_fn)(cotangents)
  inputs, grads = by_method(inputs), by_method(perturbation_grads)
  return Captured(outputs, inputs.get(CALL, {}), grads.get(CALL, {}), primal_grads,
                  {m: (inputs[m], grads[m]) for m in inputs if m != CALL})


def not_threaded_error(paths: list[Path]) -> ValueError:
  """The error for the layers whose calls never reached K-FAC's collections
  (all of them, so that one fix covers every transform)."""
  names = [repr("/".join(path)) for path in paths]
  found = dict.fromkeys("/".join((*path[:-1], "*")) if len(path) > 1
                        else "/".join(path) for path in paths)
  # fnmatch's "*" spans "/": "a/*" already covers "a/b/*".
  patterns = {p: "diagonal" for p in found
              if not any(q != p and q.endswith("*") and p.startswith(q[:-1])
                         for q in found)}
  shown = (f"the layer at {names[0]} runs" if len(names) == 1 else
           f"the layers at {', '.join(names[:4])}"
           f"{f' and {len(names) - 4} more' if len(names) > 4 else ''} run")
  return ValueError(
      f"{shown} inside a flax lifted transform (nn.scan, "
      "nn.vmap, ...) that does not carry K-FAC's collections, so their inputs "
      "and output gradients cannot be captured. "
      f"Add {{{INPUTS!r}: 0, {PERTURBATIONS!r}: 0}} to the transform's "
      "variable_axes and keep its params as they are: for a stack of layers "
      f"nn.scan(..., variable_axes={{'params': 0, {INPUTS!r}: 0, "
      f"{PERTURBATIONS!r}: 0}}), for weights shared over a scan's steps "
      f"nn.scan(..., variable_broadcast='params', variable_axes={{{INPUTS!r}: 0, "
      f"{PERTURBATIONS!r}: 0}}) (nn.RNN(cell, variable_axes=...) likewise); or "
      f"give the layers under it the diagonal block, e.g. layer_overrides="
      f"{patterns!r} (patterns that match every one of them).")
