"""The model's plan: which block owns which params, found by tracing once.

`make` traces the model abstractly on a batch (`front_end.discover`), checks
what it finds against the params and the options, and returns a `Plan`: the
block of every captured layer, the diagonal fallback over every other
param, the tied embedding calls, and the zero perturbations K-FAC's pass
adds. Nothing in it depends on the values of the params or the batch, only
on their structure and shapes, so `Curvature` makes it again inside every
traced function instead of keeping it.

Every check here raises an error that names the cause and the fix: a
failure of the model is told apart from one of the batch, of ``inputs=``,
of the params, and of K-FAC's capture alone.
"""

import fnmatch
from typing import Any, Mapping, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax

from kfac_optax._src import blocks
from kfac_optax._src import layouts
from kfac_optax._src import losses
from kfac_optax._src import tree_paths
from kfac_optax._src.curvature import block_stacks
from kfac_optax._src.curvature import explicit_axes
from kfac_optax._src.curvature import model_call
from kfac_optax._src.curvature import options
from kfac_optax._src.curvature import replicas
from kfac_optax._src.curvature import state
from kfac_optax._src.curvature import summary
from kfac_optax._src.models import capture
from kfac_optax._src.models import front_end

Path = tree_paths.Path


class Plan(NamedTuple):
  """The static curvature layout found by tracing the model once."""
  layers: dict[str, tuple[Path, Any]]   # key -> (module path, block)
  fallback: blocks.DiagonalBlock | None  # over leaves no layer block owns
  fallback_paths: dict[str, Path]        # fallback leaf key -> leaf path
  perturbations: Any                     # abstract kfac_perturbations
  tied: dict[Path, tuple[Path, ...]]     # embedding -> calls of its table
  unowned: dict[Path, Any]               # call -> layout: no params leaves, no block

  def all_blocks(self) -> dict[str, Any]:
    found = {key: block for key, (_, block) in self.layers.items()}
    if self.fallback is not None:
      found[state.FALLBACK] = self.fallback
    return found


def _lifted_axes(inside: tuple, outside: tuple, layer_params: dict,
                 inside_params: dict) -> tuple[tuple, tuple]:
  """``(stack, time)``: the leading axes a lifted transform added to a layer.

  ``inside`` is the layer output's shape as the layer saw it, ``outside`` the
  shape of its collected perturbation; ``inside_params`` the param shapes as
  the layer saw them. The params' own extra leading axes (nn.scan or nn.vmap
  over layers) are the stack: one block per slice. The collections' further
  axes, which the params lack (nn.RNN or nn.scan over time, params
  broadcast), are time steps: rows of the block, or a series (see
  `blocks.SeriesBlock`). Counting axes, not matching sizes, keeps an input
  width equal to the number of steps (LSTMCell's bias-free ``ii`` kernel is
  (width, features)) from passing for a stack.
  """
  extra = outside[:len(outside) - len(inside)]
  ranks = {len(jnp.shape(p)) - len(inside_params[k]) for k, p in layer_params.items()
           if k in inside_params}
  rank = ranks.pop() if len(ranks) == 1 else 0
  return extra[:rank], extra[rank:]


def _series_option(path: Path, override: str | None, time: tuple,
                   layout: Any) -> str | None:
  """The layer's series option, checked against its kind and time axes."""
  if override not in blocks.SERIES_OPTIONS:
    return None
  if not isinstance(layout, layouts.DenseLayout):
    raise ValueError(
        f"layer_overrides gives {tree_paths.key(path)!r} {override!r}, but series "
        "blocks are for Dense/DenseGeneral layers (this one has a "
        f"{type(layout).__name__}). Fix: apply the series option only to "
        "dense layers shared over time steps.")
  if len(time) != 1:
    raise ValueError(
        f"layer_overrides gives {tree_paths.key(path)!r} {override!r}, but that layer "
        f"has {len(time)} time axes (leading axes of K-FAC's collections that "
        "its params lack); a series block needs exactly one: the layer must "
        "run inside one nn.RNN or nn.scan over time whose variable_axes put "
        "'kfac_inputs' and 'kfac_perturbations' at axis 0. Fix: apply the "
        "series option only to such layers, or use 'independent'.")
  return override


