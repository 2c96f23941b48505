"""The NNX front-end: an ``nnx.Module`` run as the apply function K-FAC calls.

`NNXModel` wraps a Flax NNX model in the contract of a linen apply function
(see `capture`): ``apply_fn({"params": params, **other_state,
"kfac_perturbations": ...}, *inputs, mutable=..., rngs={"dropout": key},
**apply_kwargs)``, and produces K-FAC's ``kfac_inputs`` and
``kfac_perturbations`` collections in the tree format of linen's capture, so
that everything after capture (`curvature`, `blocks`, `summary`) is shared.

Every call is pure: a fresh copy of the model is built with ``nnx.merge``
from the graph definition taken when the transformation was made, the params
it is given (pure arrays, the tree ``nnx.state(model, nnx.Param)`` that
``nnx.Optimizer`` passes), the model's other state (BatchNorm statistics:
those given as ``variables=``, else the values the model had when it was
wrapped; K-FAC's changes to them go with the copy) and random streams
re-seeded from ``rngs["dropout"]`` (never the model's own ``nnx.Rngs``
counters). The user's model, its Variables and its classes are never touched.

On that copy, each captured layer (`registry.kind_of`) gets its class swapped
for a cached subclass whose ``__call__`` (and the kind's other methods, e.g.
``nnx.Embed.attend``) records the layer input and adds the zero perturbation
to the output, so that the gradient with respect to the perturbation is the
gradient with respect to the layer output (for a subclass with its own
``__call__``, the registered class's call inside it). The swap is undone on
every exit.
Layers are keyed by their NNX attribute path joined by "/"
(``"blocks/0/attn/query"``); a module reachable at several paths (shared
weights) is one layer at its first path, its calls several calls.

NNX transforms inside the model (``nnx.scan`` applying an ``nnx.vmap``-made
layer stack, ``nnx.remat``) run copies of the layers that K-FAC does not
make. Each captured layer's params carry its path as Variable metadata,
which those copies keep, and a layer whose calls run on such copies gets
Variables for their inputs and perturbations: the transform slices and
stacks them along with the layer's params, so a stack of L layers yields
inputs and perturbations with a leading axis L, the layout of linen's
``nn.scan`` stacks (one block per layer, see `curvature`).
"""

import contextlib
from typing import Any, Callable, Iterator, Sequence

from flax import nnx
from flax import traverse_util
import jax
import jax.numpy as jnp

from kfac_optax._src import param_boxes
from kfac_optax._src.models import capture
from kfac_optax._src.models import kinds
from kfac_optax._src.models import registry

Path = tuple[str, ...]
_OWN_KEYS = ("params", capture.INPUTS, capture.PERTURBATIONS)
_PATH = "kfac_path"  # metadata on a captured layer's params: its path


def _stash_name(kind: str, method: str, call: int) -> str:
  """The attribute of a lifted layer's input or perturbation Variable."""
  return f"kfac_{kind}_{method.strip('_')}_{call}"


