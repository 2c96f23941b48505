"""K-FAC's curvature estimate of one model: statistics, inverses, products.

`Curvature` holds everything static about a model's curvature (its options,
the model and its loss) and works on a `state.ScaleByKFACState`:

- `Curvature.update`: capture layer inputs and output gradients on a batch,
  fold the batch statistics into a debiased EMA, refresh damped inverses on
  schedule (docs/design.md, "Data flow of one update");
- `Curvature.precondition`: ``F̂⁻¹ v`` with the stored damped inverses;
- `Curvature.multiply`: ``(F̂ + damping)^p v`` for any power ``p`` (the
  approximate Fisher, its damped inverse and inverse square root);
- `Curvature.exact_product`: the exact Fisher (= GGN for the losses here)
  times a vector on a batch, by forward-mode differentiation.

Which block owns which params is the model's `plan`, found by tracing it;
how the model is called is `model_call`. `optimizer.scale_by_kfac` and
`optimizer.kfac` wrap `Curvature` as optax transformations; it is public
for users who want the products themselves.
"""

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from kfac_optax._src import linalg
from kfac_optax._src import losses
from kfac_optax._src import param_boxes
from kfac_optax._src import tree_paths
from kfac_optax._src.blocks import kronecker
from kfac_optax._src.curvature import block_stacks
from kfac_optax._src.curvature import canonical_convolutions
from kfac_optax._src.curvature import explicit_axes
from kfac_optax._src.curvature import model_call
from kfac_optax._src.curvature import options
from kfac_optax._src.curvature import owner_statistics
from kfac_optax._src.curvature import plan as plans
from kfac_optax._src.curvature import reach
from kfac_optax._src.curvature import replicas
from kfac_optax._src.curvature import sub_batch
from kfac_optax._src.curvature import summary
from kfac_optax._src.curvature import tile_placement
from kfac_optax._src.curvature.state import FALLBACK
from kfac_optax._src.curvature.state import ScaleByKFACState
from kfac_optax._src.models import capture
from kfac_optax._src.models import front_end


def _all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.array(
      [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)]))


def on_schedule(period: Any, warmup: Any, count: jax.Array,
                refresh: Callable[[Any], Any], current: Any) -> Any:
  """``refresh(current)`` when ``count % period == 0`` or ``count < warmup``,
  else ``current``.

  A static period of 1 skips the `lax.cond`, so XLA sees the work
  unconditionally and can share it with the user's own forward pass.
  """
  if isinstance(period, int) and period == 1:
    return refresh(current)
  due = (count % period == 0) | (count < warmup)
  return jax.lax.cond(due, refresh, lambda c: c, current)


def _placement(mesh: Any) -> linalg.StackSharding | None:
  """How the stacks of `block_stacks` are split: over ``mesh``, each device
  keeping its share (None on one device)."""
  sharding = linalg.stack_sharding(mesh)
  return None if sharding is None else dataclasses.replace(sharding, gather=False)


def fold_in(ema_decay: float, factors: Any, stats_count: jax.Array,
          rejected: jax.Array, batch_stats: Any) -> tuple[Any, jax.Array, jax.Array]:
  """Debiased EMA: D_t = D_{t-1} + (1-ρ)/(1-ρ^t) (B_t - D_{t-1})."""
  new_count = stats_count + 1
  weight = (1.0 - ema_decay) / (1.0 - jnp.power(ema_decay, new_count))
  new = jax.tree.map(lambda old, b: old + weight * (b - old), factors, batch_stats)
  finite = _all_finite(batch_stats)  # non-finite statistics never enter
  return (jax.tree.map(lambda n, o: jnp.where(finite, n, o).astype(o.dtype),
                       new, factors),
          jnp.where(finite, new_count, stats_count),
          rejected + jnp.where(finite, 0, 1))