def check_not_masked(params: Any) -> None:
  """Rejects params that optax's masking hid parts of.

  ``optax.masked``, ``optax.multi_transform`` and ``optax.partition`` hand
  their members the params with every other leaf replaced by
  ``optax.MaskedNode``; K-FAC re-runs the whole model, which needs them all.
  The fix names the hidden modules as ``layer_overrides`` patterns.
  """
  is_node = lambda x: isinstance(x, optax.MaskedNode)
  flat = tree_paths.flatten(params, is_leaf=is_node)[0]
  hidden = sorted({_hidden_module(path, flat) for path, leaf in flat.items()
                   if is_node(leaf)})
  if hidden:
    shown = {name: "skip" for name in hidden[:4]}
    more = f" (and {len(hidden) - 4} more modules)" if len(hidden) > 4 else ""
    raise ValueError(
        "scale_by_kfac/kfac got params with optax.MaskedNode entries: it runs "
        "inside optax.masked, optax.multi_transform or optax.partition, which "
        "hide the other params from it, but K-FAC re-runs the whole model.\n"
        "Fix: give K-FAC all params and let it skip the hidden layers for the "
        "other transformations (their gradients pass through unpreconditioned), "
        f"e.g. optax.chain(scale_by_kfac(..., layer_overrides={shown!r}{more}), "
        "optax.masked(optax.scale_by_adam(), their_mask), optax.scale(-lr)); a "
        "hidden module that holds others also needs 'its/path/*'.")


def _hidden_module(path: Path, flat: dict[Path, Any]) -> str:
  """The module whose params a ``MaskedNode`` at ``path`` hides: a mask per
  leaf hides a param (beside other params, or with all of its module's), a
  mask by module prefix a whole module (beside other modules)."""
  parent = path[:-1]
  siblings = [q for q in flat if q[:len(parent)] == parent and q != path]
  beside_params = any(len(q) == len(path) and not isinstance(flat[q], optax.MaskedNode)
                      for q in siblings)
  beside_modules = any(len(q) > len(path) for q in siblings)
  is_param = beside_params or (bool(parent) and not beside_modules)
  return tree_paths.key(parent if is_param else path)


def _check_real_floating(flat_params: dict[Path, Any]) -> None:
  """Rejects integer, bool and complex params: K-FAC's Fisher is over reals.

  An integer leaf has no gradient and a complex one would need Hermitian
  statistics; either would otherwise get a silently wrong (or zero) update.
  """
  wrong = [f"{tree_paths.key(path)} ({jnp.result_type(leaf)})"
           for path, leaf in flat_params.items()
           if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating)]
  if wrong:
    raise TypeError(
        "kfac_optax trains real floating-point params only; these params "
        f"leaves are not: {', '.join(wrong)}.\nFix: keep integer arrays out "
        "of the 'params' collection (e.g. self.variable('constants', ...)) "
        "and pass that collection as update(..., variables=...) or "
        "TrainState.apply_gradients(..., variables=...); write a complex "
        "weight as two real params (its real and imaginary parts).")


def _check_layer_params(path: Path, layout: Any, layer_params: dict,
                        stack_shape: tuple) -> None:
  """A captured Dense-like or Conv-like layer's kernel and bias must be params
  of the shapes its captured input and output need: never reshaped to fit."""
  if not hasattr(layout, "kernel_shape"):
    return
  name = tree_paths.key(path) or "<root>"
  if layout.kernel_name not in layer_params:
    raise ValueError(
        f"the layer at {name!r} has no kernel param {layout.kernel_name!r} (its "
        f"params: {sorted(layer_params)}).\nFix: name the layer's params in its "
        "registration, e.g. kfac_optax.register_layer(TheLayer, 'dense', "
        "kernel='weight', bias='bias'), or give it the diagonal block with "
        f"layer_overrides={{{name!r}: 'diagonal'}}.")
  expected = {layout.kernel_name: layout.kernel_shape}
  if layout.bias_name in layer_params:
    expected[layout.bias_name] = layout.bias_shape
  for param, shape in expected.items():
    actual = tuple(jnp.shape(layer_params[param]))[len(stack_shape):]
    if actual == tuple(shape):
      continue
    order = getattr(layout, "kernel_order", "in_out")
    other = {"in_out": "out_in", "out_in": "in_out"}[order]
    raise ValueError(
        f"the layer at {name!r} has param {param!r} of shape {actual}, but its "
        f"captured input and output (in_dim={layout.in_dim}, out_dim="
        f"{layout.out_dim}) need {tuple(shape)} with kernel_layout={order!r}; "
        "K-FAC never reshapes a kernel to fit.\nFix: register the layer with "
        "the layout its kernel is stored in, e.g. kfac_optax.register_layer("
        f"TheLayer, 'dense', kernel_layout={other!r}) for a kernel stored "
        f"{'(out, in)' if other == 'out_in' else '(in, out)'}, or give it the "
        f"diagonal block with layer_overrides={{{name!r}: 'diagonal'}}.")


