"""The capture pass: layer inputs and output gradients from one forward/vjp.

The user's model runs under a `flax.linen.intercept_methods` interceptor. Each
call of a captured layer (see `layers.py`)

- sows its input into the flax collection ``kfac_inputs`` (one tuple entry per
  call, so shared modules keep every call), and
- adds a zero perturbation from the collection ``kfac_perturbations`` to its
  output (one variable per call), so that the gradient with respect to the
  perturbation is the gradient with respect to the layer output.

A layer kind may name other methods to capture the same way (``nn.Embed``'s
``attend``, the output projection of tied embeddings); their entries carry the
method name (``kfac_in_attend``, ``kfac_attend_out_0``).

Both travel as flax collections, never Python lists, so they follow the
module through lifted transforms the way any other variable does.

A layer run with its own ``.apply`` inside the model (Hugging Face's tied LM
head: ``self.lm_head.apply({"params": {"kernel": wte.T}}, h)``) is a fresh
flax root whose collections are discarded. Its entries go to the calling
module's scope instead, under the layer's name (path ``caller/lm_head``), as
if it were an ordinary submodule call; its params are not leaves of the
model's params tree (see `curvature`). This module knows nothing about
curvature blocks or inverses.
"""

import re
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from kfac_optax import layers

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


class Uncaptured(NamedTuple):
  """The layout recorded for a layer call that its kind cannot express (see
  `layers.configured`): the call runs unhooked and the layer's params get
  the diagonal fallback. ``settings``: the call's configuration."""
  settings: tuple[tuple[str, Any], ...]


def uncaptured(kind: Any, args: tuple, kwargs: dict) -> Uncaptured:
  return Uncaptured(tuple(sorted(kind.call_settings(args, kwargs).items())))


class ModelError(ValueError):
  """A model or params that a front-end's own check rejects (an NNX model's
  params that do not fit it, randomness it cannot get); its message names
  the cause and the fix."""


class _Sink(nn.Module):
  """Holds a detached layer's entries in its caller's scope."""