class _Recorder:
  """The layer calls of one run of a model copy.

  A layer runs either on K-FAC's copy itself (its ``id`` is in ``paths``),
  or on a copy an NNX transform made of it (``nnx.scan``, ``nnx.vmap`` over
  a layer stack; ``nnx.remat``), recognised by the path K-FAC put in its
  params' metadata: "lifted". A lifted call's input and perturbation travel
  as Variables of the layer (see `_hooked`), which the transform stacks and
  slices like the layer's params, so a stack gets one block per layer.

  Attributes:
    paths: ``id(module) -> path`` for the copy's modules.
    layer_paths: path -> the copy's captured layer there.
    perturbations: method -> path -> per-call perturbations to add.
    discovering: record layouts and shapes (and add no perturbations).
    inputs: (path, method) -> captured inputs, one per call (None for a
      lifted call: its input is read from the layer's Variable afterwards).
    lifted: (path, method, call) -> the stacked shape of a lifted call's
      input (discovery).
    layouts, output_shapes, param_shapes: what discovery records (see
      `capture.Discovered`).
    outputs: (path, method) -> perturbation shapes, one per call (discovery).
  """

  def __init__(self, paths: dict[int, Path], layer_paths: dict[Path, nnx.Module],
               perturbations: Any, discovering: bool):
    self.paths = paths
    self.layer_paths = layer_paths
    self.perturbations = capture.by_method(perturbations)
    self.discovering = discovering
    self.inputs: dict[tuple[Path, str], list[Any]] = {}
    self.lifted: dict[tuple[Path, str, int], jax.ShapeDtypeStruct] = {}
    self.layouts: dict[Path, Any] = {}
    self.output_shapes: dict[Path, tuple[int, ...]] = {}
    self.param_shapes: dict[Path, dict[str, tuple[int, ...]]] = {}
    self.outputs: dict[tuple[Path, str], list[jax.ShapeDtypeStruct]] = {}
    self.busy = False  # a kind's own helper calls are not layer calls

  def call(self, module: nnx.Module, method: str, original: Callable[..., Any],
           args: tuple, kwargs: dict) -> Any:
    """One call of a hooked layer's ``method``: recorded and perturbed."""
    kind = registry.kind_of(module)
    if self.busy or kind is None or method not in (capture.CALL, *kind.extra_methods):
      return original(module, *args, **kwargs)
    path = self.paths.get(id(module))
    params = {name: v for name, v in vars(module).items() if isinstance(v, nnx.Param)}
    lifted = path is None
    if lifted:
      path = next((v.get_metadata().get(_PATH) for v in params.values()), None)
    if path is None:  # a layer made during the call: not a module of the model
      return original(module, *args, **kwargs)
    config = (registry.configured(kind, module, args, kwargs)
              if method == capture.CALL else module)
    if config is None:
      if self.discovering:
        capture.record_layout(self.layouts, path,
                              capture.uncaptured(kind, args, kwargs))
      return original(module, *args, **kwargs)
    calls = self.inputs.setdefault((path, method), [])
    output = original(module, *args, **kwargs)
    captured = capture.call_input(self, kind, module, method, args, kwargs, output)
    index = len(calls)
    calls.append(None if lifted else captured)
    if not self.discovering:
      if not lifted:
        return capture.perturbed(output, self.perturbations[method][path][index],
                                 path)
      getattr(module, _stash_name("in", method, index)).set_value(captured)
      return capture.perturbed(
          output, getattr(module, _stash_name("out", method, index))[...], path)
    if method == capture.CALL:
      capture.record_layout(self.layouts, path, kind.layout(config, captured, output))
      self.output_shapes[path] = jnp.shape(output)
      self.param_shapes[path] = {name: jnp.shape(v) for name, v in params.items()}
    stack = ()
    if lifted:  # the leading axes the transform took off the params
      name, value = next(iter(params.items()))
      outer = jnp.shape(vars(self.layer_paths[path])[name][...])
      stack = outer[:len(outer) - jnp.ndim(value[...])]
      self.lifted[(path, method, index)] = jax.ShapeDtypeStruct(
          stack + jnp.shape(captured), jnp.result_type(captured))
    self.outputs.setdefault((path, method), []).append(
        capture.abstract_output(output, stack))
    return output

  def inputs_collection(self) -> dict:
    """The captured inputs as linen's ``kfac_inputs`` collection; a lifted
    call's input read from its layer's Variable, stacked by the transform."""
    return traverse_util.unflatten_dict({
        (*path, capture.input_name(method)): tuple(
            getattr(self.layer_paths[path], _stash_name("in", method, i))[...]
            if call is None else call for i, call in enumerate(calls))
        for (path, method), calls in self.inputs.items()})

  def perturbations_collection(self) -> dict:
    """Abstract zero perturbations as linen's ``kfac_perturbations``."""
    return traverse_util.unflatten_dict({
        (*path, capture.output_name(method, i)): shape
        for (path, method), shapes in self.outputs.items()
        for i, shape in enumerate(shapes)})


_ACTIVE: list[_Recorder] = []  # the recorder of the run in progress
_HOOKED: dict[type, type] = {}  # layer class -> its hooked subclass


def _hook(method: str, original: Callable[..., Any]) -> Callable[..., Any]:
  def hooked(self, *args, **kwargs):
    if not _ACTIVE:
      return original(self, *args, **kwargs)
    return _ACTIVE[-1].call(self, method, original, args, kwargs)
  hooked.__name__ = method
  return hooked


def _hooked_class(cls: type, kind: kinds.Kind) -> type:
  """A subclass of ``cls`` whose captured methods report to the recorder.

  Made once per class; only K-FAC's own copies ever have it, and only while
  K-FAC runs them.
  """
  if cls not in _HOOKED:
    methods = (capture.CALL, *kind.extra_methods)
    bases = (cls,)
    if registry.overrides_call(cls):
      # The class's own __call__ runs as written; the registered class's,
      # which it reaches through super().__call__, is the layer: a hooked
      # copy of that class comes after it in the MRO.
      registered = registry.registered_class(cls)
      bases += (type(cls)(registered.__name__, (registered,), {
          capture.CALL: _hook(capture.CALL, registered.__call__)}),)
      methods = kind.extra_methods
    namespace = {m: _hook(m, getattr(cls, m)) for m in methods}
    namespace.update(__qualname__=cls.__qualname__, __module__=cls.__module__)
    _HOOKED[cls] = type(cls)(cls.__name__, bases, namespace)
  return _HOOKED[cls]