def _tied_calls(tied_embeddings: dict[str, str], discovered: capture.Discovered,
                flat_params: dict[Path, Any]) -> dict[Path, tuple[Path, ...]]:
  """``tied_embeddings`` checked: {embedding path: paths of its tied calls}."""
  tied: dict[Path, tuple[Path, ...]] = {}
  for source, target in tied_embeddings.items():
    call, table = tuple(source.split("/")), tuple(target.split("/"))
    embedding, layout = discovered.layouts.get(table), discovered.layouts.get(call)
    fix = ("tied_embeddings maps the path of a layer call that computes "
           "logits h Eᵀ with an embedding's table E (e.g. Hugging Face's "
           "lm_head.apply({'params': {'kernel': wte.T}}, h): 'lm_head') to that "
           "nn.Embed's path (e.g. 'transformer/wte')")
    if not isinstance(embedding, layouts.EmbeddingLayout):
      raise ValueError(f"tied_embeddings[{source!r}] = {target!r} is not a captured "
                       f"nn.Embed; {fix}")
    if (call not in discovered.num_calls
        or any(key[:-1] == call for key in flat_params)):
      raise ValueError(
          f"tied_embeddings: {source!r} is not a captured layer call without "
          f"params of its own; {fix}. init's warning names those calls.")
    if (getattr(layout, "num_stacks", None), getattr(layout, "in_dim", None),
        getattr(layout, "out_dim", None)) != (1, embedding.features, embedding.vocab):
      raise ValueError(
          f"tied_embeddings[{source!r}] = {target!r}: the call maps "
          f"{getattr(layout, 'in_dim', '?')} to {getattr(layout, 'out_dim', '?')} "
          f"features, but the table's transpose maps {embedding.features} to "
          f"{embedding.vocab}; {fix}")
    tied[table] = (*tied.get(table, ()), call)
  return tied


def unowned_message(plan: Plan) -> str:
  """init's warning about captured calls that get no block of their own."""
  tables = [(key, block.layout) for key, (_, block) in plan.layers.items()
            if isinstance(block, blocks.EmbeddingBlock)]
  ties = {tree_paths.key(call): key for call, layout in plan.unowned.items()
          for key, table in tables
          if (getattr(layout, "in_dim", None), getattr(layout, "out_dim", None))
          == (table.features, table.vocab)}
  suggestion = (f"tied_embeddings={ties!r}" if ties else
                "tied_embeddings={'lm_head': 'transformer/wte'}")
  names = ", ".join(repr(tree_paths.key(path)) for path in plan.unowned)
  return (
      f"K-FAC gives these captured layer calls no block of their own: {names}. "
      "Their params are not leaves of the params tree (e.g. a "
      "submodule run with .apply on weights the model computes, such as "
      "Hugging Face's tied lm_head.apply({'params': {'kernel': wte.T}}, h)). "
      "The params those weights come from are preconditioned by their own "
      "blocks, whose statistics leave these calls out. If a call computes "
      "logits with an nn.Embed's table transposed (tied word embeddings), "
      f"pass {suggestion} to fold it into that embedding's block.")


def warn_unmatched_overrides(settings: options.CurvatureOptions, params: Any) -> None:
  """A ``layer_overrides`` pattern that matches no module is most likely a
  typo (or a path of another nesting): say so instead of ignoring it."""
  modules = sorted({tree_paths.key(key[:-1]) for key in tree_paths.flatten(params)[0]})
  unmatched = [pattern for pattern in settings.layer_overrides or {}
               if not any(fnmatch.fnmatchcase(m, pattern) for m in modules)]
  if unmatched:
    summary.warn(
        f"layer_overrides patterns {unmatched} match no module path of this "
        f"model, so they change nothing. Module paths: {modules[:8]}"
        f"{' ...' if len(modules) > 8 else ''} (kfac_optax.describe(tx, params) "
        "lists them with their blocks).")


