"""The linen front-end: the model run under a method interceptor.

The user's ``apply_fn`` runs under `flax.linen.intercept_methods`; the
interceptor gives every call of a captured layer (`registry.kind_of`) the
entries of `capture`'s collections, sown and perturbed in the layer's own
scope.

A layer run with its own ``.apply`` inside the model (Hugging Face's tied LM
head: ``self.lm_head.apply({"params": {"kernel": wte.T}}, h)``) is a fresh
flax root whose collections are discarded. Its entries go to the calling
module's scope instead, under the layer's name (path ``caller/lm_head``), as
if it were an ordinary submodule call; its params are not leaves of the
model's params tree (see `curvature.plan`).
"""

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from kfac_optax._src.models import capture
from kfac_optax._src.models import registry

Path = capture.Path


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
    if module.path or module.is_mutable_collection(capture.INPUTS):
      return module
    caller = next((c for c in reversed(self.callers[:-1])
                   if c.scope is not None
                   and c.is_mutable_collection(capture.INPUTS)), None)
    if caller is None:
      return module
    name = module.name or type(module).__name__
    return _Sink(parent=caller.scope.push(name, reuse=True))

  def _intercept(self, next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    run_instead = registry.stand_in(module)
    # Its layers are hooked in turn.
    if run_instead is not None and method == capture.CALL:
      return run_instead(module, *args, **kwargs)
    kind = registry.kind_of(module)
    if self.busy or kind is None or method not in (capture.CALL, *kind.extra_methods):
      return next_fun(*args, **kwargs)
    # A subclass's own __call__ is its code; the registered class's call
    # inside it (super().__call__) is the layer.
    if (method == capture.CALL and registry.overrides_call(type(module))
        and not any(caller is module for caller in self.callers[:-1])):
      return next_fun(*args, **kwargs)
    owner = self._owner(module)
    config = (registry.configured(kind, module, args, kwargs)
              if method == capture.CALL else module)
    if config is None:
      if self.layouts is not None:
        self._record(tuple(owner.path), capture.uncaptured(kind, args, kwargs))
      return next_fun(*args, **kwargs)
    previous_calls = owner.get_variable(capture.INPUTS, capture.input_name(method), ())
    output = next_fun(*args, **kwargs)
    captured = capture.call_input(self, kind, module, method, args, kwargs, output)
    owner.sow(capture.INPUTS, capture.input_name(method), captured)
    if self.layouts is not None and method == capture.CALL:
      self._record(tuple(owner.path), kind.layout(config, captured, output))
      self.output_shapes[tuple(owner.path)] = jnp.shape(output)
      self.param_shapes[tuple(owner.path)] = {
          name: jnp.shape(value)
          for name, value in module.variables.get("params", {}).items()}
    name = capture.output_name(method, len(previous_calls))
    if not capture.marking():
      return owner.perturb(name, output, collection=capture.PERTURBATIONS)
    # flax's perturb adds inside itself: take the variable alone, add marked.
    perturbation = owner.perturb(name, jnp.zeros_like(output),
                                 collection=capture.PERTURBATIONS)
    return capture.perturbed(output, perturbation, tuple(owner.path))

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
    capture.record_layout(self.layouts, path, layout)


def hooked_apply(
    apply_fn: Callable[..., Any],
    args: Sequence[Any],
    apply_kwargs: dict[str, Any],
    mutable: bool | Sequence[str] | nn.DenyList,
    interceptor: Callable[..., Any] | None = None,
) -> Callable[[Any], tuple[Any, Any]]:
  """``variables -> (outputs, collections)``: the model run under the hooks."""
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
) -> capture.Discovered:
  """Finds the captured layers by tracing the model abstractly (no FLOPs).

  Args:
    apply_fn: a linen apply function.
    variables: the variables to run with (params and other collections).
    args: positional inputs.
    apply_kwargs: keyword arguments of ``apply_fn``.
    mutable: collections the model may write besides K-FAC's own, or a flax
      collection filter (``True``, ``DenyList("params")``) that lets missing
      ones (e.g. batch_stats) be created.
  """
  found, shapes, param_shapes = {}, {}, {}
  if isinstance(mutable, (list, tuple)):
    mutable = [*mutable, capture.INPUTS, capture.PERTURBATIONS]
  interceptor = _Interceptor(found, shapes, param_shapes)
  # The inputs go through eval_shape as arguments: they may be ShapeDtypeStructs.
  outputs, collections = jax.eval_shape(
      lambda v, a: hooked_apply(apply_fn, a, apply_kwargs, mutable, interceptor)(v),
      variables, tuple(args))
  inputs = capture.by_method(collections.get(capture.INPUTS, {}))
  other_methods = {}
  for method, by_path in inputs.items():
    for path in by_path if method != capture.CALL else ():
      other_methods[path] = (*other_methods.get(path, ()), method)
  return capture.Discovered(
      layouts=found,
      num_calls={path: len(calls)
                 for path, calls in inputs.get(capture.CALL, {}).items()},
      other_methods=other_methods,
      output_shapes=shapes,
      param_shapes=param_shapes,
      perturbations=collections.get(capture.PERTURBATIONS, {}),
      outputs=outputs)