@contextlib.contextmanager
def _hooked(model: nnx.Module, perturbations: Any, discovering: bool,
            lifted: dict[tuple[Path, str, int], jax.ShapeDtypeStruct]
            ) -> Iterator[_Recorder]:
  """The copy's captured layers hooked while the block runs, then restored.

  Each captured layer's params carry its path as metadata (NNX transforms
  copy it to the layer copies they make), and a layer with lifted calls gets
  Variables for their inputs (zeros) and perturbations.
  """
  paths, swapped = {}, []
  for path, module in nnx.iter_modules(model):  # each module once, first path
    paths[id(module)] = path = tuple(str(k) for k in path)
    kind = registry.kind_of(module)
    if kind is not None:
      swapped.append((module, type(module), kind))
      for value in vars(module).values():
        if isinstance(value, nnx.Param):
          value.set_metadata(**{_PATH: path})
  recorder = _Recorder(paths, {paths[id(m)]: m for m, _, _ in swapped},
                       perturbations, discovering)
  for (path, method, call), shape in lifted.items():
    layer = recorder.layer_paths[path]
    setattr(layer, _stash_name("in", method, call),
            nnx.Variable(jnp.zeros(shape.shape, shape.dtype)))
    setattr(layer, _stash_name("out", method, call),
            nnx.Variable(recorder.perturbations[method][path][call]))
  try:
    for module, cls, kind in swapped:
      object.__setattr__(module, "__class__", _hooked_class(cls, kind))
    _ACTIVE.append(recorder)
    yield recorder
  finally:
    if _ACTIVE and _ACTIVE[-1] is recorder:
      _ACTIVE.pop()
    for module, cls, _ in swapped:
      object.__setattr__(module, "__class__", cls)


