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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_optax import blocks
from kfac_optax import capture
from kfac_optax import checks
from kfac_optax import layouts
from kfac_optax import linalg
from kfac_optax import losses
from kfac_optax import sharding

Path = tuple[str, ...]
FALLBACK = "<diagonal>"  # state key of the diagonal fallback block
_OVERRIDES = ("skip", "diagonal", "independent", *blocks.SERIES_OPTIONS)


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

  def all_blocks(self) -> dict[str, Any]:
    found = {key: block for key, (_, block) in self.layers.items()}
    if self.fallback is not None:
      found[FALLBACK] = self.fallback
    return found


def _key(path: Path) -> str:
  return "/".join(path)


def flatten(tree: Any) -> tuple[dict[Path, Any], Any]:
  """A tree -> ({leaf path: leaf}, treedef), leaf paths as tuples of str."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
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
  if not isinstance(batch, (tuple, list)):
    raise TypeError(
        "the default `inputs` reads batch[0], but the batch is a "
        f"{type(batch).__name__}; pass inputs=lambda batch: ... to "
        "scale_by_kfac/kfac (returning apply_fn's positional input, or a "
        "tuple of them)")
  return batch[0]


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


def _all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.array(
      [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def on_schedule(period: Any, count: jax.Array, refresh: Callable[[Any], Any],
                current: Any) -> Any:
  """``refresh(current)`` when ``count % period == 0``, else ``current``.

  A static period of 1 skips the `lax.cond`, so XLA sees the work
  unconditionally and can share it with the user's own forward pass.
  """
  if isinstance(period, int) and period == 1:
    return refresh(current)
  return jax.lax.cond(count % period == 0, refresh, lambda c: c, current)


@dataclasses.dataclass(frozen=True, eq=False)
class Curvature:
  """The K-FAC curvature of a flax model; see `transform.scale_by_kfac`.

  Attributes mirror `scale_by_kfac`'s arguments (``damping`` excepted: it is
  passed to `update` and the products, so that callers can adapt it).

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
  inverse: str = "eigh"
  num_samples: int = 1
  apply_kwargs: dict[str, Any] | None = None
  layer_overrides: dict[str, str] | None = None
  mesh: jax.sharding.Mesh | None = None

  def __post_init__(self):
    if self.estimation not in losses.ESTIMATIONS:
      raise ValueError(f"estimation must be one of {losses.ESTIMATIONS}, "
                       f"got {self.estimation!r}")
    if self.inverse not in linalg.INVERSE_METHODS:
      raise ValueError(f"inverse must be one of {linalg.INVERSE_METHODS}, "
                       f"got {self.inverse!r}")
    checks.in_range("ema_decay", self.ema_decay, 0.0, 1.0, high_open=True)
    checks.count("inverse_update_period", self.inverse_update_period, 1)
    checks.count("stats_update_period", self.stats_update_period, 1)
    if not isinstance(self.num_samples, int) or self.num_samples < 1:
      raise ValueError(
          f"num_samples must be a positive Python int, got {self.num_samples!r}; "
          "with optax.inject_hyperparams, list it in static_args")
    for pattern, choice in (self.layer_overrides or {}).items():
      if choice not in _OVERRIDES:
        raise ValueError(f"layer_overrides[{pattern!r}] must be one of "
                         f"{_OVERRIDES}, got {choice!r}")

  # -- the model ------------------------------------------------------------

  def _model_args(self, batch: Any) -> tuple:
    found = (self.inputs or _first_element)(batch)
    return found if isinstance(found, tuple) else (found,)

  def _call_kwargs(self, rng: jax.Array | None) -> dict[str, Any]:
    key = jax.random.key(0) if rng is None else rng
    return {**(self.apply_kwargs or {}), "rngs": {"dropout": key}}

  def forward(self, params: Any, batch: Any, variables: dict | None = None,
              rng: jax.Array | None = None) -> Any:
    """The model output on ``batch`` (other collections' changes discarded)."""
    variables = dict(variables or {})
    out = self.apply_fn({"params": params, **variables}, *self._model_args(batch),
                        mutable=list(variables) or False, **self._call_kwargs(rng))
    return out[0] if variables else out

  def loss_value(self, params: Any, batch: Any, variables: dict | None = None,
                 rng: jax.Array | None = None) -> jax.Array:
    """The training loss ``loss.value`` of the model on ``batch``."""
    return self.loss.value(self.forward(params, batch, variables, rng), batch)

  def _override_for(self, path: Path) -> str | None:
    name = _key(path)
    return next((choice for pattern, choice in (self.layer_overrides or {}).items()
                 if fnmatch.fnmatchcase(name, pattern)), None)

  def _plan(self, params, batch, variables, mutable, what) -> _Plan:
    try:
      discovered = capture.discover(
          self.apply_fn, {"params": params, **variables}, self._model_args(batch),
          self._call_kwargs(None), mutable)
    except Exception as error:  # re-raised with the fix named
      if "params" in params:
        raise ValueError(
            "scale_by_kfac got the whole variables dict as params: pass the "
            "'params' collection, variables['params'] (other collections go "
            "in update(..., variables=...))") from error
      raise ValueError(
          f"scale_by_kfac could not run apply_fn on {what}: "
          f"{type(error).__name__}: {error}\nFix: {what} must have the "
          "structure of a training batch, `inputs=` must map it to "
          "apply_fn's positional input(s) (default batch[0]), constant call "
          "keywords go in apply_kwargs=, and other variable collections "
          "(e.g. batch_stats) in update(..., variables=...).") from error
    flat_params, _ = flatten(params)
    _check_real_floating(flat_params)
    perturbations = capture.by_layer(discovered.perturbations)
    layers, owned = {}, set()
    for path, layout in discovered.layouts.items():
      override = self._override_for(path)
      layer_params = {key[-1]: leaf for key, leaf in flat_params.items()
                      if key[:-1] == path}
      if override == "skip":
        owned.update(path + (name,) for name in layer_params)
      if override in ("skip", "diagonal"):
        continue
      if path not in discovered.num_calls:
        raise capture.not_threaded_error(path)
      stack, time = _lifted_axes(
          discovered.output_shapes[path], perturbations[path][0].shape,
          layer_params, discovered.param_shapes[path])
      block = blocks.block_for(layout, layer_params, stack,
                               discovered.other_methods.get(path, ()),
                               _series_option(path, override, time, layout), time)
      layers[_key(path)] = (path, block)
      owned.update(path + (name,) for name in block.param_names)
    fallback_paths = {_key(k): k for k in flat_params if k not in owned}
    fallback = blocks.DiagonalBlock(
        {key: jnp.shape(flat_params[path])
         for key, path in fallback_paths.items()}) if fallback_paths else None
    return _Plan(layers, fallback, fallback_paths, discovered.perturbations)

  def _example_plan(self, params: Any) -> _Plan:
    # mutable=True lets flax create collections such as batch_stats that the
    # example batch needs and the caller does not have.
    return self._plan(params, self.example_batch, {}, True, "example_batch")

  # -- state ----------------------------------------------------------------

  def init(self, params: Any) -> ScaleByKFACState:
    """Zero statistics and identity inverses for every block of the model."""
    factors, inverses = {}, {}
    dtype = linalg.curvature_dtype(params)
    for key, block in self._example_plan(params).all_blocks().items():
      factors[key], inverses[key] = jax.tree.map(lambda x: x.astype(dtype),
                                                 block.init())
    # Distinct buffers: a state passed with donate_argnums must not alias.
    counters = [jnp.zeros([], jnp.int32) for _ in range(5)]
    return ScaleByKFACState(*counters[:2], factors, inverses,
                            jnp.full([], jnp.nan, dtype), *counters[2:])

  def _batch_statistics(self, plan, params, batch, variables, rng):
    flat_params, treedef = flatten(params)
    sample_key, model_key = jax.random.split(
        jax.random.key(0) if rng is None else rng)
    run = capture.hooked_apply(self.apply_fn, self._model_args(batch),
                               self._call_kwargs(model_key),
                               [*variables, capture.INPUTS])

    def model(fallback_leaves, perturbations):
      paths = {plan.fallback_paths[k]: leaf for k, leaf in fallback_leaves.items()}
      full = _rebuild(treedef, {**flat_params, **paths})
      outputs, collections = run(
          {"params": full, **variables, capture.PERTURBATIONS: perturbations})
      return outputs, collections[capture.INPUTS]

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

  def _powers(self, plan, factors, damping, power, method):
    """Every block's damped factors raised to ``power`` (batched over blocks)."""
    return linalg.invert_all(
        {key: block.damped(factors[key], damping)
         for key, block in plan.all_blocks().items()},
        method, sharding.stack_sharding(self.mesh), power=power)

  def _refresh_inverses(self, plan, factors, old, damping):
    """New inverses, or all the old ones if the damping or any block failed.

    All or nothing, so that every inverse in use has the one damping that
    the state reports. A damping ≤ 0 (e.g. injected at run time) is
    rejected even where its inverse happens to be finite.
    """
    inverses, old_damping, rejected = old
    fresh = self._powers(plan, factors, damping, -1, self.inverse)
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
      batch: the training batch.
      rng: a key (needed for ``estimation="fisher"``/``"curvature_prop"``).
      variables: other collections the model needs (e.g. batch_stats).
      damping: λ for the inverses refreshed now; a refresh with a λ that
        is not a positive finite number is rejected (counted in the state).
    """
    variables = dict(variables or {})
    plan = self._plan(params, batch, variables, list(variables), "batch")
    damping = jnp.asarray(damping, state.damping.dtype)

    def with_new_statistics(carry):
      return self._fold_in(*carry, self._batch_statistics(
          plan, params, batch, variables, rng))
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
    """
    product = self._apply(self._example_plan(vector), state.inverses, vector)
    scale = 1.0
    for u, v in zip(jax.tree.leaves(product), jax.tree.leaves(vector)):
      if jnp.issubdtype(v.dtype, jnp.floating):
        limit = float(jnp.finfo(v.dtype).max) / 16
        scale = jnp.minimum(scale, limit / jnp.maximum(jnp.max(jnp.abs(u)), limit))
    fitted = jax.tree.map(lambda u, v: (u * scale).astype(v.dtype), product, vector)
    return fitted, state._replace(
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
    plan = self._example_plan(vector)
    powered = self._powers(plan, state.factors,
                           jnp.asarray(damping, state.damping.dtype), power, "eigh")
    return jax.tree.map(lambda u, v: u.astype(v.dtype),
                        self._apply(plan, powered, vector), vector)

  def output_tangents(self, params: Any, batch: Any, vectors: Any,
                      variables: dict | None = None, rng: jax.Array | None = None):
    """``(outputs, J v for each v)``: the model output and its directional
    derivatives along a stack of params-shaped ``vectors`` (leading axis)."""
    model = lambda p: self.forward(p, batch, variables, rng)
    outputs, push = jax.linearize(model, params)
    return outputs, jax.vmap(push)(vectors)

  def output_fisher(self, outputs: Any, batch: Any, tangents: jax.Array) -> jax.Array:
    """``(1/L) F_out u`` per term for output tangents ``u``, masked terms zero."""
    terms = self.loss.terms(outputs, batch)
    product = self.loss.fisher_product(outputs, tangents)
    mask = terms.mask_for(product.shape)
    return (product if mask is None else product * mask) / terms.count

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
