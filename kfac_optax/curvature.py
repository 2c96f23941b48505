"""K-FAC's curvature estimate of one model: statistics, inverses, products.

`Curvature` holds everything static about a model's curvature (which layers,
which blocks, how statistics are estimated) and works on a `ScaleByKFACState`:

- `Curvature.update`: capture layer inputs and output gradients on a batch,
  fold the batch statistics into a debiased EMA, refresh damped inverses on
  schedule (DESIGN.md section 2);
- `Curvature.precondition`: ``F̂⁻¹ v`` with the stored damped inverses;
- `Curvature.multiply`: ``(F̂ + damping)^p v`` for any power ``p`` (the
  approximate Fisher, its damped inverse and inverse square root);
- `Curvature.exact_product`: the exact Fisher (= GGN for the losses here)
  times a vector on a batch, by forward-mode differentiation.

`transform.scale_by_kfac` and `transform.kfac` wrap it as optax
transformations; it is public for users who want the products themselves.
"""

import dataclasses
import fnmatch
import functools
import inspect
from typing import Any, Callable, Mapping, NamedTuple

import flax
import jax
import jax.numpy as jnp
import optax

from kfac_optax import blocks
from kfac_optax import capture
from kfac_optax import checks
from kfac_optax import conv_layout
from kfac_optax import layouts
from kfac_optax import linalg
from kfac_optax import losses
from kfac_optax import nnx_capture
from kfac_optax import sharding
from kfac_optax import summary

Path = tuple[str, ...]
FALLBACK = "<diagonal>"  # state key of the diagonal fallback block
_OVERRIDES = ("skip", "diagonal", *blocks.KRONECKER_STRUCTURES, "independent",
              *blocks.SERIES_OPTIONS)
# Factors above this size are kept diagonal by default (max_factor_dim="auto").
# Timed with benchmarks/factor_inverse.py (results/factor_inverse.json): on
# 2 CPU cores one float32 eigh takes 0.53 s at 2048, 3.6 s at 4096, 12 s at
# 6144 and 28 s at 8192 (cholesky 4 to 5 times faster). 4096 keeps a refresh of
# the largest factors of common models (GPT-2 small's 3073) within seconds;
# VGG16's 25089-wide fully connected input becomes diagonal.
DEFAULT_MAX_FACTOR_DIM = 4096


class ScaleByKFACState(NamedTuple):
  """State of `scale_by_kfac` (and of `Curvature`).

  Attributes:
    count: updates so far (``t`` of DESIGN.md; 0 on the first update).
    stats_count: statistics updates folded into ``factors`` so far.
    factors: block key -> debiased EMA of the block's statistics:
      `blocks.KroneckerFactors` ``(A, G)`` for a layer (key: its module path
      joined by "/"), ``{leaf path: F}`` for the diagonal fallback (key
      ``"<diagonal>"``).
    inverses: block key -> damped inverses from the last accepted refresh,
      same layout (identities before the first).
    damping: the damping λ of the inverses in use (nan before the first
      accepted refresh).
    rejected_statistics: statistics updates whose batch statistics were not
      finite, so the factors kept their previous values.
    rejected_refreshes: inverse refreshes that kept every previous inverse,
      because the damping was not a positive finite number or some block's
      damped inverse was not finite.
    rescaled_updates: updates scaled down to fit the parameter dtype
      (see `Curvature.precondition`).

  Factors, inverses and damping are float64 when the params are float64
  (or any of them is), else float32.
  """
  count: jax.Array
  stats_count: jax.Array
  factors: dict[str, Any]
  inverses: dict[str, Any]
  damping: jax.Array
  rejected_statistics: jax.Array
  rejected_refreshes: jax.Array
  rescaled_updates: jax.Array


class _Plan(NamedTuple):
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
      found[FALLBACK] = self.fallback
    return found