@dataclasses.dataclass(frozen=True, eq=False)
class Curvature(options.CurvatureOptions):
  """The K-FAC curvature of a flax model; see `optimizer.scale_by_kfac`.

  Its options are `options.CurvatureOptions` (keyword-only); ``damping`` is
  not one: it is passed to `update` and the products, so that callers can
  adapt it. An
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

  def __post_init__(self):
    # An nnx.Module runs through its own front-end (see `nnx_capture`).
    object.__setattr__(self, "apply_fn", front_end.front_end(self.apply_fn))
    if not isinstance(self.loss, losses.PredictiveLoss):
      raise TypeError(
          "loss must be a kfac_optax.losses predictive distribution, e.g. "
          "kfac_optax.losses.softmax_cross_entropy() for integer labels, got "
          f"{self.loss!r}: K-FAC samples targets from it and needs its output "
          "Fisher, which a loss function such as optax's does not give")
    super().__post_init__()

  # -- the model ------------------------------------------------------------

  @functools.cached_property
  def model(self) -> model_call.ModelCall:
    """How K-FAC calls the model (see `model_call`)."""
    return model_call.ModelCall(self.apply_fn, self.inputs, self.outputs,
                                self.apply_kwargs, self.loss.num_outputs)

  def forward(self, params: Any, batch: Any, variables: dict | None = None,
              rng: jax.Array | None = None) -> Any:
    """The model output on ``batch``, selected by ``outputs=`` (other
    collections' changes discarded)."""
    return self.model.forward(param_boxes.values(params), batch, variables, rng)

  def batch_loss(self, outputs: Any, batch: Any) -> jax.Array:
    """The training loss ``loss.value`` of the model's ``outputs`` on
    ``batch``, averaged over the replicas (`over_replicas`): the whole
    batch's."""
    return self.over_replicas(self.loss.value(outputs, batch))

  def declared_specs(self, params: Any) -> Any:
    """The params' PartitionSpecs as their partitioning metadata declares
    them (`param_boxes.specs`): their boxes', else an NNX model's own
    Variables' (None where none)."""
    found = param_boxes.specs(params)
    if param_boxes.declares_any(found):
      return found
    return getattr(self.apply_fn, "declared_specs", None)

  def _plan(self, params, batch, variables, mutable, what) -> plans.Plan:
    return plans.make(self.model, self.loss, self, params, batch, variables,
                      mutable, what)

  def _example_plan(self, params: Any) -> plans.Plan:
    # mutable=True lets flax create collections such as batch_stats that the
    # example batch needs and the caller does not have (`_discover`).
    with explicit_axes.params_mesh(params):
      return self._plan(params, self.example_batch, {}, True, "example_batch")

  # -- state ----------------------------------------------------------------

  def describe(self, params: Any) -> summary.Summary:
    """The block of every module of the model (see `kfac_optax.describe`)."""
    params = param_boxes.values(params)
    return self._summary(self._example_plan(params), params)

  def _summary(self, plan: plans.Plan, params: Any) -> summary.Summary:
    flat_params, _ = tree_paths.flatten(params)
    return summary.summarize(
        plan.layers, plan.fallback_paths,
        {path: jnp.shape(leaf) for path, leaf in flat_params.items()},
        self.override_for, self.factor_rank)

  def init(self, params: Any) -> ScaleByKFACState:
    """Zero statistics and identity inverses for every block of the model.

    Warns (`summary.FallbackWarning`) when more than half of the parameters
    fall to the diagonal fallback.
    """
    factors, inverses = {}, {}
    declared, params = self.declared_specs(params), param_boxes.values(params)
    plans.check_not_masked(params)
    dtype = linalg.curvature_dtype(params)
    plan = self._example_plan(params)
    with explicit_axes.params_mesh(params):
      reach.check(self.model, plan, params, self.example_batch,
                  replicas.names(self.axis_name))
    sub_batch.check_model_runs(self, params, self.curvature_batch_size,
                               "curvature_batch_size")
    if plan.unowned:
      summary.warn(plans.unowned_message(plan))
    plans.warn_unmatched_overrides(self, params)
    summary.warn_if_mostly_fallback(self._summary(plan, params))
    for key, block in plan.all_blocks().items():
      factors[key], inverses[key] = jax.tree.map(lambda x: x.astype(dtype),
                                                 block.init())
      if self.factor_rank is not None:  # which factors are kept at rank
        inverses[key] = linalg.low_rank_identities(
            jax.eval_shape(block.damped, factors[key], jnp.ones([], dtype)),
            inverses[key], self.factor_rank)
    with explicit_axes.params_mesh(params), explicit_axes.params_specs(params, declared):
      placed = tile_placement.specs(plan, tree_paths.flatten(params)[0])
      factors, inverses = (tile_placement.place(tree, placed)
                           for tree in (factors, inverses))
    placement = _placement(self.mesh)
    layout = block_stacks.Layout.of(plan.all_blocks(), factors,
                                    1 if placement is None else placement.num_shards,
                                    stacked=self.factor_rank is None)
    # Distinct buffers: a state passed with donate_argnums must not alias.
    counters = [jnp.zeros([], jnp.int32) for _ in range(5)]
    # Damping 0: no refresh yet (an accepted one has a positive damping).
    return ScaleByKFACState(*counters[:2], layout.stack(factors, placement),
                            layout.stack(inverses, placement),
                            jnp.zeros([], dtype), *counters[2:])

  def _capture(self, plan, params, batch, variables, rng):
    """`capture.capture` of the model on ``batch``: its layers' inputs and
    output gradients, and the fallback params' gradients."""
    flat_params = tree_paths.flatten(params)[0]
    sample_key, model_key = jax.random.split(rng)
    local = functools.partial(replicas.per_device, like=(params, batch, variables, rng))
    return capture.capture(
        plans.hooked_model(self.model, plan, params, batch, variables, model_key,
                           [*variables, capture.INPUTS]),
        local({k: flat_params[path] for k, path in plan.fallback_paths.items()}),
        local(capture.zeros(plan.perturbations)),
        lambda outputs: losses.output_cotangents(
            self.loss, outputs, batch, self.estimation, sample_key,
            self.num_samples))

  def _batch_statistics(self, plan, reached, stacks_layout, placed, params, batch,
                        variables, rng):
    """Every block's batch statistics, in ``stacks_layout`` (a `BlockStacks`),
    tiled blocks' on the devices that hold their shards (``placed``:
    `tile_placement.specs`), from the calls of each layer that reach the
    loss's outputs (``reached``: `reach.reached_calls`)."""
    typed = {}
    captured = explicit_axes.in_model_axes(
        functools.partial(self._capture, plan), params, batch, variables, rng, typed)
    captured = reach.only_reached(captured, reached)
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
    stats, placement = tile_placement.place(stats, placed), _placement(self.mesh)
    return owner_statistics.at_owners(
        plan, stacks_layout.stack(stats, placement), captured, typed.get("specs"),
        terms, placement)

  def _powers(self, plan, factors, damping, power, method, previous=None,
              rank=None, placed=None):
    """Every block's damped factors raised to ``power``: a `BlockStacks`
    like ``factors``, each stack on the devices that own its slots, tiled
    blocks' on the devices holding their shards (``placed``:
    `tile_placement.specs`), the other blocks batched (``previous``: the
    inverses in use, where a method starts from them; ``rank``: see
    `linalg.invert_all`).

    On one device every matrix is in one `linalg.invert_all`, which
    batches them by size across stacks: the autoencoder's 16 factors (10
    sizes, 16 stacks) are 5 batches, each one compiled inversion, not 16.
    Over a mesh each stack stays on the devices that own its slots.
    """
    all_blocks, placement = plan.all_blocks(), _placement(self.mesh)
    rest = {key: all_blocks[key].damped(entry, damping)
            for key, entry in factors.rest.items()}
    placed = placed or {}
    in_place = tile_placement.invert_in_place(
        {key: rest.pop(key) for key in placed}, placed, method, power,
        None if previous is None else {key: previous.rest[key] for key in placed})
    requests = tuple(block_stacks.kronecker_core(all_blocks[group.keys[0]]).damped(
        stack, damping) for group, stack in zip(factors.layout.groups, factors.stacks))
    if placement is None:
      rest, stacks = linalg.invert_all(
          (rest, requests), method, power=power, rank=rank,
          previous=None if previous is None else (
              {key: previous.rest[key] for key in rest}, previous.stacks))
      return factors.replace(stacks, {**rest, **in_place})
    rest = linalg.invert_all(rest, method, linalg.stack_sharding(self.mesh),
                             power=power,
                             previous=None if previous is None else {
                                 key: previous.rest[key] for key in rest},
                             rank=rank)
    rest = {**rest, **in_place}
    invert = lambda request, start: linalg.invert_all(
        request, method, placement, power=power, previous=start)
    stacks = []
    for request, start in zip(requests, (None,) * len(requests)
                              if previous is None else previous.stacks):
      if all(isinstance(r, linalg.Damped) for r in request) and (
          request.a.matrix.shape == request.g.matrix.shape):
        # A square layer's two stacks in one, each slot's A and G side by
        # side so that a device's slots stay its own: half the calls.
        joint = invert(*(block_stacks.interleave(tree) for tree in (request, start)))
        stacks.append(block_stacks.deinterleave(joint))
      else:
        stacks.append(kronecker.KroneckerFactors(*(
            invert(r, s) for r, s in zip(request, start or (None, None)))))
    return factors.replace(tuple(stacks), rest)

  def _refresh_inverses(self, plan, placed, factors, old, damping):
    """New inverses, or all the old ones if the damping or any block failed.

    All or nothing, so that every inverse in use has the one damping that
    the state reports. A damping ≤ 0 (e.g. injected at run time) is
    rejected even where its inverse happens to be finite.
    """
    inverses, old_damping, rejected = old
    fresh = self._powers(plan, factors, damping, -1, self.inverse, inverses,
                         self.factor_rank, placed)
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
    replicas.check_context()
    variables = dict(variables or {})
    params = param_boxes.values(params)
    batch = sub_batch.first_examples(batch, self.curvature_batch_size)
    plan = self._plan(params, batch, variables, list(variables), "batch")
    plans.check_state(plan, state.factors)
    damping = jnp.asarray(damping, state.damping.dtype)
    placed = tile_placement.specs(plan, tree_paths.flatten(params)[0])

    with explicit_axes.params_mesh(params):
      reached = reach.reached_calls(self.model, plan, params, batch,
                                    replicas.names(self.axis_name))
    # Under `on_schedule`'s lax.cond, XLA:CPU would compile the capture's
    # backward convolutions as plain loops (see `canonical_convolutions`).
    batch_statistics = canonical_convolutions.canonical_convolutions(
        functools.partial(self._batch_statistics, plan, reached,
                          state.factors.layout, placed))

    if rng is None:  # fresh dropout masks each step, not one fixed mask's bias
      rng = jax.random.fold_in(jax.random.key(0), state.count)

    def with_new_statistics(carry):
      return fold_in(self.ema_decay, *carry, self.over_replicas(
          batch_statistics(params, batch, variables, rng)))
    factors, stats_count, rejected_statistics = on_schedule(
        self.stats_update_period, self.curvature_warmup, state.count,
        with_new_statistics,
        (state.factors, state.stats_count, state.rejected_statistics))
    inverses, damping, rejected_refreshes = on_schedule(
        self.inverse_update_period, self.curvature_warmup, state.count,
        lambda old: self._refresh_inverses(plan, placed, factors, old, damping),
        (state.inverses, state.damping, state.rejected_refreshes))
    # The tiles stay with their shards whatever XLA would choose for the EMA.
    factors, inverses = (tree.replace(tree.stacks, tile_placement.place(tree.rest, placed))
                         for tree in (factors, inverses))
    return state._replace(
        count=optax.safe_increment(state.count), stats_count=stats_count,
        factors=factors, inverses=inverses, damping=damping,
        rejected_statistics=rejected_statistics,
        rejected_refreshes=rejected_refreshes)

  # -- products -------------------------------------------------------------

  def _apply(self, plan: plans.Plan, matrices: block_stacks.BlockStacks,
             vector: Any) -> Any:
    """Each block's ``matrices`` applied to its leaves of ``vector``; a
    stack's blocks on the devices that own their slots (`block_stacks`)."""
    flat, treedef = tree_paths.flatten(vector)
    out = dict(flat)
    grads = lambda path, block: {n: flat[path + (n,)] for n in block.param_names}
    for key, (path, block) in plan.layers.items():
      if key in matrices.rest:
        layer = block.precondition(matrices.rest[key], grads(path, block))
        out.update({path + (n,): leaf for n, leaf in layer.items()})
    placement = _placement(self.mesh)
    for group, stack in zip(matrices.layout.groups, matrices.stacks):
      gradients = {key: block_stacks.gradient_matrix(
          plan.layers[key][1], grads(*plan.layers[key]), stack.a.dtype)
                   for key in group.keys}
      layouts = None if placement is None else self._matrix_layouts(
          plan, group, flat, gradients)
      for key, product in self._sandwiches(group, stack, gradients, placement,
                                           layouts).items():
        path, block = plan.layers[key]
        layer = block_stacks.matrix_leaves(block, product)
        out.update({path + (n,): leaf for n, leaf in layer.items()})
    if plan.fallback is not None:
      diagonal = plan.fallback.precondition(
          matrices[FALLBACK], {k: flat[p] for k, p in plan.fallback_paths.items()})
      out.update({plan.fallback_paths[k]: v for k, v in diagonal.items()})
    return tree_paths.rebuild(treedef, out)

  @staticmethod
  def _matrix_layouts(plan: plans.Plan, group: block_stacks.Group, flat: dict,
                      gradients: dict[str, jax.Array]) -> list[linalg.MatrixLayout] | None:
    """How each gradient matrix of ``group`` (``gradients``, from the leaves
    in ``flat``) lies on the mesh, from the params' shardings under Explicit
    axes; None if any is unknown."""
    layouts = []
    for key in group.keys:
      spec = block_stacks.gradient_matrix_spec(*plan.layers[key], flat)
      layout = None if spec is None else linalg.MatrixLayout.of(spec, gradients[key].ndim)
      if layout is None:
        return None
      layouts.append(layout)
    return layouts

  @staticmethod
  def _sandwiches(group: block_stacks.Group, stack: kronecker.KroneckerFactors,
                  gradients: dict[str, jax.Array],
                  placement: linalg.StackSharding | None,
                  layouts: list[linalg.MatrixLayout] | None) -> dict[str, jax.Array]:
    """``A⁻¹ V G⁻¹`` of each gradient matrix of ``group`` (block key ->
    ``V`` with its leading axes), on the devices that own its slot.

    Where every ``V``'s layout on the mesh is known (``layouts``: from the
    types under Explicit axes, the params' boxes under Auto), the matrices
    are moved to their owners and back by hand (`linalg.owner_routing`);
    otherwise they are stacked as arrays, and XLA moves them
    (all-gathering the stack)."""
    if (layouts is not None and group.slots % placement.num_shards == 0
        and linalg.routable(next(iter(gradients.values())).shape, placement.num_shards)
        and all(set(l.rows + l.cols) <= set(placement.axes) for l in layouts)):
      flat = [gradients[key].reshape(math.prod(lead), *gradients[key].shape[len(lead):])
              for key, _, lead in group.offsets()]
      routed = linalg.at_owners(
          kronecker.sandwich, stack, flat, layouts, group.slots, placement.axes,
          placement.mesh)
      return {key: product.reshape(gradients[key].shape)
              for key, product in zip(group.keys, routed)}
    products = kronecker.sandwich(
        stack, block_stacks.stack_group(group, gradients, placement))
    if placement is not None:
      products = placement.place(products)
    return block_stacks.unstack_group(group, products)

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
    given, vector = vector, param_boxes.values(vector)
    plan = self._example_plan(vector)
    plans.check_state(plan, state.factors)
    product = self._apply(plan, state.inverses, vector)
    scale = 1.0
    for u, v in zip(jax.tree.leaves(product), jax.tree.leaves(vector)):
      if (jnp.issubdtype(v.dtype, jnp.floating)
          and jnp.finfo(v.dtype).max < jnp.finfo(u.dtype).max):
        limit = float(jnp.finfo(v.dtype).max) / 16
        scale = jnp.minimum(scale, limit / jnp.maximum(jnp.max(jnp.abs(u)), limit))
    fitted = jax.tree.map(lambda u, v: (u * scale).astype(v.dtype), product, vector)
    return param_boxes.like(given, fitted), state._replace(
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
    given, vector = vector, param_boxes.values(vector)
    plan = self._example_plan(vector)
    plans.check_state(plan, state.factors)
    powered = self._powers(plan, state.factors,
                           jnp.asarray(damping, state.damping.dtype), power, "eigh")
    return param_boxes.like(given, jax.tree.map(
        lambda u, v: u.astype(v.dtype), self._apply(plan, powered, vector), vector))

  def over_replicas(self, tree: Any) -> Any:
    """``tree``, means over this device's share of the batch, averaged
    over ``axis_name``: the whole batch's means (`replicas`)."""
    return replicas.mean(tree, replicas.axes(self.axis_name))

  def output_tangents(self, params: Any, batch: Any, vectors: Any,
                      variables: dict | None = None, rng: jax.Array | None = None):
    """``(outputs, J v for each v)``: the model output and its directional
    derivatives along a stack of params-shaped ``vectors`` (leading axis)."""
    model = lambda p: self.forward(p, batch, variables, rng)
    outputs, push = jax.linearize(model, params)
    return outputs, jax.vmap(push)(vectors)

  def output_fisher(self, outputs: Any, batch: Any, tangents: Any) -> Any:
    """``(1/L) F_out u`` per term for output tangents ``u`` (``outputs``'
    shape, after any leading axes of a stack of them; a tuple of such for a
    `losses.joint`), each term weighted by the loss mask: masked terms zero."""
    product = self.loss.fisher_product(outputs, tangents)
    weights = self.loss.output_weights(outputs, batch)
    if weights is not None:
      product = jax.tree.map(jnp.multiply, product, weights)
    count = self.loss.terms(outputs, batch).count
    return jax.tree.map(lambda p: p / count, product)

  def exact_product(self, params: Any, batch: Any, vector: Any,
                    variables: dict | None = None, rng: jax.Array | None = None):
    """The exact Fisher-vector product ``F v = (1/L) Σ_terms Jᵀ F_out J v``.

    For the losses here (exponential families in their natural parameters)
    the Fisher equals the generalised Gauss-Newton matrix. One linearised
    forward pass and one backward pass; no matrix is formed. With
    ``axis_name``, the whole batch's product (`replicas`).
    """
    params, vector = replicas.per_device((params, vector), (params, batch, variables, rng))
    model = lambda p: self.forward(p, batch, variables, rng)
    outputs, tangent = jax.jvp(model, (params,), (vector,))
    _, pull = jax.vjp(model, params)
    return self.over_replicas(pull(jax.tree.map(
        lambda p, f: p.astype(f.dtype), self.output_fisher(outputs, batch, tangent),
        outputs))[0])
