"""`scale_by_kfac`, the K-FAC preconditioner as an optax transformation.

Data flow of one ``update`` (DESIGN.md section 2): capture layer inputs and
output gradients on the batch, fold batch statistics into a debiased EMA,
refresh damped inverses on schedule, precondition every gradient leaf.
"""

import fnmatch
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from kfac_optax import blocks
from kfac_optax import capture
from kfac_optax import linalg
from kfac_optax import losses
from kfac_optax import sharding

Path = tuple[str, ...]
FALLBACK = "<diagonal>"  # state key of the diagonal fallback block
_OVERRIDES = ("skip", "diagonal")


class ScaleByKFACState(NamedTuple):
  """State of `scale_by_kfac`.

  Attributes:
    count: updates so far (``t`` of DESIGN.md; 0 on the first update).
    stats_count: statistics updates folded into ``factors`` so far.
    factors: block key -> debiased EMA of the block's statistics:
      `blocks.KroneckerFactors` ``(A, G)`` for a layer (key: its module path
      joined by "/"), ``{leaf path: F}`` for the diagonal fallback (key
      ``"<diagonal>"``).
    inverses: block key -> damped inverses from the last refresh, same layout.
  """
  count: jax.Array
  stats_count: jax.Array
  factors: dict[str, Any]
  inverses: dict[str, Any]


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