def _key(path: Path) -> str:
  return "/".join(path)


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None
            ) -> tuple[dict[Path, Any], Any]:
  """A tree -> ({leaf path: leaf}, treedef), leaf paths as tuples of str."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  def name(entry):
    for attribute in ("key", "name", "idx"):
      if hasattr(entry, attribute):
        return str(getattr(entry, attribute))
    return str(entry)
  return {tuple(name(e) for e in path): leaf for path, leaf in pairs}, treedef


def _rebuild(treedef: Any, flat: dict[Path, Any]) -> Any:
  """Inverse of `flatten` (``flat`` must keep `flatten`'s key order)."""
  return treedef.unflatten(list(flat.values()))


def _first_element(batch: Any) -> Any:
  return losses.batch_element(
      batch, 0, "inputs", "scale_by_kfac/kfac (returning apply_fn's "
      "positional input, or a tuple of them)")


_BATCH_FIX = (
    "{what} must have the structure of a training batch, `inputs=` must map "
    "it to apply_fn's positional input(s) (default batch[0]), constant call "
    "keywords go in apply_kwargs=, and other variable collections (e.g. "
    "batch_stats) in update(..., variables=...).")
_CALLED_AS = (
    "apply_fn(variables, *inputs(batch), mutable=..., "
    "rngs=kfac_optax.model_rngs(key), **apply_kwargs)")


def _is_array(value: Any) -> bool:
  return hasattr(value, "shape") and hasattr(value, "dtype")


def _logits_or_first_array(names: list, get: Callable[[Any], Any]) -> Any:
  """The name the ``outputs=`` hint shows: ``logits`` if it is an array
  there (Hugging Face's name for a head's outputs), else the first array."""
  arrays = [name for name in names if _is_array(get(name))]
  return "logits" if "logits" in arrays or not arrays else arrays[0]


def _output_advice(value: Any) -> tuple[str, str]:
  """(its keys or fields, an ``outputs=`` selecting an array) for a
  non-array model output."""
  if dataclasses.is_dataclass(value):  # also Hugging Face's ModelOutput
    names = [field.name for field in dataclasses.fields(value)]
    name = _logits_or_first_array(names, lambda n: getattr(value, n))
    return f"fields {names}", f"outputs=lambda out: out.{name}"
  if isinstance(value, dict):
    key = _logits_or_first_array(list(value), value.get)
    return f"keys {list(value)}", f"outputs=lambda out: out[{key!r}]"
  if isinstance(value, (tuple, list)):
    return f"{len(value)} elements", "outputs=lambda out: out[0]"
  return repr(value), "outputs=lambda out: out.logits"


def _check_signature(apply_fn: Callable[..., Any], variables: Any, args: tuple,
                     call_kwargs: dict[str, Any]) -> None:
  """apply_fn must accept the call K-FAC makes (flax's ``Module.apply`` does)."""
  try:
    signature = inspect.signature(apply_fn)
  except (TypeError, ValueError):  # no signature to check (a C callable)
    return
  try:
    signature.bind(variables, *args, mutable=False, **call_kwargs)
  except TypeError as error:
    raise TypeError(
        f"apply_fn cannot be called the way K-FAC calls it, {_CALLED_AS}: "
        f"{error}.\nFix: pass the flax apply function (model.apply), or a "
        "function that accepts these arguments and passes them on, e.g. "
        "lambda variables, *inputs, **kwargs: model.apply(variables, "
        "*inputs, **kwargs).") from error


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
        f"layer_overrides gives {_key(path)!r} {override!r}, but series "
        "blocks are for Dense/DenseGeneral layers (this one has a "
        f"{type(layout).__name__}). Fix: apply the series option only to "
        "dense layers shared over time steps.")
  if len(time) != 1:
    raise ValueError(
        f"layer_overrides gives {_key(path)!r} {override!r}, but that layer "
        f"has {len(time)} time axes (leading axes of K-FAC's collections that "
        "its params lack); a series block needs exactly one: the layer must "
        "run inside one nn.RNN or nn.scan over time whose variable_axes put "
        "'kfac_inputs' and 'kfac_perturbations' at axis 0. Fix: apply the "
        "series option only to such layers, or use 'independent'.")
  return override


def _check_not_masked(params: Any) -> None:
  """Rejects params that optax's masking hid parts of.

  ``optax.masked``, ``optax.multi_transform`` and ``optax.partition`` hand
  their members the params with every other leaf replaced by
  ``optax.MaskedNode``; K-FAC re-runs the whole model, which needs them all.
  The fix names the hidden modules as ``layer_overrides`` patterns.
  """
  is_node = lambda x: isinstance(x, optax.MaskedNode)
  flat = flatten(params, is_leaf=is_node)[0]
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
  return _key(parent if is_param else path)