def discover(model: model_call.ModelCall, loss: losses.PredictiveLoss, params: Any,
             batch: Any, variables: dict, mutable: Any, what: str,
             axis_names: tuple[str, ...] = ()) -> capture.Discovered:
  """`front_end.discover` on ``batch``; a failure is re-raised naming its cause.

  The cause is told apart by what fails: ``inputs=``, the calling
  convention, the params (flax's missing or misshapen param errors), the
  model itself on this batch, or only K-FAC's capture (the model runs
  without the hooks). ``mutable=True`` (the example batch, which the caller
  has no other collections for) lets flax create every collection but
  params. ``axis_names``: see `abstractly`.
  """
  call_kwargs = model.call_kwargs(None)
  if mutable is True:
    # flax creates the other collections, some from the 'params' key
    # (SpectralNorm's power-iteration vector); params stay read-only, so a
    # missing param is still flax's error that names it.
    mutable = flax.core.DenyList("params")
  model.check_signature({"params": params, **variables}, model.args(batch, what),
                        call_kwargs)
  found = []

  def run(params, batch, variables, _):
    found.append(front_end.discover(
        model.apply_fn, {"params": params, **variables}, model.args(batch, what),
        model.call_kwargs(None), mutable))
    # outputs=, the loss's targets (shapes, dtype) and mask checked on this batch
    jax.eval_shape(lambda out: loss.value(model.output(out), batch),
                   found[0].outputs)
  try:
    abstractly(run, params, batch, variables, axis_names)
  except capture.ModelError:
    raise  # a front-end's own check names cause and fix
  except Exception as error:  # re-raised with the fix named
    if found:  # the model ran: outputs= or the loss's targets, named there
      raise
    raise _discovery_error(model, error, params, variables, batch, mutable,
                           what, axis_names) from error
  return found[0]


def abstractly(fn: Any, params: Any, batch: Any, variables: dict,
                axis_names: tuple[str, ...]) -> None:
  """``fn(params, batch, variables, None)`` traced (no FLOPs) as a pass of
  the model (`explicit_axes.in_model_axes`); batch: arrays or shape structs.

  ``axis_names`` (the replicas' ``axis_name``) are bound, one replica each,
  so that the model's own collectives over them (Flax's ImageNet ResNet's
  ``BatchNorm(axis_name="batch")``) trace outside ``pmap`` too (``init``).
  """
  traced = lambda p, b, v: explicit_axes.in_model_axes(fn, p, b, v, None)
  for name in axis_names:
    traced = jax.vmap(traced, in_axes=None, out_axes=None, axis_size=1,
                      axis_name=name)
  jax.eval_shape(traced, params, batch, variables)


def _run_plainly(model: model_call.ModelCall, params: Any, batch: Any,
                 variables: dict, mutable: Any, what: str,
                 axis_names: tuple[str, ...]) -> None:
  """apply_fn traced on ``batch`` without K-FAC's capture."""
  abstractly(lambda p, b, v, _: model.apply_fn(
      {"params": p, **v}, *model.args(b, what), mutable=mutable,
      **model.call_kwargs(None)), params, batch, variables, axis_names)


def check_runs_on_part(model: model_call.ModelCall, params: Any, part: Any,
                       name: str, size: int, whole: int,
                       axis_names: tuple[str, ...]) -> None:
  """Raises naming the setting ``name=size`` when apply_fn, which runs on
  the ``whole`` examples of example_batch, fails on ``part``, its first
  ``size``: a model that holds arrays sized for one batch."""
  try:
    _run_plainly(model, params, part, {}, flax.core.DenyList("params"),
                 "example_batch", axis_names)
  except Exception as error:  # re-raised naming the setting and the cause
    raise ValueError(
        f"{name}={size} runs the model on the batch's first {size} "
        f"examples, but apply_fn, which runs on the {whole} of "
        f"example_batch, fails on {size}: {type(error).__name__}: {error}\n"
        f"The model likely holds arrays made for {whole} examples "
        f"(positions or an attention mask built once, closed over or in "
        f"apply_kwargs).\nFix: build them from the inputs' shape inside the "
        f"model's call, or {name}=None (the whole batch).") from error