def _flatten(tree: Any) -> tuple[dict[Path, Any], Any]:
  """A tree -> ({leaf path: leaf}, treedef), leaf paths as tuples of str."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
  def name(entry):
    for attribute in ("key", "name", "idx"):
      if hasattr(entry, attribute):
        return str(getattr(entry, attribute))
    return str(entry)
  return {tuple(name(e) for e in path): leaf for path, leaf in pairs}, treedef


def _rebuild(treedef: Any, flat: dict[Path, Any]) -> Any:
  """Inverse of `_flatten` (``flat`` must keep `_flatten`'s key order)."""
  return treedef.unflatten(list(flat.values()))


def _first_element(batch: Any) -> Any:
  if not isinstance(batch, (tuple, list)):
    raise TypeError(
        "the default `inputs` reads batch[0], but the batch is a "
        f"{type(batch).__name__}; pass inputs=lambda batch: ... to "
        "scale_by_kfac/kfac (returning apply_fn's positional input, or a "
        "tuple of them)")
  return batch[0]


def _stack_shape(inside: tuple, outside: tuple, layer_params: dict) -> tuple:
  """Leading axes a lifted transform added that the layer's params share too.

  ``inside`` is the layer output's shape as the layer saw it, ``outside`` the
  shape of its collected perturbation. Extra leading axes on both the
  collections and every param (nn.scan layer stacks) make one block per
  slice; extra axes the params lack (nn.RNN over time) are just more rows.
  """
  extra = outside[:len(outside) - len(inside)]
  shared = all(jnp.shape(p)[:len(extra)] == extra for p in layer_params.values())
  return extra if shared else ()


def _value_at(hyperparameter: Any, count: jax.Array) -> jax.Array:
  return hyperparameter(count) if callable(hyperparameter) else hyperparameter


def _all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.array(
      [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def scale_by_kfac(
    apply_fn: Callable[..., Any],
    loss: losses.PredictiveLoss,
    *,
    example_batch: Any,
    inputs: Callable[[Any], Any] | None = None,
    damping: optax.ScalarOrSchedule = 1e-3,
    ema_decay: float = 0.95,
    inverse_update_period: int = 5,
    stats_update_period: int = 1,
    estimation: str = "fisher",
    inverse: str = "eigh",
    num_samples: int = 1,
    apply_kwargs: dict[str, Any] | None = None,
    layer_overrides: dict[str, str] | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Preconditions gradients with K-FAC's damped Kronecker-factored Fisher.

  Every ``nn.Dense`` call in the model gets a Kronecker block ``A ⊗ G``;
  every other parameter a diagonal block. With ``V = [∇W; ∇b]``:

  .. math::
    A = \\mathbb{E}[\\bar a \\bar a^T],\\quad
    G = \\tfrac{1}{L}\\textstyle\\sum g g^T,\\quad
    U = (A + π\\sqrt{λ} I)^{-1} V (G + \\sqrt{λ}/π I)^{-1}

  with ``ā = [a, 1]`` (bias last), ``g`` the gradient of the summed
  per-term NLL with respect to the layer output, L the number of loss terms
  and ``π = sqrt((tr A / dim A) / (tr G / dim G))``. ``A`` and ``G`` are
  debiased EMAs of batch estimates (equal to the batch estimate after the
  first statistics update). Statistics are folded in when
  ``count % stats_update_period == 0``, then inverses are refreshed when
  ``count % inverse_update_period == 0``; both on the first update.

  The returned direction has no learning rate: chain it with momentum and
  ``-learning_rate`` (see `kfac`), or any optax transforms.

  Args:
    apply_fn: the flax apply function, e.g. ``model.apply``.
    loss: the model's predictive distribution, a `kfac_optax.losses` loss.
    example_batch: a batch (or tree of ``jax.ShapeDtypeStruct``) with the
      structure of a training batch; traced once in ``init`` to find layers.
    inputs: batch -> apply_fn's positional input (or tuple of them);
      default ``batch[0]`` for tuple/list batches.
    damping: Tikhonov λ (``F + λI``), a float or a schedule of the count.
    ema_decay: ρ of the debiased EMA of the statistics, in [0, 1).
    inverse_update_period: refresh damped inverses every this many updates.
    stats_update_period: fold in statistics every this many updates.
    estimation: how output gradients are drawn: ``"fisher"`` (targets
      sampled from the model, needs ``rng``), ``"empirical"`` (batch
      targets), ``"exact"`` (one backward pass per output dimension).
    inverse: ``"eigh"`` or ``"cholesky"``.
    num_samples: target draws per example for ``"fisher"``.
    apply_kwargs: constant keyword arguments for ``apply_fn`` (e.g.
      ``{"train": True}``).
    layer_overrides: ``{path pattern: "skip" | "diagonal"}``, patterns in
      `fnmatch` syntax over module paths joined by "/" (e.g. ``"encoder/*"``);
      the first matching pattern wins. ``"skip"`` leaves the layer's
      gradients unpreconditioned; ``"diagonal"`` gives its params the
      diagonal block instead of their structured one.
    mesh: devices to spread the inverse refresh over. Factor matrices of
      similar size are stacked (`linalg.invert_all`) and each stack is split
      over all mesh axes, so each of N devices inverts about 1/N of them,
      then the inverses are all-gathered. Default: the context mesh
      (``jax.set_mesh``) if any, else no distribution.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` takes
    ``(grads, state, params, *, batch, rng=None, variables=None)``. ``variables``
    holds other collections the model needs (e.g. ``{"batch_stats": ...}``);
    they are mutable in K-FAC's pass and its changes to them are discarded.
    ``rng`` also seeds the ``"dropout"`` stream of K-FAC's pass.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, kfac_optax
    >>> model = nn.Dense(3)
    >>> batch = (jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32))
    >>> params = model.init(jax.random.key(0), batch[0])["params"]
    >>> tx = kfac_optax.scale_by_kfac(
    ...     model.apply, kfac_optax.losses.softmax_cross_entropy(),
    ...     example_batch=batch, estimation="empirical")
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params, batch=batch)

  References:
    Martens & Grosse, "Optimizing Neural Networks with Kronecker-factored
    Approximate Curvature", ICML 2015.
  """
  if estimation not in losses.ESTIMATIONS:
    raise ValueError(
        f"estimation must be one of {losses.ESTIMATIONS}, got {estimation!r}")
  if inverse not in linalg.INVERSE_METHODS:
    raise ValueError(
        f"inverse must be one of {linalg.INVERSE_METHODS}, got {inverse!r}")
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(
        f"num_samples must be a positive Python int, got {num_samples!r}; "
        "with optax.inject_hyperparams, list it in static_args")
  get_inputs = inputs or _first_element
  apply_kwargs = dict(apply_kwargs or {})
  layer_overrides = dict(layer_overrides or {})
  for pattern, choice in layer_overrides.items():
    if choice not in _OVERRIDES:
      raise ValueError(f"layer_overrides[{pattern!r}] must be one of "
                       f"{_OVERRIDES}, got {choice!r}")

  def override_for(path):
    name = _key(path)
    return next((choice for pattern, choice in layer_overrides.items()
                 if fnmatch.fnmatchcase(name, pattern)), None)

  def model_args(batch):
    found = get_inputs(batch)
    return found if isinstance(found, tuple) else (found,)

  def make_plan(params, batch, variables, mutable, what):
    try:
      discovered = capture.discover(
          apply_fn, {"params": params, **variables}, model_args(batch),
          {**apply_kwargs, "rngs": {"dropout": jax.random.key(0)}}, mutable)
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
    flat_params, _ = _flatten(params)
    perturbations = capture.by_layer(discovered.perturbations)
    layers, owned = {}, set()
    for path, layout in discovered.layouts.items():
      override = override_for(path)
      layer_params = {key[-1]: leaf for key, leaf in flat_params.items()
                      if key[:-1] == path}
      if override == "skip":
        owned.update(path + (name,) for name in layer_params)
      if override is not None:
        continue
      if path not in discovered.num_calls:
        raise capture.not_threaded_error(path)
      block = blocks.block_for(layout, layer_params, _stack_shape(
          discovered.output_shapes[path], perturbations[path][0].shape,
          layer_params), discovered.other_methods.get(path, ()))
      layers[_key(path)] = (path, block)
      owned.update(path + (name,) for name in block.param_names)
    fallback_paths = {_key(k): k for k in flat_params if k not in owned}
    fallback = blocks.DiagonalBlock(
        {key: jnp.shape(flat_params[path])
         for key, path in fallback_paths.items()}) if fallback_paths else None
    return _Plan(layers, fallback, fallback_paths, discovered.perturbations)

  def init_fn(params):
    # mutable=True lets flax create collections such as batch_stats that the
    # example batch needs and init's caller does not have.
    plan = make_plan(params, example_batch, {}, True, "example_batch")
    factors, inverses = {}, {}
    for key, block in plan.all_blocks().items():
      factors[key], inverses[key] = block.init()
    # Two distinct buffers: a state passed with donate_argnums must not alias.
    return ScaleByKFACState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32),
                            factors, inverses)

  def batch_statistics(plan, params, batch, variables, rng):
    flat_params, treedef = _flatten(params)
    sample_key, model_key = jax.random.split(
        jax.random.key(0) if rng is None else rng)
    run = capture.hooked_apply(
        apply_fn, model_args(batch),
        {**apply_kwargs, "rngs": {"dropout": model_key}},
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
            loss, outputs, batch, estimation, sample_key, num_samples))
    terms = loss.terms(captured.outputs, batch)
    stats = {}
    for key, (path, block) in plan.layers.items():
      other_calls = {method: (inputs[path], grads[path]) for method, (inputs, grads)
                     in captured.other_methods.items() if path in inputs}
      stats[key] = block.statistics(captured.inputs[path],
                                    captured.output_grads[path], terms, **other_calls)
    if plan.fallback is not None:
      stats[FALLBACK] = plan.fallback.statistics(captured.primal_grads, terms)
    return stats

  def fold_in(factors, stats_count, batch_stats):
    """Debiased EMA: D_t = D_{t-1} + (1-ρ)/(1-ρ^t) (B_t - D_{t-1})."""
    new_count = stats_count + 1
    weight = (1.0 - ema_decay) / (1.0 - jnp.power(ema_decay, new_count))
    new = jax.tree.map(lambda old, b: old + weight * (b - old), factors, batch_stats)
    finite = _all_finite(batch_stats)  # non-finite statistics never enter
    return (jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, factors),
            jnp.where(finite, new_count, stats_count))

  def refresh_inverses(plan, factors, old_inverses, damping_now):
    fresh = linalg.invert_all(
        {key: block.damped(factors[key], damping_now)
         for key, block in plan.all_blocks().items()},
        inverse, sharding.stack_sharding(mesh))
    for key, new in fresh.items():
      ok = _all_finite(new)  # a failed factorisation keeps the last inverse
      fresh[key] = jax.tree.map(lambda n, o, ok=ok: jnp.where(ok, n, o),
                                new, old_inverses[key])
    return fresh

  def update_fn(updates, state, params=None, *, batch=None, rng=None,
                variables=None, **extra_args):
    del extra_args  # optax.chain forwards every member's keywords
    if batch is None:
      raise TypeError(
          "scale_by_kfac's update needs the training batch: call "
          "tx.update(grads, state, params, batch=batch, rng=rng), or "
          "kfac_optax.TrainState.apply_gradients(grads=..., batch=..., rng=...)")
    if params is None:
      raise TypeError("scale_by_kfac's update needs params: "
                      "tx.update(grads, state, params, batch=batch, rng=rng)")
    if estimation == "fisher" and rng is None:
      raise TypeError(
          'estimation="fisher" samples targets from the model and needs '
          "rng=: pass a fresh jax.random key each step (or use "
          'estimation="empirical" or "exact")')
    variables = dict(variables or {})
    explicit = _explicit_mesh_axes()
    if not explicit:
      return update_with(updates, state, params, batch, variables, rng)
    # Under Explicit mesh axes every reshape, scan or contraction over the
    # batch-sharded axis (in the model's own layers too) would need its output
    # sharding named. K-FAC's pass runs with those axes made Auto instead, so
    # XLA propagates shardings (and all-reduces the statistics) as under Auto
    # axes; the updates and the state keep their shardings.
    out_sharding = jax.tree.map(lambda x: jax.typeof(x).sharding.spec,
                                (updates, state))
    return jax.sharding.auto_axes(update_with, axes=explicit,
                                  out_sharding=out_sharding)(
                                      updates, state, params, batch, variables, rng)

  def update_with(updates, state, params, batch, variables, rng):
    plan = make_plan(params, batch, variables, list(variables), "batch")
    damping_now = jnp.asarray(_value_at(damping, state.count), jnp.float32)

    def with_new_statistics(carry):
      factors, stats_count = carry
      return fold_in(factors, stats_count,
                     batch_statistics(plan, params, batch, variables, rng))
    factors, stats_count = _on_schedule(
        stats_update_period, state.count, with_new_statistics,
        (state.factors, state.stats_count))
    inverses = _on_schedule(
        inverse_update_period, state.count,
        lambda old: refresh_inverses(plan, factors, old, damping_now),
        state.inverses)

    flat_updates, treedef = _flatten(updates)
    new_updates = dict(flat_updates)
    for key, (path, block) in plan.layers.items():
      layer = block.precondition(
          inverses[key], {n: flat_updates[path + (n,)] for n in block.param_names})
      new_updates.update({path + (n,): leaf for n, leaf in layer.items()})
    if plan.fallback is not None:
      diagonal = plan.fallback.precondition(
          inverses[FALLBACK],
          {k: flat_updates[p] for k, p in plan.fallback_paths.items()})
      new_updates.update({plan.fallback_paths[k]: v for k, v in diagonal.items()})
    new_state = ScaleByKFACState(
        optax.safe_increment(state.count), stats_count, factors, inverses)
    return _rebuild(treedef, new_updates), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _explicit_mesh_axes() -> tuple[str, ...]:
  """The context mesh's axes of type Explicit (``jax.make_mesh``'s default)."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == jax.sharding.AxisType.Explicit)


def _on_schedule(period: Any, count: jax.Array, refresh: Callable[[Any], Any],
                 current: Any) -> Any:
  """``refresh(current)`` when ``count % period == 0``, else ``current``.

  A static period of 1 skips the `lax.cond`, so XLA sees the capture pass
  unconditionally and can share its work with the user's own forward pass.
  """
  if isinstance(period, int) and period == 1:
    return refresh(current)
  return jax.lax.cond(count % period == 0, refresh, lambda c: c, current)


def kfac(
    apply_fn: Callable[..., Any],
    loss: losses.PredictiveLoss,
    *,
    example_batch: Any,
    learning_rate: optax.ScalarOrSchedule,
    momentum: optax.ScalarOrSchedule = 0.9,
    inputs: Callable[[Any], Any] | None = None,
    damping: optax.ScalarOrSchedule = 1e-3,
    ema_decay: float = 0.95,
    inverse_update_period: int = 5,
    stats_update_period: int = 1,
    estimation: str = "fisher",
    inverse: str = "eigh",
    num_samples: int = 1,
    apply_kwargs: dict[str, Any] | None = None,
    layer_overrides: dict[str, str] | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> optax.GradientTransformationExtraArgs:
  """K-FAC with momentum and a learning rate: the optimizer to drop in.

  ``optax.chain(scale_by_kfac(...), trace(decay=momentum), -learning_rate)``:
  the update is ``-lr · m_t`` with ``m_t = momentum · m_{t-1} + U_t`` and
  ``U_t`` the K-FAC preconditioned gradient. The arguments are spelled out
  (no ``**kwargs``) so that ``optax.inject_hyperparams(kfac, static_args=
  ("apply_fn", "num_samples"))`` can inject any of them.

  Args:
    apply_fn: the flax apply function, e.g. ``model.apply``.
    loss: the model's predictive distribution (`kfac_optax.losses`).
    example_batch: see `scale_by_kfac`.
    learning_rate: a float or a schedule of the step.
    momentum: a float or a schedule of the step (0 disables momentum).
    inputs: see `scale_by_kfac`.
    damping: see `scale_by_kfac`.
    ema_decay: see `scale_by_kfac`.
    inverse_update_period: see `scale_by_kfac`.
    stats_update_period: see `scale_by_kfac`.
    estimation: see `scale_by_kfac`.
    inverse: see `scale_by_kfac`.
    num_samples: see `scale_by_kfac`.
    apply_kwargs: see `scale_by_kfac`.
    layer_overrides: see `scale_by_kfac`.
    mesh: see `scale_by_kfac`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs
    ``batch=`` (and ``rng=`` for ``estimation="fisher"``).
  """
  return optax.chain(
      scale_by_kfac(
          apply_fn, loss, example_batch=example_batch, inputs=inputs,
          damping=damping, ema_decay=ema_decay,
          inverse_update_period=inverse_update_period,
          stats_update_period=stats_update_period, estimation=estimation,
          inverse=inverse, num_samples=num_samples, apply_kwargs=apply_kwargs,
          layer_overrides=layer_overrides, mesh=mesh),
      optax.inject_hyperparams(optax.trace)(decay=momentum),
      optax.scale_by_learning_rate(learning_rate))