class NNXModel:
  """An ``nnx.Module`` as K-FAC's apply function; see the module docstring.

  Args:
    model: the user's model. Its graph definition, the structure of its
      random streams and the values of its other state (neither params nor
      random streams) are read once, here; the model is not kept.
  """

  def __init__(self, model: nnx.Module):
    self.graphdef, params, rng_state, other = nnx.split(model, nnx.Param,
                                                        nnx.RngState, ...)
    self.param_shapes = _shapes(params)
    # What the params' partitioning metadata declares, for K-FAC under Auto
    # axes: nnx.Optimizer hands the update bare arrays.
    self.declared_specs = param_boxes.specs(params)
    self.rng_state = nnx.as_pure(rng_state)
    self.other = nnx.as_pure(other)
    self.name = type(model).__name__
    self._traces: dict[Any, tuple[capture.Discovered, dict]] = {}  # see `_trace`

  def _copy(self, variables: dict, rng: jax.Array | None) -> nnx.Module:
    """A fresh model from ``variables``: params, other state, random streams."""
    params = nnx.as_pure(variables["params"])
    self._check_params(params)
    given = nnx.as_pure({k: v for k, v in variables.items() if k not in _OWN_KEYS})
    other = nnx.merge_state(self.other, given) if given else self.other
    return nnx.merge(self.graphdef, params, self._streams(rng), other)

  def _check_params(self, params: Any) -> None:
    """The params must be the model's ``nnx.Param`` leaves, shapes and all."""
    given = _shapes(params)
    wrong = [f"{path}: missing" for path in self.param_shapes if path not in given]
    wrong += [f"{path}: not a param of the model" for path in given
              if path not in self.param_shapes]
    wrong += [f"{path}: shape {shape}, the model's {self.param_shapes[path]}"
              for path, shape in given.items()
              if path in self.param_shapes and shape != self.param_shapes[path]]
    if wrong:
      raise capture.ModelError(
          f"the params do not match the NNX model {self.name}: "
          f"{'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}.\nFix: "
          "pass the model's params, nnx.state(model, nnx.Param) (as "
          "nnx.Optimizer(model, tx, wrt=nnx.Param) does), unchanged in "
          "structure and shapes: K-FAC runs the model, which needs them all. "
          "To train some layers only (wrt=nnx.LoRAParam), give it all params "
          "and freeze the others with layer_overrides={'their/path': 'skip'} "
          "and optax.masked(optax.set_to_zero(), frozen_mask) after it "
          "(docs/models.md, \"Flax NNX\", has the recipe).")

  def _streams(self, rng: jax.Array | None) -> Any:
    """The model's random streams, every key drawn from ``rng``, counts 0.

    A stream's key keeps its shape: a layer stack made by ``nnx.vmap`` over
    split Rngs holds one key per layer, which ``nnx.scan`` slices.
    """
    if rng is None:
      return self.rng_state
    if not jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key):
      rng = jax.random.wrap_key_data(rng)

    def fresh(i, leaf):
      if not jnp.issubdtype(jnp.result_type(leaf), jax.dtypes.prng_key):
        return jnp.zeros_like(leaf)
      key = jax.random.fold_in(rng, i)
      return jax.random.split(key, leaf.shape) if leaf.shape else key
    leaves, treedef = jax.tree.flatten(self.rng_state)
    return treedef.unflatten([fresh(i, leaf) for i, leaf in enumerate(leaves)])

  def __call__(self, variables: dict, *args: Any, mutable: Any = False,
               rngs: dict[str, jax.Array] | None = None, **kwargs: Any) -> Any:
    """The model's output (with no collections when ``mutable``)."""
    outputs = self._copy(variables, (rngs or {}).get("dropout"))(*args, **kwargs)
    return (outputs, {}) if mutable else outputs

  def hooked(self, args: Sequence[Any], apply_kwargs: dict[str, Any]
             ) -> Callable[[Any], tuple[Any, Any]]:
    """``variables -> (outputs, {"kfac_inputs": ...})`` under K-FAC's hooks."""
    kwargs = dict(apply_kwargs)
    rng = kwargs.pop("rngs", {}).get("dropout")

    def run(variables):
      lifted = self._trace(variables, args, kwargs, reuse=True)[1]
      model = self._copy(variables, rng)
      with _hooked(model, variables.get(capture.PERTURBATIONS, {}), False,
                   lifted) as rec:
        outputs = model(*args, **kwargs)
      return outputs, {capture.INPUTS: rec.inputs_collection()}
    return run

  def _trace(self, variables: Any, args: Sequence[Any], kwargs: dict[str, Any],
             reuse: bool = False) -> tuple[capture.Discovered, dict]:
    """(what `discover` returns, the stacked shapes of lifted calls' inputs)
    from one abstract run under the hooks.

    Remembered by the shapes of params and inputs: the capture pass after
    `discover` (``reuse``) knows the shapes of lifted calls' inputs without
    another trace. `discover` itself always traces, so that layers
    registered since are seen.
    """
    params = nnx.as_pure(variables["params"])
    signature = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                            jnp.result_type(x)),
                             (params, tuple(args)))
    key = (jax.tree.structure(signature), tuple(jax.tree.leaves(signature)))
    if reuse and key in self._traces:
      return self._traces[key]
    found = []

    def run(params, args):
      model = self._copy({**variables, "params": params}, None)
      with _hooked(model, {}, True, {}) as recorder:
        found.append(recorder)
        return model(*args, **kwargs)
    outputs = jax.eval_shape(run, params, tuple(args))
    recorder = found[0]
    other_methods = {}
    for path, method in recorder.inputs:
      if method != capture.CALL:
        other_methods[path] = (*other_methods.get(path, ()), method)
    discovered = capture.Discovered(
        layouts=recorder.layouts,
        num_calls={path: len(calls) for (path, method), calls
                   in recorder.inputs.items() if method == capture.CALL},
        other_methods=other_methods, output_shapes=recorder.output_shapes,
        param_shapes=recorder.param_shapes,
        perturbations=recorder.perturbations_collection(), outputs=outputs)
    self._traces[key] = (discovered, recorder.lifted)
    return self._traces[key]

  def discover(self, variables: Any, args: Sequence[Any],
               apply_kwargs: dict[str, Any]) -> capture.Discovered:
    """`front_end.discover` for this model: one abstract run under the hooks."""
    kwargs = {k: v for k, v in apply_kwargs.items() if k != "rngs"}
    try:
      return self._trace(variables, args, kwargs)[0]
    except capture.ModelError:
      raise
    except Exception as error:  # a model that wants rngs per call, named
      if "rngs" not in str(error):
        raise
      raise capture.ModelError(
          f"the NNX model {self.name} could not run on the example batch: "
          f"{type(error).__name__}: {error}\nFix: {CALL_RNGS_FIX}") from error


CALL_RNGS_FIX = (
    "An NNX model draws its randomness from the nnx.Rngs it holds, which "
    "K-FAC's copy re-seeds from update's rng=; for a model that takes rngs "
    "as a call argument, give kfac and nnx.Optimizer a module that holds "
    "one and passes it, e.g. class Train(nnx.Module): def __init__(self, "
    "net): self.net, self.rngs = net, nnx.Rngs(dropout=0); def __call__(self, "
    "x): return self.net(x, rngs=self.rngs).")


def _shapes(params: Any) -> dict[str, tuple[int, ...]]:
  """{leaf path joined by "/": shape} of a params State or nested dict."""
  flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.State(params)))
  return {"/".join(str(k) for k in path): tuple(jnp.shape(leaf))
          for path, leaf in flat.items()}