def _discovery_error(model: model_call.ModelCall, error: Exception, params: Any,
                     variables: dict, batch: Any, mutable: Any, what: str,
                     axis_names: tuple[str, ...]) -> Exception:
  """The error that names why discovery failed with ``error``."""
  if isinstance(params, Mapping) and "params" in params:
    return ValueError(
        "scale_by_kfac got the whole variables dict as params: pass the "
        "'params' collection, variables['params'] (other collections go "
        "in update(..., variables=...))")
  if isinstance(error, (flax.errors.ScopeParamNotFoundError,
                        flax.errors.ScopeParamShapeError)):
    return ValueError(
        f"the params do not match the model that apply_fn runs on {what}: "
        f"{type(error).__name__}: {error}\nFix: pass the 'params' "
        "collection that this model's init returns (model.init(key, "
        "x)['params']), unchanged in structure and shapes; if they are, "
        f"{what}'s inputs have other shapes than the inputs the params "
        "were initialised with.")
  if type(error).__name__ == "ShardingTypeError":  # jax's, not public
    return ValueError(
        f"apply_fn cannot run on {what} under the mesh's Explicit axes, "
        f"where K-FAC runs it as your own step does: {error}\nFix: name the "
        "sharding JAX asks for in the model (out_sharding=, "
        "jax.sharding.reshard), or make the mesh axes Auto "
        "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto, ...))).")
  try:
    _run_plainly(model, params, batch, variables, mutable, what, axis_names)
  except Exception:  # the model fails on its own: the batch's structure
    return ValueError(
        f"scale_by_kfac could not run apply_fn on {what}: "
        f"{type(error).__name__}: {error}\nFix: "
        f"{model_call.BATCH_FIX.format(what=what)}")
  fix = "" if "Fix:" in str(error) else (
      "\nFix: a layer given to kfac_optax.register_layer must be "
      "registered with the kind of its computation, and any captured "
      "layer can be given the diagonal block with "
      "layer_overrides={'its/path': 'diagonal'}.")
  return ValueError(
      f"apply_fn runs on {what}, but not under K-FAC's capture of its "
      f"layers: {type(error).__name__}: {error}{fix}")


def make(model: model_call.ModelCall, loss: losses.PredictiveLoss,
         settings: options.CurvatureOptions, params: Any, batch: Any,
         variables: dict, mutable: Any, what: str) -> Plan:
  """The plan of the model that ``model`` runs with ``params`` on ``batch``.

  Args:
    model: how the model is called.
    loss: the predictive distribution (its targets are checked on ``batch``).
    settings: ``layer_overrides``, ``tied_embeddings``, ``max_factor_dim``.
    params: the params (arrays or ``jax.ShapeDtypeStruct``).
    batch: a batch (or its shape structs), named ``what`` in errors.
    variables: other collections the model needs.
    mutable: the collections the model may write (see `discover`).
    what: ``"batch"`` or ``"example_batch"``.
  """
  discovered = discover(model, loss, params, batch, variables, mutable, what,
                        replicas.names(settings.axis_name))
  flat_params, _ = tree_paths.flatten(params)
  _check_real_floating(flat_params)
  perturbations = capture.by_layer(discovered.perturbations)
  tied = _tied_calls(settings.tied_embeddings or {}, discovered, flat_params)
  layers, owned, unowned, unthreaded = {}, set(), {}, []
  for path, layout in discovered.layouts.items():
    override = settings.override_for(path)
    layer_params = {key[-1]: leaf for key, leaf in flat_params.items()
                    if key[:-1] == path}
    if override == "skip":
      owned.update(path + (name,) for name in layer_params)
    if override in ("skip", "diagonal") or isinstance(layout, capture.Uncaptured):
      continue
    if not layer_params:  # e.g. a submodule's .apply on tied weights
      unowned[path] = layout
      continue
    if path not in discovered.num_calls or path not in perturbations:
      unthreaded.append(path)  # one collection or both
      continue
    stack, time = _lifted_axes(
        discovered.output_shapes[path], perturbations[path][0].shape,
        layer_params, discovered.param_shapes[path])
    _check_layer_params(path, layout, layer_params, stack)
    other_methods = discovered.other_methods.get(path, ())
    if path in tied:
      other_methods = tuple(sorted({*other_methods, "attend"}))
    block = blocks.block_for(
        layout, layer_params, stack, other_methods,
        structure=override if override in blocks.KRONECKER_STRUCTURES else None,
        max_factor_dim=settings.factor_dim_bound(),
        series=_series_option(path, override, time, layout), time_axes=time,
        factor_block_size=settings.factor_block_size)
    layers[tree_paths.key(path)] = (path, block)
    owned.update(path + (name,) for name in block.param_names)
  if unthreaded:
    raise capture.not_threaded_error(unthreaded)
  # "skip" leaves a module's params unpreconditioned, captured layer or not.
  fallback_paths = {tree_paths.key(k): k for k in flat_params
                    if k not in owned and settings.override_for(k[:-1]) != "skip"}
  fallback = blocks.DiagonalBlock(
      {key: jnp.shape(flat_params[path])
       for key, path in fallback_paths.items()}) if fallback_paths else None
  tied = {table: calls for table, calls in tied.items()
          if tree_paths.key(table) in layers}
  calls_in_use = {call for calls in tied.values() for call in calls}
  return Plan(layers, fallback, fallback_paths, discovered.perturbations, tied,
              {p: layout for p, layout in unowned.items() if p not in calls_in_use})