def _check_real_floating(flat_params: dict[Path, Any]) -> None:
  """Rejects integer, bool and complex params: K-FAC's Fisher is over reals.

  An integer leaf has no gradient and a complex one would need Hermitian
  statistics; either would otherwise get a silently wrong (or zero) update.
  """
  wrong = [f"{_key(path)} ({jnp.result_type(leaf)})"
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
  name = _key(path) or "<root>"
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


def _unowned_message(plan: _Plan) -> str:
  """init's warning about captured calls that get no block of their own."""
  tables = [(key, block.layout) for key, (_, block) in plan.layers.items()
            if isinstance(block, blocks.EmbeddingBlock)]
  ties = {_key(call): key for call, layout in plan.unowned.items()
          for key, table in tables
          if (getattr(layout, "in_dim", None), getattr(layout, "out_dim", None))
          == (table.features, table.vocab)}
  suggestion = (f"tied_embeddings={ties!r}" if ties else
                "tied_embeddings={'lm_head': 'transformer/wte'}")
  names = ", ".join(repr(_key(path)) for path in plan.unowned)
  return (
      f"K-FAC gives these captured layer calls no block of their own: {names}. "
      "Their params are not leaves of the params tree (e.g. a "
      "submodule run with .apply on weights the model computes, such as "
      "Hugging Face's tied lm_head.apply({'params': {'kernel': wte.T}}, h)). "
      "The params those weights come from are preconditioned by their own "
      "blocks, whose statistics leave these calls out. If a call computes "
      "logits with an nn.Embed's table transposed (tied word embeddings), "
      f"pass {suggestion} to fold it into that embedding's block.")


def _all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.array(
      [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def _is_positive_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def on_schedule(period: Any, count: jax.Array, refresh: Callable[[Any], Any],
                current: Any) -> Any:
  """``refresh(current)`` when ``count % period == 0``, else ``current``.

  A static period of 1 skips the `lax.cond`, so XLA sees the work
  unconditionally and can share it with the user's own forward pass.
  """
  if isinstance(period, int) and period == 1:
    return refresh(current)
  return jax.lax.cond(count % period == 0, refresh, lambda c: c, current)


def model_rngs(rng: jax.Array) -> dict[str, jax.Array]:
  """The ``rngs`` K-FAC's passes give a linen ``apply_fn`` for the key ``rng``.

  ``"dropout"`` gets ``rng`` and ``"params"`` a key folded from it, which
  flax's ``make_rng`` falls back to for every other stream (stochastic
  depth's, a VAE's noise). Take your gradient with
  ``model.apply(..., rngs=kfac_optax.model_rngs(key))`` and pass
  ``rng=key`` to ``update``: `kfac`'s automatic mode then measures the loss
  change under the very noise your gradient saw, as its quadratic model
  assumes.
  """
  return {"dropout": rng, "params": jax.random.fold_in(rng, 1)}


@dataclasses.dataclass(frozen=True, eq=False)
class Curvature:
  """The K-FAC curvature of a flax model; see `transform.scale_by_kfac`.

  Attributes mirror `scale_by_kfac`'s arguments (``damping`` excepted: it is
  passed to `update` and the products, so that callers can adapt it). An
  ``nnx.Module`` given as ``apply_fn`` is replaced by its
  `nnx_capture.NNXModel`; params and vectors may then hold ``nnx.Variable``
  leaves, and products come back in the structure of the vector given.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, kfac_optax
    >>> model = nn.Dense(3)
    >>> batch = (jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32))
    >>> params = model.init(jax.random.key(0), batch[0])["params"]
    >>> curvature = kfac_optax.Curvature(
    ...     model.apply, kfac_optax.losses.softmax_cross_entropy(),
    ...     example_batch=batch, estimation="empirical")
    >>> state = curvature.update(curvature.init(params), params, batch=batch,
    ...                          damping=1e-3)
    >>> fv = curvature.multiply(state, params, power=1)      # F̂ v
    >>> v = curvature.multiply(state, fv, power=-1, damping=1e-3)  # ≈ params
  """

  apply_fn: Callable[..., Any]
  loss: losses.PredictiveLoss
  example_batch: Any
  inputs: Callable[[Any], Any] | None = None
  ema_decay: float = 0.95
  inverse_update_period: int = 5
  stats_update_period: int = 1
  estimation: str = "fisher"
  inverse: str = "auto"
  num_samples: int = 1
  apply_kwargs: dict[str, Any] | None = None
  layer_overrides: dict[str, str] | None = None
  tied_embeddings: dict[str, str] | None = None
  mesh: jax.sharding.Mesh | None = None
  outputs: Callable[[Any], Any] | None = None
  max_factor_dim: int | str | None = "auto"
  curvature_batch_size: int | None = None
  factor_rank: int | None = None

  def __post_init__(self):
    # An nnx.Module runs through its own front-end (see `nnx_capture`).
    object.__setattr__(self, "apply_fn", nnx_capture.front_end(self.apply_fn))
    if not isinstance(self.loss, losses.PredictiveLoss):
      raise TypeError(
          "loss must be a kfac_optax.losses predictive distribution, e.g. "
          "kfac_optax.losses.softmax_cross_entropy() for integer labels, got "
          f"{self.loss!r}: K-FAC samples targets from it and needs its output "
          "Fisher, which a loss function such as optax's does not give")
    if self.estimation not in losses.ESTIMATIONS:
      raise ValueError(f"estimation must be one of {losses.ESTIMATIONS}, "
                       f"got {self.estimation!r}")
    if self.inverse not in linalg.INVERSE_METHODS:
      raise ValueError(f"inverse must be one of {linalg.INVERSE_METHODS}, "
                       f"got {self.inverse!r}")
    checks.in_range("ema_decay", self.ema_decay, 0.0, 1.0, high_open=True)
    checks.count("inverse_update_period", self.inverse_update_period, 1)
    checks.count("stats_update_period", self.stats_update_period, 1)
    for name, valid in (("num_samples", "a positive Python int"),
                        ("curvature_batch_size", "a positive Python int or None"),
                        ("factor_rank", "a positive Python int or None")):
      value = getattr(self, name)
      if not (_is_positive_int(value) or (value is None and "None" in valid)):
        raise ValueError(f"{name} must be {valid}, got {value!r}; with "
                         "optax.inject_hyperparams, list it in static_args")
    bound = self.max_factor_dim
    if not (bound is None or (isinstance(bound, str) and bound == "auto")
            or _is_positive_int(bound)):
      raise ValueError(
          "max_factor_dim must be a positive Python int, None (no bound) or "
          f"\"auto\" ({DEFAULT_MAX_FACTOR_DIM}), got {self.max_factor_dim!r}; with "
          "optax.inject_hyperparams, list it in static_args")
    for pattern, choice in (self.layer_overrides or {}).items():
      if choice not in _OVERRIDES:
        raise ValueError(f"layer_overrides[{pattern!r}] must be one of "
                         f"{_OVERRIDES}, got {choice!r}")
    if "rngs" in (self.apply_kwargs or {}):
      raise ValueError(
          "apply_kwargs must not hold 'rngs': K-FAC's pass draws its own "
          "randomness from update's rng= (it seeds 'dropout' and, through "
          "flax's fallback to 'params', every other stream), as the user's "
          f"step draws its own. {nnx_capture.CALL_RNGS_FIX}")
    for source, target in (self.tied_embeddings or {}).items():
      if not (isinstance(source, str) and isinstance(target, str)):
        raise TypeError(
            "tied_embeddings must map a call's module path to an nn.Embed's "
            f"path, both strings joined by '/', got {source!r}: {target!r}")

  # -- the model ------------------------------------------------------------

  def _model_args(self, batch: Any, what: str = "batch") -> tuple:
    if self.inputs is None:
      found = _first_element(batch)
    else:
      try:
        found = self.inputs(batch)
      except Exception as error:  # re-raised naming inputs= and the batch
        raise ValueError(
            f"inputs= could not read apply_fn's input from {what}: "
            f"{type(error).__name__}: {error}\nFix: "
            f"{_BATCH_FIX.format(what=what)}") from error
    return found if isinstance(found, tuple) else (found,)

  def _call_kwargs(self, rng: jax.Array | None) -> dict[str, Any]:
    key = jax.random.key(0) if rng is None else rng
    return {**(self.apply_kwargs or {}), "rngs": model_rngs(key)}

  def _model_output(self, out: Any) -> jax.Array:
    """The array the loss reads from apply_fn's return value (``outputs=``).

    Raises:
      TypeError: if it is not an array (a dict, a dataclass such as Hugging
        Face's ``ModelOutput``, a tuple), naming ``outputs=``.
    """
    found = out if self.outputs is None else self.outputs(out)
    if not _is_array(found):
      source = ("outputs= returned" if self.outputs is not None
                else "apply_fn returned")
      content, hint = _output_advice(found)
      raise TypeError(
          f"{source} {type(found).__name__} ({content}), but the loss reads "
          "one array of outputs.\nFix: pass outputs= to scale_by_kfac/kfac "
          "(or Curvature), a function from apply_fn's return value to the array "
          f"the loss reads, e.g. {hint}")
    return found

  def forward(self, params: Any, batch: Any, variables: dict | None = None,
              rng: jax.Array | None = None) -> Any:
    """The model output on ``batch``, selected by ``outputs=`` (other
    collections' changes discarded)."""
    variables = dict(variables or {})
    params = nnx_capture.pure(params)
    out = self.apply_fn({"params": params, **variables}, *self._model_args(batch),
                        mutable=list(variables) or False, **self._call_kwargs(rng))
    return self._model_output(out[0] if variables else out)

  def loss_value(self, params: Any, batch: Any, variables: dict | None = None,
                 rng: jax.Array | None = None) -> jax.Array:
    """The training loss ``loss.value`` of the model on ``batch``."""
    return self.loss.value(self.forward(params, batch, variables, rng), batch)

  def _override_for(self, path: Path) -> str | None:
    name = _key(path)
    return next((choice for pattern, choice in (self.layer_overrides or {}).items()
                 if fnmatch.fnmatchcase(name, pattern)), None)

  def _warn_unmatched_overrides(self, params: Any) -> None:
    """A ``layer_overrides`` pattern that matches no module is most likely a
    typo (or a path of another nesting): say so instead of ignoring it."""
    modules = sorted({_key(key[:-1]) for key in flatten(params)[0]})
    unmatched = [pattern for pattern in self.layer_overrides or {}
                 if not any(fnmatch.fnmatchcase(m, pattern) for m in modules)]
    if unmatched:
      summary.warn(
          f"layer_overrides patterns {unmatched} match no module path of this "
          f"model, so they change nothing. Module paths: {modules[:8]}"
          f"{' ...' if len(modules) > 8 else ''} (kfac_optax.describe(tx, params) "
          "lists them with their blocks).")

  def _discover(self, params, batch, variables, mutable, what):
    """`capture.discover` on ``batch``; a failure is re-raised naming its cause.

    The cause is told apart by what fails: ``inputs=``, the calling
    convention, the params (flax's missing or misshapen param errors), the
    model itself on this batch, or only K-FAC's capture (the model runs
    without the hooks).
    """
    args = self._model_args(batch, what)
    call_kwargs = self._call_kwargs(None)
    if mutable is True:  # the example batch, with no collection but params
      # flax creates the others, some from the 'params' key (SpectralNorm's
      # power-iteration vector); params stay read-only, so a missing param
      # is still flax's error that names it.
      mutable = flax.core.DenyList("params")
    variables = {"params": params, **variables}
    _check_signature(self.apply_fn, variables, args, call_kwargs)
    try:
      discovered = capture.discover(self.apply_fn, variables, args, call_kwargs,
                                    mutable)
    except capture.ModelError:
      raise  # a front-end's own check names cause and fix
    except Exception as error:  # re-raised with the fix named
      if isinstance(params, Mapping) and "params" in params:
        raise ValueError(
            "scale_by_kfac got the whole variables dict as params: pass the "
            "'params' collection, variables['params'] (other collections go "
            "in update(..., variables=...))") from error
      if isinstance(error, (flax.errors.ScopeParamNotFoundError,
                            flax.errors.ScopeParamShapeError)):
        raise ValueError(
            f"the params do not match the model that apply_fn runs on {what}: "
            f"{type(error).__name__}: {error}\nFix: pass the 'params' "
            "collection that this model's init returns (model.init(key, "
            "x)['params']), unchanged in structure and shapes; if they are, "
            f"{what}'s inputs have other shapes than the inputs the params "
            "were initialised with.") from error
      try:
        jax.eval_shape(lambda v, a: self.apply_fn(
            v, *a, mutable=mutable, **call_kwargs), variables, args)
      except Exception:  # the model fails on its own: the batch's structure
        raise ValueError(
            f"scale_by_kfac could not run apply_fn on {what}: "
            f"{type(error).__name__}: {error}\nFix: "
            f"{_BATCH_FIX.format(what=what)}") from error
      fix = "" if "Fix:" in str(error) else (
          "\nFix: a layer given to kfac_optax.register_layer must be "
          "registered with the kind of its computation, and any captured "
          "layer can be given the diagonal block with "
          "layer_overrides={'its/path': 'diagonal'}.")
      raise ValueError(
          f"apply_fn runs on {what}, but not under K-FAC's capture of its "
          f"layers: {type(error).__name__}: {error}{fix}") from error
    # outputs=, the loss's targets (shapes, dtype) and mask checked on this batch
    jax.eval_shape(lambda out, b: self.loss.value(self._model_output(out), b),
                   discovered.outputs, batch)  # batch: arrays or shape structs
    return discovered

  def _plan(self, params, batch, variables, mutable, what) -> _Plan:
    discovered = self._discover(params, batch, variables, mutable, what)
    flat_params, _ = flatten(params)
    _check_real_floating(flat_params)
    perturbations = capture.by_layer(discovered.perturbations)
    tied = _tied_calls(self.tied_embeddings or {}, discovered, flat_params)
    layers, owned, unowned = {}, set(), {}
    for path, layout in discovered.layouts.items():
      override = self._override_for(path)
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
        raise capture.not_threaded_error(path)  # one collection or both
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
          max_factor_dim=self._max_factor_dim(),
          series=_series_option(path, override, time, layout), time_axes=time)
      layers[_key(path)] = (path, block)
      owned.update(path + (name,) for name in block.param_names)
    fallback_paths = {_key(k): k for k in flat_params if k not in owned}
    fallback = blocks.DiagonalBlock(
        {key: jnp.shape(flat_params[path])
         for key, path in fallback_paths.items()}) if fallback_paths else None
    tied = {table: calls for table, calls in tied.items() if _key(table) in layers}
    calls_in_use = {call for calls in tied.values() for call in calls}
    return _Plan(layers, fallback, fallback_paths, discovered.perturbations, tied,
                 {p: layout for p, layout in unowned.items() if p not in calls_in_use})

  def _example_plan(self, params: Any) -> _Plan:
    # mutable=True lets flax create collections such as batch_stats that the
    # example batch needs and the caller does not have (`_discover`).
    return self._plan(params, self.example_batch, {}, True, "example_batch")

  def _max_factor_dim(self) -> int | None:
    """The bound ``"auto"`` stands for: the inverse's O(d³) cost, which
    ``factor_rank`` avoids."""
    if self.max_factor_dim != "auto":
      return self.max_factor_dim
    return None if self.factor_rank is not None else DEFAULT_MAX_FACTOR_DIM

  # -- state ----------------------------------------------------------------

  def describe(self, params: Any) -> summary.Summary:
    """The block of every module of the model (see `kfac_optax.describe`)."""
    params = nnx_capture.pure(params)
    return self._summary(self._example_plan(params), params)

  def _summary(self, plan: _Plan, params: Any) -> summary.Summary:
    flat_params, _ = flatten(params)
    return summary.summarize(
        plan.layers, plan.fallback_paths,
        {path: jnp.shape(leaf) for path, leaf in flat_params.items()},
        self._override_for, self.factor_rank)

  def init(self, params: Any) -> ScaleByKFACState:
    """Zero statistics and identity inverses for every block of the model.

    Warns (`summary.FallbackWarning`) when more than half of the parameters
    fall to the diagonal fallback.
    """
    factors, inverses = {}, {}
    params = nnx_capture.pure(params)
    _check_not_masked(params)
    dtype = linalg.curvature_dtype(params)
    plan = self._example_plan(params)
    if plan.unowned:
      summary.warn(_unowned_message(plan))
    self._warn_unmatched_overrides(params)
    summary.warn_if_mostly_fallback(self._summary(plan, params))
    for key, block in plan.all_blocks().items():
      factors[key], inverses[key] = jax.tree.map(lambda x: x.astype(dtype),
                                                 block.init())
      if self.factor_rank is not None:  # which factors are kept at rank
        inverses[key] = linalg.low_rank_identities(
            jax.eval_shape(block.damped, factors[key], jnp.ones([], dtype)),
            inverses[key], self.factor_rank)
    # Distinct buffers: a state passed with donate_argnums must not alias.
    counters = [jnp.zeros([], jnp.int32) for _ in range(5)]
    return ScaleByKFACState(*counters[:2], factors, inverses,
                            jnp.full([], jnp.nan, dtype), *counters[2:])

  def _statistics_batch(self, batch: Any) -> Any:
    """The first ``curvature_batch_size`` examples of ``batch`` (all of it
    for None): every leaf sliced on its leading axis."""
    size = self.curvature_batch_size
    if size is None:
      return batch
    leaves = jax.tree.leaves(batch)
    leading = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in leaves}
    if len(leading) != 1 or None in leading:
      shapes = [tuple(jnp.shape(leaf)) for leaf in leaves]
      raise ValueError(
          f"curvature_batch_size={size} takes the first {size} examples of every "
          f"leaf of the batch, but its leaves have no common leading (batch) "
          f"axis: shapes {shapes[:8]}{' ...' if len(shapes) > 8 else ''}.\nFix: "
          "give every leaf of the batch the examples on its first axis, or "
          "curvature_batch_size=None (statistics from the whole batch).")
    (batch_size,) = leading
    if size > batch_size:
      raise ValueError(
          f"curvature_batch_size={size} exceeds the batch size {batch_size}.\n"
          f"Fix: curvature_batch_size <= {batch_size}, or None (statistics from "
          "the whole batch).")
    return jax.tree.map(lambda leaf: leaf[:size], batch)

  def _batch_statistics(self, plan, params, batch, variables, rng):
    flat_params, treedef = flatten(params)
    sample_key, model_key = jax.random.split(rng)
    run = capture.hooked_apply(self.apply_fn, self._model_args(batch),
                               self._call_kwargs(model_key),
                               [*variables, capture.INPUTS])

    def model(fallback_leaves, perturbations):
      paths = {plan.fallback_paths[k]: leaf for k, leaf in fallback_leaves.items()}
      full = _rebuild(treedef, {**flat_params, **paths})
      outputs, collections = run(
          {"params": full, **variables, capture.PERTURBATIONS: perturbations})
      # No captured layer (every param in the fallback): no kfac_inputs.
      return self._model_output(outputs), collections.get(capture.INPUTS, {})

    captured = capture.capture(
        model,
        {k: flat_params[path] for k, path in plan.fallback_paths.items()},
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), plan.perturbations),
        lambda outputs: losses.output_cotangents(
            self.loss, outputs, batch, self.estimation, sample_key,
            self.num_samples))
    terms = self.loss.terms(captured.outputs, batch)
    stats = {}
    for key, (path, block) in plan.layers.items():
      other_calls = {method: (inputs[path], grads[path]) for method, (inputs, grads)
                     in captured.other_methods.items() if path in inputs}
      for call in plan.tied.get(path, ()):  # more uses of the table as `attend`
        queries, logit_grads = other_calls.get("attend", ((), ()))
        other_calls["attend"] = (queries + captured.inputs[call],
                                 logit_grads + captured.output_grads[call])
      stats[key] = block.statistics(captured.inputs[path],
                                    captured.output_grads[path], terms, **other_calls)
    if plan.fallback is not None:
      stats[FALLBACK] = plan.fallback.statistics(captured.primal_grads, terms)
    return stats

  def _fold_in(self, factors, stats_count, rejected, batch_stats):
    """Debiased EMA: D_t = D_{t-1} + (1-ρ)/(1-ρ^t) (B_t - D_{t-1})."""
    new_count = stats_count + 1
    weight = (1.0 - self.ema_decay) / (1.0 - jnp.power(self.ema_decay, new_count))
    new = jax.tree.map(lambda old, b: old + weight * (b - old), factors, batch_stats)
    finite = _all_finite(batch_stats)  # non-finite statistics never enter
    return (jax.tree.map(lambda n, o: jnp.where(finite, n, o).astype(o.dtype),
                         new, factors),
            jnp.where(finite, new_count, stats_count),
            rejected + jnp.where(finite, 0, 1))

  def _powers(self, plan, factors, damping, power, method, previous=None,
              rank=None):
    """Every block's damped factors raised to ``power`` (batched over blocks;
    ``previous``: the inverses in use, where a method starts from them;
    ``rank``: see `linalg.invert_all`)."""
    return linalg.invert_all(
        {key: block.damped(factors[key], damping)
         for key, block in plan.all_blocks().items()},
        method, sharding.stack_sharding(self.mesh), power=power, previous=previous,
        rank=rank)

  def _refresh_inverses(self, plan, factors, old, damping):
    """New inverses, or all the old ones if the damping or any block failed.

    All or nothing, so that every inverse in use has the one damping that
    the state reports. A damping ≤ 0 (e.g. injected at run time) is
    rejected even where its inverse happens to be finite.
    """
    inverses, old_damping, rejected = old
    fresh = self._powers(plan, factors, damping, -1, self.inverse, inverses,
                         self.factor_rank)
    ok = (damping > 0) & jnp.isfinite(damping) & _all_finite(fresh)
    keep = lambda n, o: jnp.where(ok, n, o).astype(o.dtype)
    return (jax.tree.map(keep, fresh, inverses), keep(damping, old_damping),
            rejected + jnp.where(ok, 0, 1))

  def update(self, state: ScaleByKFACState, params: Any, *, batch: Any,
             rng: jax.Array | None = None, variables: dict | None = None,
             damping: Any) -> ScaleByKFACState:
    """Folds in ``batch``'s statistics and refreshes inverses, on schedule.

    Args:
      state: the current state.
      params: the model's params.
      batch: the training batch (its first ``curvature_batch_size`` examples
        when that is set).
      rng: a key (needed for ``estimation="fisher"``/``"curvature_prop"``);
        it also draws the dropout masks of the statistics' pass. None: the
        masks come from ``fold_in(key(0), state.count)``, new each step.
      variables: other collections the model needs (e.g. batch_stats).
      damping: λ for the inverses refreshed now; a refresh with a λ that
        is not a positive finite number is rejected (counted in the state).
    """
    variables = dict(variables or {})
    params = nnx_capture.pure(params)
    batch = self._statistics_batch(batch)
    plan = self._plan(params, batch, variables, list(variables), "batch")
    damping = jnp.asarray(damping, state.damping.dtype)

    # Under `on_schedule`'s lax.cond, XLA:CPU would compile the capture's
    # backward convolutions as plain loops (see `conv_layout`).
    batch_statistics = conv_layout.canonical_convolutions(
        functools.partial(self._batch_statistics, plan))

    if rng is None:  # fresh dropout masks each step, not one fixed mask's bias
      rng = jax.random.fold_in(jax.random.key(0), state.count)

    def with_new_statistics(carry):
      return self._fold_in(*carry, batch_statistics(params, batch, variables, rng))
    factors, stats_count, rejected_statistics = on_schedule(
        self.stats_update_period, state.count, with_new_statistics,
        (state.factors, state.stats_count, state.rejected_statistics))
    inverses, damping, rejected_refreshes = on_schedule(
        self.inverse_update_period, state.count,
        lambda old: self._refresh_inverses(plan, factors, old, damping),
        (state.inverses, state.damping, state.rejected_refreshes))
    return state._replace(
        count=optax.safe_increment(state.count), stats_count=stats_count,
        factors=factors, inverses=inverses, damping=damping,
        rejected_statistics=rejected_statistics,
        rejected_refreshes=rejected_refreshes)

  # -- products -------------------------------------------------------------

  def _apply(self, plan: _Plan, matrices: dict, vector: Any) -> Any:
    """Each block's ``matrices`` applied to its leaves of ``vector``."""
    flat, treedef = flatten(vector)
    out = dict(flat)
    for key, (path, block) in plan.layers.items():
      layer = block.precondition(
          matrices[key], {n: flat[path + (n,)] for n in block.param_names})
      out.update({path + (n,): leaf for n, leaf in layer.items()})
    if plan.fallback is not None:
      diagonal = plan.fallback.precondition(
          matrices[FALLBACK], {k: flat[p] for k, p in plan.fallback_paths.items()})
      out.update({plan.fallback_paths[k]: v for k, v in diagonal.items()})
    return _rebuild(treedef, out)

  def precondition(self, state: ScaleByKFACState, vector: Any) -> Any:
    """``F̂⁻¹ v`` with the stored damped inverses (``vector``: params-shaped).

    Computed in the state's dtype (float32, or float64), then scaled down
    if needed to fit each leaf's dtype; see `precondition_and_count`.
    """
    return self.precondition_and_count(state, vector)[0]

  def precondition_and_count(self, state: ScaleByKFACState,
                             vector: Any) -> tuple[Any, ScaleByKFACState]:
    """`precondition`, and the state with ``rescaled_updates`` counted.

    Where the product's largest entry exceeds 1/16 of the largest finite
    value of its leaf's dtype (float16 with tiny damping), the whole product
    is multiplied by one factor that brings it there. One common positive
    factor keeps K-FAC's direction, with the layers' relative step sizes,
    which rescaling or dropping one block would not; the headroom leaves
    room for a learning rate, momentum and the parameters it is added to.
    Only leaves of a dtype narrower than the product's are checked
    (bfloat16, float16 with float32 curvature): in the product's own dtype
    an entry within 16x of its largest value is a step that no training
    survives either way, and the check is not free. Its scale depends on
    every leaf, so it holds each product back until all are done
    (`benchmarks/preconditioning.py`; RESULTS.md, "Low-rank factor
    inverses").
    """
    given, vector = vector, nnx_capture.pure(vector)
    product = self._apply(self._example_plan(vector), state.inverses, vector)
    scale = 1.0
    for u, v in zip(jax.tree.leaves(product), jax.tree.leaves(vector)):
      if (jnp.issubdtype(v.dtype, jnp.floating)
          and jnp.finfo(v.dtype).max < jnp.finfo(u.dtype).max):
        limit = float(jnp.finfo(v.dtype).max) / 16
        scale = jnp.minimum(scale, limit / jnp.maximum(jnp.max(jnp.abs(u)), limit))
    fitted = jax.tree.map(lambda u, v: (u * scale).astype(v.dtype), product, vector)
    return nnx_capture.like(given, fitted), state._replace(
        rescaled_updates=state.rescaled_updates + jnp.where(scale < 1, 1, 0))

  def multiply(self, state: ScaleByKFACState, vector: Any, *, power: float,
               damping: Any = 0.0) -> Any:
    """``(F̂ + damping)^power v`` from the current factors.

    Per Kronecker block ``(A + π√λ I)^p V (G + √λ/π I)^p`` (``p = 1,
    λ = 0``: ``A V G``, the approximate Fisher itself), per diagonal entry
    ``(F + λ)^p v``. ``p = -1`` is what `precondition` applies after a
    refresh with the same damping; ``p = -1/2`` twice equals ``p = -1``.

    Args:
      state: a state holding factors (e.g. after `update`).
      vector: a params-shaped tree.
      power: the exponent p.
      damping: λ, zero by default.
    """
    given, vector = vector, nnx_capture.pure(vector)
    plan = self._example_plan(vector)
    powered = self._powers(plan, state.factors,
                           jnp.asarray(damping, state.damping.dtype), power, "eigh")
    return nnx_capture.like(given, jax.tree.map(
        lambda u, v: u.astype(v.dtype), self._apply(plan, powered, vector), vector))

  def output_tangents(self, params: Any, batch: Any, vectors: Any,
                      variables: dict | None = None, rng: jax.Array | None = None):
    """``(outputs, J v for each v)``: the model output and its directional
    derivatives along a stack of params-shaped ``vectors`` (leading axis)."""
    model = lambda p: self.forward(p, batch, variables, rng)
    outputs, push = jax.linearize(model, params)
    return outputs, jax.vmap(push)(vectors)

  def output_fisher(self, outputs: Any, batch: Any, tangents: jax.Array) -> jax.Array:
    """``(1/L) F_out u`` per term for output tangents ``u`` (``outputs``'
    shape, after any leading axes of a stack of them), each term weighted
    by the loss mask: masked terms zero."""
    terms = self.loss.terms(outputs, batch)
    product = self.loss.fisher_product(outputs, tangents)
    if terms.mask is not None:  # the terms' axes are the last but one
      product = product * terms.mask[..., None]
    return product / terms.count

  def exact_product(self, params: Any, batch: Any, vector: Any,
                    variables: dict | None = None, rng: jax.Array | None = None):
    """The exact Fisher-vector product ``F v = (1/L) Σ_terms Jᵀ F_out J v``.

    For the losses here (exponential families in their natural parameters)
    the Fisher equals the generalised Gauss-Newton matrix. One linearised
    forward pass and one backward pass; no matrix is formed.
    """
    model = lambda p: self.forward(p, batch, variables, rng)
    outputs, tangent = jax.jvp(model, (params,), (vector,))
    _, pull = jax.vjp(model, params)
    return pull(self.output_fisher(outputs, batch, tangent).astype(outputs.dtype))[0]