class _Interceptor:
  """Hooks every captured layer call; optionally records layouts by path."""

  def __init__(self, found_layouts: dict[Path, Any] | None = None,
               output_shapes: dict[Path, tuple[int, ...]] | None = None,
               param_shapes: dict[Path, dict[str, tuple[int, ...]]] | None = None):
    self.layouts = found_layouts
    self.output_shapes = output_shapes
    self.param_shapes = param_shapes
    self.busy = False  # a kind's own helper calls are not layer calls
    self.callers: list[nn.Module] = []  # modules whose methods are running

  def __call__(self, next_fun, args, kwargs, context):
    self.callers.append(context.module)
    try:
      return self._intercept(next_fun, args, kwargs, context)
    finally:
      self.callers.pop()

  def _owner(self, module: nn.Module) -> nn.Module:
    """Where a layer's entries go: itself, or for a layer run with its own
    ``.apply`` inside the model (a root scope without K-FAC's collections),
    a stand-in named like it in the scope of the module that called it."""
    if module.path or module.is_mutable_collection(INPUTS):
      return module
    caller = next((c for c in reversed(self.callers[:-1])
                   if c.scope is not None and c.is_mutable_collection(INPUTS)), None)
    if caller is None:
      return module
    name = module.name or type(module).__name__
    return _Sink(parent=caller.scope.push(name, reuse=True))

  def _intercept(self, next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    run_instead = layers.stand_in(module)
    if run_instead is not None and method == CALL:  # its layers are hooked in turn
      return run_instead(module, *args, **kwargs)
    kind = layers.kind_of(module)
    if self.busy or kind is None or method not in (CALL, *kind.extra_methods):
      return next_fun(*args, **kwargs)
    owner = self._owner(module)
    config = layers.configured(kind, module, args, kwargs) if method == CALL else module
    if config is None:
      if self.layouts is not None:
        self._record(tuple(owner.path), uncaptured(kind, args, kwargs))
      return next_fun(*args, **kwargs)
    previous_calls = owner.get_variable(INPUTS, input_name(method), ())
    output = next_fun(*args, **kwargs)
    captured = call_input(self, kind, module, method, args, kwargs, output)
    owner.sow(INPUTS, input_name(method), captured)
    if self.layouts is not None and method == CALL:
      self._record(tuple(owner.path), kind.layout(config, captured, output))
      self.output_shapes[tuple(owner.path)] = jnp.shape(output)
      self.param_shapes[tuple(owner.path)] = {
          name: jnp.shape(value)
          for name, value in module.variables.get("params", {}).items()}
    return owner.perturb(output_name(method, len(previous_calls)), output,
                         collection=PERTURBATIONS)

  def _record(self, path: Path, layout: Any) -> None:
    if not path and self.layouts.get(path, layout) != layout:
      # fresh .apply roots all share the path ''
      raise ValueError(
          "layer calls at the top-level path '' need different curvature "
          f"layouts ({self.layouts[path]} and {layout}): more than one module "
          "runs with its own .apply (e.g. apply_fn applies two models, or "
          "applies a model twice), and K-FAC keeps one block per module path."
          "\nFix: make apply_fn one model.apply, with every layer a submodule "
          "of that model.")
    record_layout(self.layouts, path, layout)


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


def hooked_apply(
    apply_fn: Callable[..., Any],
    args: Sequence[Any],
    apply_kwargs: dict[str, Any],
    mutable: bool | Sequence[str] | nn.DenyList,
    interceptor: Callable[..., Any] | None = None,
) -> Callable[[Any], tuple[Any, Any]]:
  """``variables -> (outputs, collections)``: the model run under the hooks.

  An ``apply_fn`` with its own capture (an NNX model's, see `nnx_capture`)
  runs its own hooks; a linen apply function runs under the interceptor.
  """
  if hasattr(apply_fn, "hooked"):
    return apply_fn.hooked(args, apply_kwargs)
  interceptor = interceptor or _Interceptor()
  mutable = list(mutable) if isinstance(mutable, (list, tuple)) else mutable

  def run(variables):
    with nn.intercept_methods(interceptor):
      return apply_fn(variables, *args, mutable=mutable, **apply_kwargs)
  return run


def discover(
    apply_fn: Callable[..., Any],
    variables: Any,
    args: Sequence[Any],
    apply_kwargs: dict[str, Any],
    mutable: bool | Sequence[str] | nn.DenyList = (),
) -> Discovered:
  """Finds the captured layers by tracing the model abstractly (no FLOPs).

  Args:
    apply_fn: flax apply function (or one with its own capture, see
      `hooked_apply`).
    variables: the variables to run with (params and other collections).
    args: positional inputs.
    apply_kwargs: keyword arguments of ``apply_fn``.
    mutable: collections the model may write besides K-FAC's own, or a flax
      collection filter (``True``, ``DenyList("params")``) that lets missing
      ones (e.g. batch_stats) be created.
  """
  if hasattr(apply_fn, "discover"):  # its own capture (see hooked_apply)
    return apply_fn.discover(variables, args, apply_kwargs)
  found, shapes, param_shapes = {}, {}, {}
  if isinstance(mutable, (list, tuple)):
    mutable = [*mutable, INPUTS, PERTURBATIONS]
  interceptor = _Interceptor(found, shapes, param_shapes)
  # The inputs go through eval_shape as arguments: they may be ShapeDtypeStructs.
  outputs, collections = jax.eval_shape(
      lambda v, a: hooked_apply(apply_fn, a, apply_kwargs, mutable, interceptor)(v),
      variables, tuple(args))
  inputs = by_method(collections.get(INPUTS, {}))
  other_methods = {}
  for method, by_path in inputs.items():
    for path in by_path if method != CALL else ():
      other_methods[path] = (*other_methods.get(path, ()), method)
  return Discovered(
      layouts=found,
      num_calls={path: len(calls) for path, calls in inputs.get(CALL, {}).items()},
      other_methods=other_methods,
      output_shapes=shapes,
      param_shapes=param_shapes,
      perturbations=collections.get(PERTURBATIONS, {}),
      outputs=outputs)


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
    cotangents_fn: ``outputs -> (K, *outputs.shape)`` output cotangents.

  Returns:
    The captured inputs and gradients, see `Captured`.
  """
  outputs, vjp_fn, inputs = jax.vjp(model, primals, perturbations, has_aux=True)
  cotangents = cotangents_fn(outputs)
  if len(cotangents) == 1:
    # Unbatched, the backward pass computes what the user's own backward does
    # in the same shapes (e.g. max-pooling's argmax), so XLA can share it.
    primal_grads, perturbation_grads = jax.tree.map(lambda g: g[None],
                                                    vjp_fn(cotangents[0]))
  else:
    primal_grads, perturbation_grads = jax.vmap(vjp_fn)(cotangents)
  inputs, grads = by_method(inputs), by_method(perturbation_grads)
  return Captured(outputs, inputs.get(CALL, {}), grads.get(CALL, {}), primal_grads,
                  {m: (inputs[m], grads[m]) for m in inputs if m != CALL})


def not_threaded_error(path: Path) -> ValueError:
  """The error for a layer whose calls never reached K-FAC's collections."""
  name = "/".join(path)
  pattern = "/".join((*path[:-1], "*")) if len(path) > 1 else name
  return ValueError(
      f"the layer at {name!r} runs inside a flax lifted transform (nn.scan, "
      "nn.vmap, ...) that does not carry K-FAC's collections, so its inputs "
      "and output gradients cannot be captured. "
      f"Add {{{INPUTS!r}: 0, {PERTURBATIONS!r}: 0}} to that transform's "
      f"variable_axes, e.g. nn.scan(..., variable_axes={{'params': 0, "
      f"{INPUTS!r}: 0, {PERTURBATIONS!r}: 0}}), or give the layers under it "
      f"the diagonal block, e.g. layer_overrides={{{pattern!r}: 'diagonal'}} "
      "(a pattern that matches every one of them).")