def hooked_model(model: model_call.ModelCall, plan: Plan, params: Any, batch: Any,
                 variables: dict, model_key: jax.Array | None, mutable: Any) -> Any:
  """``(fallback leaves, perturbations[, layer leaves]) -> (loss outputs,
  kfac_inputs)``: the model on ``batch`` under the capture's hooks, with the
  diagonal fallback's leaves (by key), the layers' output perturbations and
  optionally any other params leaves (by path) as its inputs."""
  flat_params, treedef = tree_paths.flatten(params)
  run = front_end.hooked_apply(model.apply_fn, model.args(batch),
                               model.call_kwargs(model_key), mutable)

  def hooked(fallback_leaves, perturbations, layer_leaves=None):
    paths = {plan.fallback_paths[k]: leaf for k, leaf in fallback_leaves.items()}
    full = tree_paths.rebuild(treedef, {**flat_params, **paths, **(layer_leaves or {})})
    outputs, collections = run(
        {"params": full, **variables, capture.PERTURBATIONS: perturbations})
    # No captured layer (every param in the fallback): no kfac_inputs.
    return model.output(outputs), collections.get(capture.INPUTS, {})
  return hooked


def check_state(plan: Plan, factors: Any) -> None:
  """A state's ``factors`` must be this plan's: the same blocks, fallback
  leaves and shapes (``init`` made them from these params' plan).

  Raises:
    ValueError: naming what differs, for a state of another model or params
      that gained or lost leaves since ``init``.
  """
  expected = block_stacks.shapes(jax.eval_shape(
      lambda: {key: block.init()[0] for key, block in plan.all_blocks().items()}))
  got = block_stacks.shapes(factors)
  if got == expected:
    return
  differences = [f"block {key!r}: missing from the state"
                 for key in expected if key not in got]
  differences += [f"block {key!r}: in the state, not in this model"
                  for key in got if key not in expected]
  for key in [key for key in expected if key in got]:
    if key == state.FALLBACK:
      names = set(expected[key]) | set(got[key])
      differences += [f"fallback leaf {name!r}: " + (
          "missing from the state" if name not in got[key]
          else "in the state, not in these params")
                      for name in sorted(names)
                      if (name in got[key]) != (name in expected[key])]
    if got[key] != expected[key]:
      differences.append(f"block {key!r}: shapes {got[key]} in the "
                         f"state, {expected[key]} for these params")
  differences = differences or ["the structure of its factors"]
  raise ValueError(
      "the K-FAC state does not fit these params: "
      f"{'; '.join(differences[:5])}{' ...' if len(differences) > 5 else ''}."
      "\nFix: make the state with this transformation's init on these params "
      "(tx.init(params)); a state of another model, or of params that gained "
      "or lost leaves since, does not fit.")
